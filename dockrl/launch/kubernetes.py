"""Kubernetes worker backend: one StatefulSet and one headless Service per worker group.

The launcher (the pipeline's train pod) renders the objects in Python (``render_group``) and
creates them through the ``kubernetes`` client. Every object carries the run's labels
(``dockrl.io/run``, ``dockrl.io/group``) and an owner reference to the launcher pod, so
Kubernetes garbage-collects the workers if the launcher pod goes away; ``teardown`` (the
pipeline's exit handler) deletes them by label as soon as the run ends.

Member ``i`` of group ``g`` is the pod ``<statefulset>-i``, reachable at
``<statefulset>-i.<service>.<namespace>.svc`` (``address``); it gets ``DOCKRL_RUN_ID``,
``DOCKRL_GROUP``, ``DOCKRL_REPLICA``, ``DOCKRL_REPLICAS``, ``DOCKRL_SERVICE`` and the
object-store credentials from the platform's Secret. Accelerator groups take the platform's
image, accelerators, node selector, tolerations and stage pod size; the others its cpu image.

How a run's stages find what they need, in pods that cannot see the launcher's files:

* program: the images' entry point ``dockrl`` (``images/*/Dockerfile``), so a member's command
  is ``dockrl worker ...`` / ``dockrl dock-shard ...`` (``program``);
* serving: a dock shard binds ``0.0.0.0`` on ``SHARD_PORT`` in its own pod (``serve_ports``);
* finishing: a StatefulSet restarts a container that exits, even with code 0 (a crash loop
  of finished stages), so stages stay up after their last report until torn down
  (``restarts_exited``: ``dockrl worker --stay``);
* the launcher: members reach servers of the launcher's process (the weight channel's
  ``TCPStore``) at the launcher pod's IP, ``POD_IP`` from the downward API (``status.podIP``;
  the pipeline's train task sets it). A pod IP, not a Service: the store lives exactly as long
  as the launcher's process, in that pod, and a Service would need a selector matching only
  that pod and one more object to create and delete;
* files: every pod mounts the platform's shared volume (``Platform.shared_volume_claim``) at
  ``shared_mount_path``, the launcher too; the launcher puts the run's folder (data,
  checkpoints) under ``shared_dir`` (``launcher.py``).

``check`` fails fast: a member that exited non-zero, crash-loops, or cannot pull its image
raises ``WorkerFailed`` with the tail of its log (the previous container's, after a restart).
"""

from __future__ import annotations

import hashlib
import logging
import os
import re
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Sequence

from dockrl.launch.backend import WorkerFailed, WorkerGroup
from dockrl.launch.platform import OBJECT_STORE_KEYS, Platform, get_platform

logger = logging.getLogger(__name__)

RUN_LABEL = "dockrl.io/run"
GROUP_LABEL = "dockrl.io/group"
CONTAINER = "worker"
ENTRY_POINT = ("dockrl",)
"""The images' entry point: the program of every member's command."""
SHARD_PORT = 8815
"""Port of a dock shard in its pod (Arrow Flight's customary port; each shard has its own pod IP)."""
SHARED_VOLUME = "shared"
WORKER_UID = 10001  # the non-root user of the images (images/*/Dockerfile)
SA_NAMESPACE_FILE = "/var/run/secrets/kubernetes.io/serviceaccount/namespace"
# waiting reasons that will not resolve by waiting
FATAL_WAITING = {"CrashLoopBackOff", "ErrImagePull", "ImagePullBackOff", "InvalidImageName",
                 "CreateContainerConfigError", "CreateContainerError", "RunContainerError"}
_LABEL_VALUE = re.compile(r"^[A-Za-z0-9]([-A-Za-z0-9_.]{0,61}[A-Za-z0-9])?$")


@dataclass(frozen=True, kw_only=True)
class OwnerPod:
    """The launcher pod that owns a run's workers (its name and uid, from the downward API)."""

    name: str
    uid: str

    def reference(self) -> dict[str, Any]:
        # no blockOwnerDeletion: it would need update rights on pods/finalizers for the launcher
        return {"apiVersion": "v1", "kind": "Pod", "name": self.name, "uid": self.uid}


def object_name(run_id: str, group: str) -> str:
    """``dockrl-<8 hex of the run id's hash>-<group>``: ≤ 48 characters, so pod names and
    the StatefulSet's revision label stay within Kubernetes' 63-character limit."""
    return f"dockrl-{hashlib.sha1(run_id.encode()).hexdigest()[:8]}-{group}"


def run_labels(run_id: str, group: str) -> dict[str, str]:
    return {
        "app.kubernetes.io/name": "dockrl-worker", "app.kubernetes.io/component": group,
        "app.kubernetes.io/part-of": "dockrl", "app.kubernetes.io/managed-by": "dockrl-launcher",
        RUN_LABEL: run_id, GROUP_LABEL: group,
    }


def _resources(group: WorkerGroup, platform: Platform) -> dict[str, dict[str, Any]]:
    amounts: dict[str, Any] = {"cpu": group.cpu, "memory": group.memory}
    if group.accelerators:
        amounts = {"cpu": platform.stage_cpu, "memory": platform.stage_memory}
        if platform.accelerator:
            amounts[platform.accelerator] = platform.accelerators_per_pod
    # requests = limits: Guaranteed QoS, so a worker is the last to be evicted
    return {"requests": dict(amounts), "limits": dict(amounts)}


def _env(run_id: str, group: WorkerGroup, service: str, platform: Platform) -> list[dict[str, Any]]:
    env: list[dict[str, Any]] = [
        {"name": "DOCKRL_RUN_ID", "value": run_id},
        {"name": "DOCKRL_GROUP", "value": group.name},
        {"name": "DOCKRL_REPLICAS", "value": str(group.replicas)},
        {"name": "DOCKRL_REPLICA", "valueFrom": {"fieldRef": {"fieldPath": "metadata.labels['apps.kubernetes.io/pod-index']"}}},
        {"name": "DOCKRL_SERVICE", "value": service},
        {"name": "POD_NAME", "valueFrom": {"fieldRef": {"fieldPath": "metadata.name"}}},
        {"name": "POD_NAMESPACE", "valueFrom": {"fieldRef": {"fieldPath": "metadata.namespace"}}},
    ]
    env += [{"name": k, "value": v} for k, v in sorted(group.env.items())]
    if platform.object_store_secret:
        env += [{"name": k, "valueFrom": {"secretKeyRef": {"name": platform.object_store_secret, "key": k}}}
                for k in OBJECT_STORE_KEYS]
    return env


def render_group(group: WorkerGroup, *, run_id: str, namespace: str, platform: Platform,
                 owner: OwnerPod | None = None) -> tuple[dict[str, Any], dict[str, Any]]:
    """The headless Service and the StatefulSet of one worker group, as API objects (dicts).

    Raises:
        ValueError: ``run_id`` is not a valid label value (≤ 63 characters, alphanumerics,
            ``-``, ``_``, ``.``).
    """
    if not _LABEL_VALUE.match(run_id):
        raise ValueError(f"run_id {run_id!r}: must be a Kubernetes label value (≤ 63 alphanumerics, '-', '_', '.')")
    name = object_name(run_id, group.name)
    labels = run_labels(run_id, group.name)
    selector = {RUN_LABEL: run_id, GROUP_LABEL: group.name}
    meta: dict[str, Any] = {"name": name, "namespace": namespace, "labels": labels}
    if owner is not None:
        meta["ownerReferences"] = [owner.reference()]
    ports = [{"name": "rpc", "port": group.port, "targetPort": group.port, "protocol": "TCP"}] if group.port else []
    service = {
        "apiVersion": "v1", "kind": "Service", "metadata": dict(meta),
        # headless, and publishing members before they are ready: peers find each other to rendezvous
        "spec": {"clusterIP": "None", "selector": selector, "publishNotReadyAddresses": True, "ports": ports},
    }
    mounts = [{"name": "dshm", "mountPath": "/dev/shm"}]
    # torch's dataloaders and collectives need more shared memory than the default 64 MiB
    volumes: list[dict[str, Any]] = [{"name": "dshm", "emptyDir": {"medium": "Memory"}}]
    if platform.shared_volume_claim:
        mounts.append({"name": SHARED_VOLUME, "mountPath": platform.shared_mount_path})
        volumes.append({"name": SHARED_VOLUME, "persistentVolumeClaim": {"claimName": platform.shared_volume_claim}})
    container: dict[str, Any] = {
        "name": CONTAINER, "image": platform.image if group.accelerators else platform.cpu_image, "imagePullPolicy": "IfNotPresent",
        "command": list(group.command), "env": _env(run_id, group, name, platform),
        "resources": _resources(group, platform),
        "volumeMounts": mounts,
        "securityContext": {"allowPrivilegeEscalation": False, "capabilities": {"drop": ["ALL"]}},
    }
    if group.port:
        container["ports"] = [{"name": "rpc", "containerPort": group.port, "protocol": "TCP"}]
    pod_spec: dict[str, Any] = {
        "automountServiceAccountToken": False,  # workers never call the API server
        "securityContext": {"runAsNonRoot": True, "runAsUser": WORKER_UID, "runAsGroup": WORKER_UID, "fsGroup": WORKER_UID},
        "terminationGracePeriodSeconds": 30,
        "containers": [container],
        "volumes": volumes,
    }
    if group.accelerators:
        if platform.node_selector:
            pod_spec["nodeSelector"] = dict(platform.node_selector)
        if platform.tolerations:
            pod_spec["tolerations"] = [t.to_k8s() for t in platform.tolerations]
    statefulset = {
        "apiVersion": "apps/v1", "kind": "StatefulSet", "metadata": dict(meta),
        "spec": {
            "serviceName": name, "replicas": group.replicas,
            "podManagementPolicy": "Parallel",  # members start together: they wait for each other anyway
            "selector": {"matchLabels": selector},
            "template": {"metadata": {"labels": labels}, "spec": pod_spec},
        },
    }
    return service, statefulset


def _api_exception():
    from kubernetes.client.exceptions import ApiException

    return ApiException


class KubernetesBackend:
    """Worker groups as StatefulSets (see the module docstring).

    Args:
        run_id: the pipeline run's id; labels every object.
        namespace: where the workers go.
        platform: image, accelerators, scheduling and Secret of the workers.
        core_api, apps_api: ``kubernetes.client.CoreV1Api`` / ``AppsV1Api`` (or fakes).
        owner: the launcher pod; None leaves the objects unowned (teardown still finds them).
        launcher_ip: the launcher pod's IP (``POD_IP``); "" if unknown (then only
            ``launcher_host`` fails: teardown needs none).
        start_timeout_s: longest a member may take to run (scheduling, image pull), seconds.
    """

    bind_host = "0.0.0.0"  # a pod's own network namespace: every interface is the pod's
    restarts_exited = True  # StatefulSet pods restart always, even after exit code 0

    def __init__(self, run_id: str, *, namespace: str, platform: Platform, core_api: Any, apps_api: Any,
                 owner: OwnerPod | None = None, launcher_ip: str = "", start_timeout_s: float = 900.0,
                 poll_s: float = 2.0, log_lines: int = 50):
        if not namespace:
            raise ValueError("kubernetes backend: namespace is empty")
        if not _LABEL_VALUE.match(run_id):
            raise ValueError(f"run_id {run_id!r}: must be a Kubernetes label value (≤ 63 alphanumerics, '-', '_', '.')")
        self.run_id, self.namespace, self.platform, self.owner = run_id, namespace, platform, owner
        self.core, self.apps = core_api, apps_api
        self.launcher_ip, self.start_timeout_s = launcher_ip, start_timeout_s
        self.poll_s, self.log_lines = poll_s, log_lines
        self.selector = f"{RUN_LABEL}={run_id}"

    # ---- addressing (see the module docstring) ----

    @property
    def launcher_host(self) -> str:
        if not self.launcher_ip:
            raise ValueError("kubernetes backend: the launcher pod's IP is unknown; set POD_IP from the downward API "
                             "(fieldPath status.podIP) on the launcher pod, as the pipeline's train task does")
        return self.launcher_ip

    @property
    def shared_dir(self) -> Path:
        """The shared volume's mount path, the same in the launcher and in every member.

        Raises:
            ValueError: the platform has no shared volume.
        """
        if not self.platform.shared_volume_claim:
            raise ValueError(f"kubernetes backend: platform {self.platform.name!r} has no shared_volume_claim; stage pods "
                             "need one shared with the launcher (manifests/base/shared-volume.yaml)")
        return Path(self.platform.shared_mount_path)

    @property
    def logs(self) -> str:
        return f"`kubectl logs -n {self.namespace} -l {self.selector} --prefix`"

    def program(self) -> tuple[str, ...]:
        return ENTRY_POINT

    def serve_ports(self, n: int) -> list[int]:
        return [SHARD_PORT] * n

    def address(self, group: str, replica: int, port: int) -> str:
        name = object_name(self.run_id, group)
        return f"{name}-{replica}.{name}.{self.namespace}.svc:{port}"

    @classmethod
    def from_cluster(cls, run_id: str, *, namespace: str = "", platform: str | Platform = "cpu", **kwargs) -> KubernetesBackend:
        """A backend with the pod's in-cluster credentials (or ``~/.kube/config`` outside a cluster).

        The namespace defaults to ``POD_NAMESPACE`` or the service account's namespace; the owner
        is the pod named by ``POD_NAME`` / ``POD_UID``, the launcher's IP ``POD_IP`` (the
        pipeline's train task sets all three).
        """
        from kubernetes import client, config

        try:
            config.load_incluster_config()
        except config.ConfigException:
            config.load_kube_config()
        if not namespace:
            namespace = os.environ.get("POD_NAMESPACE", "")
        if not namespace and Path(SA_NAMESPACE_FILE).is_file():
            namespace = Path(SA_NAMESPACE_FILE).read_text().strip()
        if not namespace:
            raise ValueError("kubernetes backend: no namespace given and none found (POD_NAMESPACE, service account)")
        owner = None
        if os.environ.get("POD_NAME") and os.environ.get("POD_UID"):
            owner = OwnerPod(name=os.environ["POD_NAME"], uid=os.environ["POD_UID"])
        platform = get_platform(platform) if isinstance(platform, str) else platform
        kwargs.setdefault("launcher_ip", os.environ.get("POD_IP", ""))
        return cls(run_id, namespace=namespace, platform=platform, core_api=client.CoreV1Api(),
                   apps_api=client.AppsV1Api(), owner=owner, **kwargs)

    def render(self, groups: Sequence[WorkerGroup]) -> list[dict[str, Any]]:
        """Every object of ``groups``: each group's Service, then its StatefulSet."""
        names = [g.name for g in groups]
        if len(set(names)) != len(names):
            raise ValueError(f"worker groups: duplicate names in {names}")
        objects: list[dict[str, Any]] = []
        for g in groups:
            objects += render_group(g, run_id=self.run_id, namespace=self.namespace, platform=self.platform, owner=self.owner)
        return objects

    def start(self, groups: Sequence[WorkerGroup]) -> None:
        ApiException = _api_exception()
        for obj in self.render(groups):
            kind, name = obj["kind"], obj["metadata"]["name"]
            try:
                if kind == "Service":
                    self.core.create_namespaced_service(namespace=self.namespace, body=obj)
                else:
                    self.apps.create_namespaced_stateful_set(namespace=self.namespace, body=obj)
            except ApiException as err:
                if err.status == 409:
                    raise RuntimeError(f"{kind} {self.namespace}/{name} already exists: run {self.run_id!r} was started "
                                       "before; tear it down first (`teardown_run('kubernetes', run_id)`)") from None
                if err.status == 403:
                    raise RuntimeError(f"not allowed to create {kind} in namespace {self.namespace!r}: bind the launcher's "
                                       "service account to the dockrl-launcher Role (manifests/base/rbac.yaml)") from None
                raise
            logger.info("created %s %s/%s", kind, self.namespace, name)

    def _pods(self) -> list[Any]:
        return self.core.list_namespaced_pod(namespace=self.namespace, label_selector=self.selector).items

    def _log_tail(self, pod: str, previous: bool) -> str:
        ApiException = _api_exception()
        try:
            return self.core.read_namespaced_pod_log(name=pod, namespace=self.namespace, container=CONTAINER,
                                                     tail_lines=self.log_lines, previous=previous)
        except ApiException as err:
            return f"(no log: HTTP {err.status} {err.reason})"

    def check(self) -> None:
        for pod in self._pods():
            name = pod.metadata.name
            group = (pod.metadata.labels or {}).get(GROUP_LABEL, "?")
            if pod.status.phase == "Failed":
                raise WorkerFailed(group, name, f"pod failed: {pod.status.reason or ''} {pod.status.message or ''}".strip(),
                                   self._log_tail(name, previous=False))
            for cs in pod.status.container_statuses or []:
                # the API leaves unset parts out: state, last_state and their fields may each be None
                waiting = cs.state.waiting if cs.state else None
                terminated = cs.state.terminated if cs.state else None
                last = cs.last_state.terminated if cs.last_state else None
                if terminated is not None and terminated.exit_code != 0:
                    raise WorkerFailed(group, name, f"exited with code {terminated.exit_code} ({terminated.reason})",
                                       self._log_tail(name, previous=False))
                if waiting is not None and waiting.reason in FATAL_WAITING:
                    restarted = last is not None
                    why = f"{waiting.reason}: {waiting.message or ''}".strip()
                    if restarted:
                        why += f"; last exit code {last.exit_code}"
                    tail = self._log_tail(name, previous=True) if restarted else ""
                    raise WorkerFailed(group, name, why, tail)
                if cs.restart_count and last is not None and last.exit_code != 0:
                    # a restarted worker has lost its state (weights, claimed rows): the run cannot go on
                    raise WorkerFailed(group, name, f"restarted {cs.restart_count}x; last exit code {last.exit_code}",
                                       self._log_tail(name, previous=True))

    def wait_ready(self, timeout_s: float) -> None:
        deadline = time.monotonic() + timeout_s
        while True:
            self.check()
            sets = self.apps.list_namespaced_stateful_set(namespace=self.namespace, label_selector=self.selector).items
            pending = {s.metadata.name: f"{s.status.ready_replicas or 0}/{s.spec.replicas}" for s in sets
                       if (s.status.ready_replicas or 0) < s.spec.replicas}
            if sets and not pending:
                return
            if time.monotonic() > deadline:
                unschedulable = [p.metadata.name for p in self._pods() for c in (p.status.conditions or [])
                                 if c.type == "PodScheduled" and c.status == "False"]
                hint = f"; not scheduled (no node with the resources, selector and taints?): {unschedulable}" if unschedulable else ""
                raise TimeoutError(f"workers of run {self.run_id!r} not ready after {timeout_s:.0f} s: "
                                   f"{pending or 'no StatefulSets found'}{hint}")
            time.sleep(self.poll_s)

    def teardown(self) -> int:
        """Delete the run's StatefulSets (their pods go with them) and Services; returns how many."""
        ApiException = _api_exception()
        removed = 0
        listed = [
            (self.apps.list_namespaced_stateful_set, self.apps.delete_namespaced_stateful_set),
            (self.core.list_namespaced_service, self.core.delete_namespaced_service),
        ]
        for list_fn, delete_fn in listed:
            for obj in list_fn(namespace=self.namespace, label_selector=self.selector).items:
                try:
                    delete_fn(name=obj.metadata.name, namespace=self.namespace, propagation_policy="Background")
                    removed += 1
                except ApiException as err:
                    if err.status != 404:  # already gone is fine: teardown may run twice
                        raise
        logger.info("kubernetes teardown of run %s in %s: %d object(s) deleted", self.run_id, self.namespace, removed)
        return removed
