"""Kubernetes worker backend: a run's workers as one JobSet, watched until the run ends.

The launcher (the pipeline's train pod) renders the run's objects (``jobset.py``: a Secret,
the JobSet, a Volcano PodGroup if asked for) and creates them through the ``kubernetes``
client, all groups at once. Every object carries the run's labels (``dockrl.io/run``,
``dockrl.io/group``); the Secret and the PodGroup are owned by the JobSet, the JobSet by the
launcher pod. ``teardown`` (the driver's ``finally`` and the pipeline's exit handler) deletes
them by label; the Jobs' ``activeDeadlineSeconds``, the JobSet's TTL and the driver's lease on
the dock (``dockrl.lifeline``: when the launcher stops renewing it for ``run.driver_timeout_s``
the shards and the stages exit) bound what a lost launcher leaves behind.

How a run's stages find what they need, in pods that cannot see the launcher's files:

* program: the images' entry point ``dockrl`` (``images/*/Dockerfile``), so a pod's arguments
  are ``worker ...`` / ``dock-shard ...`` (``program`` is empty), or ``node ...`` for a pod that
  holds several rank processes (``jobset.pod_shape``);
* addresses: member ``i`` of group ``g`` is ``<jobset>-<g>-0-<i>.<jobset>.<namespace>.svc``
  through the JobSet's headless Service; a dock shard binds ``0.0.0.0`` on ``SHARD_PORT``;
* the launcher: members reach servers of the launcher's process (the weight channel's
  ``TCPStore``) at the launcher pod's IP, ``POD_IP`` from the downward API (the pipeline's
  train task sets it): the store lives exactly as long as the launcher's process;
* files: every pod mounts the platform's shared volume at ``shared_mount_path``, the launcher
  too; the launcher puts the run's folder (data, checkpoints) under ``shared_dir``;
* secrets: the dock's bearer token is in the run's Secret, read through ``secretKeyRef``.

``check`` (called every half second by the driver; it asks the API at most every ``poll_s``)
fails the run with ``WorkerFailed`` naming the pod, the reason and its log tail when a
worker pod

* failed or exited non-zero (``OOMKilled`` and the exit code named), was evicted;
* is being deleted (drain, preemption: its ``DisruptionTarget`` condition named), vanished,
  or was replaced by a new pod of the same index;
* failed to pull its image more than ``Platform.image_pull_retries`` times (the kubelet
  retries with back-off, so one registry hiccup passes), has an invalid image name or a
  container that cannot be created;
* stayed unschedulable past ``Platform.schedule_timeout_s`` (at once if the cluster
  autoscaler says no node group can fit it), or was scheduled but not started within
  ``Platform.image_pull_timeout_s`` (pulls of a large image take long: they get their own
  clock); time queued for admission (Kueue suspends the JobSet; a Volcano PodGroup waits
  ``Pending``) counts against ``Platform.queue_timeout_s`` instead;

and when the JobSet itself failed (its deadline, its failure policy) or was deleted.
"""

from __future__ import annotations

import logging
import math
import os
import time
from collections import Counter
from pathlib import Path
from typing import Any, Callable, Sequence

from dockrl.launch.backend import WorkerFailed, WorkerGroup
from dockrl.launch.jobset import (
    COMPLETION_INDEX,
    CONTAINER,
    GROUP_LABEL,
    JOBSET_GROUP,
    JOBSET_PLURAL,
    JOBSET_VERSION,
    RUN_LABEL,
    VOLCANO_GROUP,
    VOLCANO_PLURAL,
    VOLCANO_VERSION,
    check_run_id,
    jobset_name,
    member_host,
    pod_shape,
    render_jobset,
    secret_name,
)
from dockrl.launch.platform import Platform, get_platform

logger = logging.getLogger(__name__)

ENTRY_POINT: tuple[str, ...] = ()
"""What a member's command starts with: nothing, since the images' ENTRYPOINT is ``dockrl`` (on
the NPU image a script that sources CANN's environment first), and a pod gives only its arguments."""
SHARD_PORT = 8815
"""Port of a dock shard in its pod (Arrow Flight's customary port; each shard has its own pod IP)."""
SA_NAMESPACE_FILE = "/var/run/secrets/kubernetes.io/serviceaccount/namespace"
PULL_FAILED = ("ErrImagePull", "ImagePullBackOff")
"""Waiting reasons of a failed image pull: the kubelet retries, so they count against a budget."""
FATAL_WAITING = {"InvalidImageName", "CrashLoopBackOff", "CreateContainerConfigError", "CreateContainerError", "RunContainerError"}
"""Waiting reasons that will not resolve by waiting."""
NO_SCALE_UP = "NotTriggerScaleUp"
"""Cluster autoscaler event: no node group can ever fit the pod."""


class OwnerPod:
    """The launcher pod that owns a run's JobSet (its name and uid, from the downward API)."""

    def __init__(self, *, name: str, uid: str):
        self.name, self.uid = name, uid

    def __eq__(self, other: object) -> bool:
        return isinstance(other, OwnerPod) and (self.name, self.uid) == (other.name, other.uid)

    def __repr__(self) -> str:
        return f"OwnerPod(name={self.name!r}, uid={self.uid!r})"

    def reference(self) -> dict[str, Any]:
        # no blockOwnerDeletion: it would need update rights on pods/finalizers for the launcher
        return {"apiVersion": "v1", "kind": "Pod", "name": self.name, "uid": self.uid}


def _describe(group: WorkerGroup, platform: Platform) -> str:
    shape = pod_shape(group, platform)
    if not group.devices:
        return f"{group.name}×{shape.pods}"
    return f"{group.name}×{shape.pods} ({shape.members} rank process(es), {group.devices * shape.members} device(s) per pod)"


def _api_exception():
    from kubernetes.client.exceptions import ApiException

    return ApiException


def _get(obj: Any, *path: str) -> Any:
    """``obj.a.b`` of a client model (or ``obj["a"]["b"]`` of a dict), None where a part is unset."""
    for key in path:
        if obj is None:
            return None
        obj = obj.get(key) if isinstance(obj, dict) else getattr(obj, key, None)
    return obj


class KubernetesBackend:
    """A run's worker groups as one JobSet (see the module docstring).

    Args:
        run_id: the pipeline run's id; labels every object.
        namespace: where the workers go.
        platform: image, devices, scheduling, timeouts and Secret of the workers.
        core_api, custom_api: ``kubernetes.client.CoreV1Api`` / ``CustomObjectsApi`` (or fakes).
        owner: the launcher pod; None leaves the JobSet unowned (teardown still finds it).
        launcher_ip: the launcher pod's IP (``POD_IP``); "" if unknown (then only
            ``launcher_host`` fails: teardown needs none).
        poll_s: least time between two looks at the API, seconds.
        log_lines: lines of a failed worker's log in its error.
        teardown_wait_s: how long ``teardown`` waits for the pods to be gone, seconds (0: not at all).
        clock: monotonic seconds (tests pass a fake one).
    """

    bind_host = "0.0.0.0"  # a pod's own network namespace: every interface is the pod's

    def __init__(self, run_id: str, *, namespace: str, platform: Platform, core_api: Any, custom_api: Any,
                 owner: OwnerPod | None = None, launcher_ip: str = "", poll_s: float = 2.0, log_lines: int = 50,
                 teardown_wait_s: float = 0.0, clock: Callable[[], float] = time.monotonic):
        if not namespace:
            raise ValueError("kubernetes backend: namespace is empty")
        check_run_id(run_id)
        self.run_id, self.namespace, self.platform, self.owner = run_id, namespace, platform, owner
        self.core, self.custom = core_api, custom_api
        self.launcher_ip, self.poll_s, self.log_lines = launcher_ip, poll_s, log_lines
        self.teardown_wait_s, self.clock = teardown_wait_s, clock
        self.name = jobset_name(run_id)
        self.selector = f"{RUN_LABEL}={run_id}"
        # the outer bound of wait_ready; check() applies each phase's own timeout within it
        self.start_timeout_s = float(platform.queue_timeout_s + platform.schedule_timeout_s + platform.image_pull_timeout_s)
        # admitted together (the JobSet, or the PodGroup, is queued whole); then each pod is
        # scheduled and pulls its image on its own clock
        self.start_spread_s = float(platform.schedule_timeout_s + platform.image_pull_timeout_s)
        self._expected: dict[str, int] = {}  # group -> pods
        self._members: dict[tuple[str, str], tuple[str, str]] = {}  # (group, index) -> (pod name, uid) first seen
        self._since: dict[tuple[str, str], float] = {}  # (pod uid, phase) -> first seen in that phase
        self._warned: set[tuple[str, str]] = set()
        self._last_look = -math.inf

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
        return f"{member_host(self.run_id, group, replica, self.namespace)}:{port}"

    @classmethod
    def from_cluster(cls, run_id: str, *, namespace: str = "", platform: str | Platform = "cpu", **kwargs) -> KubernetesBackend:
        """A backend with the pod's in-cluster credentials (or ``~/.kube/config`` outside a cluster).

        The namespace defaults to this pod's own: ``POD_NAMESPACE`` or the service account's
        namespace; the owner is the pod named by ``POD_NAME`` / ``POD_UID``, the launcher's IP
        ``POD_IP`` (the pipeline's train task sets all four).

        Raises:
            ValueError: no namespace given or found; or, in an owner pod, a ``namespace`` other
                than the pod's own (the workers of a run live in its launcher's namespace).
        """
        from kubernetes import client, config

        try:
            config.load_incluster_config()
        except config.ConfigException:
            config.load_kube_config()
        own = os.environ.get("POD_NAMESPACE", "")
        if not own and Path(SA_NAMESPACE_FILE).is_file():
            own = Path(SA_NAMESPACE_FILE).read_text().strip()
        namespace = namespace or own
        if not namespace:
            raise ValueError("kubernetes backend: no namespace given and none found (POD_NAMESPACE, service account)")
        owner = None
        if os.environ.get("POD_NAME") and os.environ.get("POD_UID"):
            owner = OwnerPod(name=os.environ["POD_NAME"], uid=os.environ["POD_UID"])
        if owner is not None and own and namespace != own:
            # Kubernetes treats an owner reference to another namespace's pod as absent: the
            # garbage collector would delete the workers as soon as they exist
            raise ValueError(f"kubernetes backend: namespace={namespace!r}, but the launcher pod {owner.name} runs in {own!r}; "
                             "a run's workers live in its launcher's namespace (the JobSet is owned by the launcher pod, "
                             "and an owner reference cannot cross namespaces; the launcher's Role, the NetworkPolicy, the shared "
                             "volume and the Secrets are namespaced too): leave namespace empty, or run the pipeline in that namespace")
        platform = get_platform(platform) if isinstance(platform, str) else platform
        kwargs.setdefault("launcher_ip", os.environ.get("POD_IP", ""))
        return cls(run_id, namespace=namespace, platform=platform, core_api=client.CoreV1Api(),
                   custom_api=client.CustomObjectsApi(), owner=owner, **kwargs)

    def render(self, groups: Sequence[WorkerGroup]) -> list[dict[str, Any]]:
        """The run's objects in creation order (``jobset.render_jobset``)."""
        return render_jobset(groups, run_id=self.run_id, namespace=self.namespace, platform=self.platform,
                             owner=self.owner.reference() if self.owner else None)

    # ---- start ----

    def start(self, groups: Sequence[WorkerGroup]) -> None:
        """Create the run's Secret, PodGroup (Volcano) and JobSet: every group at once.

        Raises:
            RuntimeError: the run's objects exist already (started before), the launcher may
                not create them (RBAC), or the JobSet or PodGroup API is not installed.
        """
        if self._expected:
            raise RuntimeError(f"kubernetes backend: run {self.run_id!r} started already; a run is one JobSet, "
                               "so start takes every group at once")
        objects = self.render(groups)
        created: dict[str, dict[str, Any]] = {}
        for obj in objects:
            created[obj["kind"]] = self._create(obj)
        self._expected = {g.name: pod_shape(g, self.platform).pods for g in groups}
        # what only the run uses goes with its JobSet (TTL, teardown, garbage collection)
        jobset = created["JobSet"]
        owned = [{"apiVersion": jobset["apiVersion"], "kind": "JobSet", "name": self.name, "uid": _get(jobset, "metadata", "uid")}]
        if owned[0]["uid"]:
            patch = {"metadata": {"ownerReferences": owned}}
            self.core.patch_namespaced_secret(name=secret_name(self.run_id), namespace=self.namespace, body=patch)
            if "PodGroup" in created:
                self.custom.patch_namespaced_custom_object(VOLCANO_GROUP, VOLCANO_VERSION, self.namespace, VOLCANO_PLURAL,
                                                           self.name, patch)
        logger.info("created JobSet %s/%s: %s", self.namespace, self.name,
                    ", ".join(_describe(g, self.platform) for g in groups))

    def _create(self, obj: dict[str, Any]) -> dict[str, Any]:
        ApiException = _api_exception()
        kind, name = obj["kind"], obj["metadata"]["name"]
        try:
            if kind == "Secret":
                self.core.create_namespaced_secret(namespace=self.namespace, body=obj)
                return obj
            group, version = obj["apiVersion"].split("/")
            plural = JOBSET_PLURAL if kind == "JobSet" else VOLCANO_PLURAL
            return self.custom.create_namespaced_custom_object(group, version, self.namespace, plural, obj)
        except ApiException as err:
            if err.status == 409:
                raise RuntimeError(f"{kind} {self.namespace}/{name} already exists: run {self.run_id!r} was started "
                                   "before; tear it down first (`teardown_run('kubernetes', run_id)`)") from None
            if err.status == 403:
                raise RuntimeError(f"not allowed to create {kind} in namespace {self.namespace!r}: apply manifests/base "
                                   "(its Role dockrl-launcher adds these rights to KFP's pipeline-runner account)") from None
            if err.status == 404 and kind != "Secret":
                needs = "the JobSet controller (jobset.x-k8s.io/v1alpha2, v0.9 or later)" if kind == "JobSet" else \
                    "Volcano (scheduling.volcano.sh/v1beta1), or platform scheduler='default'"
                raise RuntimeError(f"{kind} is not a resource of this cluster: install {needs} (docs/kubernetes.md)") from None
            raise

    # ---- watching ----

    def _log_tail(self, pod: str) -> str:
        ApiException = _api_exception()
        try:
            return self.core.read_namespaced_pod_log(name=pod, namespace=self.namespace, container=CONTAINER,
                                                     tail_lines=self.log_lines)
        except ApiException as err:
            return f"(no log: HTTP {err.status} {err.reason})"

    def _events(self, pod: str) -> list[Any]:
        return self.core.list_namespaced_event(namespace=self.namespace, field_selector=f"involvedObject.name={pod}").items

    def _jobset(self) -> dict[str, Any] | None:
        ApiException = _api_exception()
        try:
            return self.custom.get_namespaced_custom_object(JOBSET_GROUP, JOBSET_VERSION, self.namespace, JOBSET_PLURAL, self.name)
        except ApiException as err:
            if err.status == 404:
                return None
            raise

    def _podgroup_pending(self) -> bool:
        """Volcano has not admitted the run's PodGroup yet (its phase is ``Pending``)."""
        if self.platform.scheduler != "volcano":
            return False
        ApiException = _api_exception()
        try:
            group = self.custom.get_namespaced_custom_object(VOLCANO_GROUP, VOLCANO_VERSION, self.namespace, VOLCANO_PLURAL, self.name)
        except ApiException as err:
            if err.status == 404:
                return False
            raise
        return _get(group, "status", "phase") in (None, "Pending")

    def _first_seen(self, uid: str, phase: str, now: float) -> float:
        return self._since.setdefault((uid, phase), now)

    def _pod_failure(self, pod: Any, now: float, queued: bool) -> tuple[int, WorkerFailed] | None:
        """The most telling failure of one pod with its rank (lower wins), or None."""
        meta, status = pod.metadata, pod.status
        name, uid = meta.name, meta.uid
        group = (meta.labels or {}).get(GROUP_LABEL, "?")
        if status.phase == "Failed":
            why = f"pod failed: {status.reason or ''} {status.message or ''}".strip()
            for cs in status.container_statuses or []:
                term = _get(cs, "state", "terminated")
                if term is not None:
                    why += f"; container exited with code {term.exit_code} ({term.reason})"
            return 0, WorkerFailed(group, name, why, self._log_tail(name))
        conditions = {c.type: c for c in status.conditions or []}
        for cs in status.container_statuses or []:
            term, waiting = _get(cs, "state", "terminated"), _get(cs, "state", "waiting")
            if term is not None and term.exit_code != 0:
                return 0, WorkerFailed(group, name, f"exited with code {term.exit_code} ({term.reason})", self._log_tail(name))
            if cs.restart_count:
                return 0, WorkerFailed(group, name, f"restarted {cs.restart_count}x: a restarted worker has lost its state",
                                       self._log_tail(name))
            if waiting is not None and waiting.reason in FATAL_WAITING:
                return 1, WorkerFailed(group, name, f"{waiting.reason}: {waiting.message or ''}".strip(), "")
            if waiting is not None and waiting.reason in PULL_FAILED:
                failed = [e for e in self._events(name) if (e.message or "").startswith("Failed to pull image")]
                attempts = sum(e.count or 1 for e in failed)
                if attempts > self.platform.image_pull_retries:
                    last = failed[-1].message if failed else waiting.message
                    return 1, WorkerFailed(group, name, f"{waiting.reason}: image pull failed {attempts} times (more than "
                                           f"Platform.image_pull_retries={self.platform.image_pull_retries}): {last}", "")
                if (uid, "pull") not in self._warned:
                    self._warned.add((uid, "pull"))
                    logger.warning("worker pod %s: %s (%s); the kubelet retries", name, waiting.reason, waiting.message)
        if meta.deletion_timestamp is not None:
            disruption = conditions.get("DisruptionTarget")
            why = f"{disruption.reason}: {disruption.message}" if disruption is not None else "deleted"
            return 2, WorkerFailed(group, name, f"pod is being deleted ({why}); a worker that goes away ends the run",
                                   self._log_tail(name))
        if status.phase != "Pending":
            return None
        scheduled = conditions.get("PodScheduled")
        if scheduled is not None and scheduled.status == "False" and scheduled.reason == "Unschedulable":
            if queued:  # waiting for Volcano's admission, not for a node
                return None
            since = self._first_seen(uid, "unschedulable", now)
            no_fit = [e for e in self._events(name) if e.reason == NO_SCALE_UP]
            if no_fit:
                return 3, WorkerFailed(group, name, f"Unschedulable, and the cluster autoscaler adds no node for it: "
                                       f"{no_fit[-1].message}", "")
            if now - since > self.platform.schedule_timeout_s:
                return 3, WorkerFailed(group, name, f"Unschedulable for {now - since:.0f} s (more than Platform.schedule_timeout_s="
                                       f"{self.platform.schedule_timeout_s}): {scheduled.message}", "")
            if (uid, "unschedulable") not in self._warned:
                self._warned.add((uid, "unschedulable"))
                logger.warning("worker pod %s unschedulable: %s; failing in %d s unless a node frees up", name,
                               scheduled.message, self.platform.schedule_timeout_s)
        elif scheduled is not None and scheduled.status == "True":
            since = self._first_seen(uid, "starting", now)
            if now - since > self.platform.image_pull_timeout_s:
                waiting = [f"{_get(cs, 'state', 'waiting', 'reason')}" for cs in status.container_statuses or []]
                return 3, WorkerFailed(group, name, f"scheduled but not started after {now - since:.0f} s (more than "
                                       f"Platform.image_pull_timeout_s={self.platform.image_pull_timeout_s}): {waiting}", "")
        return None

    def check(self) -> None:
        """Raise ``WorkerFailed`` (pod, reason, log tail) when a worker failed or cannot start
        (see the module docstring); asks the API at most every ``poll_s``."""
        now = self.clock()
        if not self._expected or now - self._last_look < self.poll_s:
            return
        self._last_look = now
        self._look(now)

    def _look(self, now: float) -> list[Any]:
        """One look at the JobSet and its pods; raises on a failure, returns the pods."""
        jobset = self._jobset()
        if jobset is None:
            raise WorkerFailed("jobset", self.name, "the run's JobSet is gone (deleted by hand, or by its TTL)")
        suspended = bool(_get(jobset, "spec", "suspend"))
        queued = suspended or self._podgroup_pending()
        if queued:
            since = self._first_seen(self.name, "queued", now)
            if now - since > self.platform.queue_timeout_s:
                where = f"queue {self.platform.queue!r}" if self.platform.queue else "the scheduler's queue"
                raise WorkerFailed("jobset", self.name, f"not admitted by {self.platform.scheduler} ({where}) within "
                                   f"Platform.queue_timeout_s={self.platform.queue_timeout_s} s")
        else:
            self._since.pop((self.name, "queued"), None)  # admitted: scheduling clocks run from here
        pods = self.core.list_namespaced_pod(namespace=self.namespace, label_selector=self.selector).items
        failures = [f for f in (self._pod_failure(p, now, queued) for p in pods) if f is not None]
        failures += self._replaced(pods)
        first = min(failures, key=lambda f: f[0]) if failures else None
        if first is not None and first[0] <= 1:  # a worker that failed by itself says the most
            raise first[1]
        state = _get(jobset, "status", "terminalState")
        failed = [c for c in _get(jobset, "status", "conditions") or [] if c.get("type") == "Failed" and c.get("status") == "True"]
        if state == "Failed" or failed:  # before pods that vanished with it (its deadline, its failure policy)
            why = "; ".join(f"{c.get('reason')}: {c.get('message')}" for c in failed) or "terminal state Failed"
            raise WorkerFailed("jobset", self.name, f"JobSet failed ({why})")
        if first is not None:
            raise first[1]
        return pods

    def _replaced(self, pods: Sequence[Any]) -> list[tuple[int, WorkerFailed]]:
        """Pods of a member (group, index) other than the first seen, and members whose pod vanished."""
        out: list[tuple[int, WorkerFailed]] = []
        now_members: dict[tuple[str, str], tuple[str, str]] = {}
        for pod in pods:
            meta = pod.metadata
            key = ((meta.labels or {}).get(GROUP_LABEL, "?"), (meta.annotations or {}).get(COMPLETION_INDEX, "?"))
            first = self._members.setdefault(key, (meta.name, meta.uid))
            if first[1] != meta.uid:
                out.append((2, WorkerFailed(key[0], first[0], f"replaced by pod {meta.name} (the first was deleted or failed: "
                                            "a drain, a preemption?); a replaced worker has lost its state", "")))
            now_members[key] = (meta.name, meta.uid)
        for key, (name, _) in self._members.items():
            if key not in now_members:
                out.append((2, WorkerFailed(key[0], name, "pod vanished (deleted); a worker that goes away ends the run", "")))
        return out

    def _running_members(self, pods: Sequence[Any]) -> Counter:
        running: Counter = Counter()
        for pod in pods:
            started = all(_get(cs, "state", "running") is not None or _get(cs, "state", "terminated") is not None
                          for cs in pod.status.container_statuses or [None])
            if pod.status.phase in ("Running", "Succeeded") and started:
                running[(pod.metadata.labels or {}).get(GROUP_LABEL)] += 1
        return running

    def wait_ready(self, timeout_s: float) -> None:
        """Block until every member's container runs (queued, scheduled, pulled, started).

        Raises:
            WorkerFailed: a worker failed or cannot start (``check``'s reasons and timeouts).
            TimeoutError: not every member runs after ``timeout_s``; names the groups short of members.
        """
        deadline = self.clock() + timeout_s
        while True:
            now = self.clock()
            self._last_look = now
            running = self._running_members(self._look(now))
            short = {g: f"{running[g]}/{n}" for g, n in self._expected.items() if running[g] < n}
            if not short:
                return
            if now > deadline:
                raise TimeoutError(f"workers of run {self.run_id!r} (JobSet {self.namespace}/{self.name}) not running "
                                   f"after {timeout_s:.0f} s: running/expected per group {short}")
            time.sleep(self.poll_s)

    # ---- teardown ----

    def remains(self) -> list[str]:
        """What of this run exists in the cluster, as ``Kind/name``: its Secret, PodGroup, JobSet and
        worker pods (a retried launcher finds the failed attempt's, which it tears down and waits for
        before it creates its own under the same names)."""
        left = [f"Secret/{s.metadata.name}" for s in
                self.core.list_namespaced_secret(namespace=self.namespace, label_selector=self.selector).items]
        kinds = [("PodGroup", VOLCANO_GROUP, VOLCANO_VERSION, VOLCANO_PLURAL)] if self.platform.scheduler == "volcano" else []
        for kind, group, version, plural in [*kinds, ("JobSet", JOBSET_GROUP, JOBSET_VERSION, JOBSET_PLURAL)]:
            items = self.custom.list_namespaced_custom_object(group, version, self.namespace, plural, label_selector=self.selector)
            left += [f"{kind}/{obj['metadata']['name']}" for obj in items.get("items", [])]
        pods = self.core.list_namespaced_pod(namespace=self.namespace, label_selector=self.selector).items
        return left + [f"Pod/{p.metadata.name}" for p in pods]

    def teardown(self) -> int:
        """Delete the run's JobSet (its Jobs and pods go with it), PodGroup and Secret; returns
        how many objects were deleted. With ``teardown_wait_s`` waits that long for the pods to
        be gone (each has ``terminationGracePeriodSeconds`` 30). Safe to call twice."""
        ApiException = _api_exception()
        removed = 0
        for secret in self.core.list_namespaced_secret(namespace=self.namespace, label_selector=self.selector).items:
            try:
                self.core.delete_namespaced_secret(name=secret.metadata.name, namespace=self.namespace)
                removed += 1
            except ApiException as err:
                if err.status != 404:  # already gone is fine: teardown may run twice
                    raise
        kinds: list[tuple[str, str, str]] = []  # what the JobSet owns first, so each is counted once
        if self.platform.scheduler == "volcano":
            kinds.append((VOLCANO_GROUP, VOLCANO_VERSION, VOLCANO_PLURAL))
        kinds.append((JOBSET_GROUP, JOBSET_VERSION, JOBSET_PLURAL))
        for group, version, plural in kinds:
            for obj in self.custom.list_namespaced_custom_object(group, version, self.namespace, plural,
                                                                 label_selector=self.selector).get("items", []):
                try:
                    self.custom.delete_namespaced_custom_object(group, version, self.namespace, plural, obj["metadata"]["name"],
                                                                propagation_policy="Background")
                    removed += 1
                except ApiException as err:
                    if err.status != 404:
                        raise
        deadline = self.clock() + self.teardown_wait_s
        left = self.core.list_namespaced_pod(namespace=self.namespace, label_selector=self.selector).items
        while left and self.clock() < deadline:
            time.sleep(min(self.poll_s, 1.0))
            left = self.core.list_namespaced_pod(namespace=self.namespace, label_selector=self.selector).items
        if left and self.teardown_wait_s:
            logger.warning("kubernetes teardown of run %s: %d pod(s) still terminating after %.0f s: %s", self.run_id, len(left),
                           self.teardown_wait_s, [p.metadata.name for p in left])
        logger.info("kubernetes teardown of run %s in %s: %d object(s) deleted", self.run_id, self.namespace, removed)
        self._expected = {}
        return removed
