"""Kubernetes worker backend: a run's workers as one JobSet (or one Kubeflow Trainer TrainJob), watched until the run ends.

The launcher (the pipeline's train pod) renders the run's objects (``jobset.py``: a Secret,
the JobSet, a Volcano PodGroup if asked for) and creates them through the ``kubernetes``
client, all groups at once (``kubernetes_objects.py``: create, list, delete). Every object carries the run's labels (``dockrl.io/run``,
``dockrl.io/group``); the PodGroup is owned by the JobSet, the JobSet and the Secret by the
launcher pod. ``teardown`` (the driver's ``finally`` and the pipeline's exit handler) deletes
the JobSet and the PodGroup by label, the Secret goes with the launcher pod (the launcher may
create Secrets but not delete one); the Jobs' ``activeDeadlineSeconds``, the JobSet's TTL and the driver's lease on
the dock (``dockrl.process.lifeline``: when the launcher stops renewing it for ``run.driver_timeout_s``
the shards and the stages exit) bound what a lost launcher leaves behind.

With ``Platform.workload='trainjob'`` the launcher creates a TrainJob instead of the JobSet (``trainjob.py``): it
references the site's ClusterTrainingRuntime (``trainer_runtime_main``, ``dockrl trainer-runtime``, renders one for
a config's shape), the Trainer makes the JobSet of the same name from it, and everything below holds as it is;
teardown deletes the TrainJob (its JobSet goes with it).

How a run's stages find what they need, in pods that cannot see the launcher's files:

* program: the images' entry point ``dockrl`` (``images/*/Dockerfile``), so a pod's arguments
  are ``worker ...`` / ``dock-shard ...`` (``program`` is empty), or ``node ...`` for a pod that
  holds several rank processes (``pod_spec.pod_shape``);
* addresses: member ``i`` of group ``g`` is ``<jobset>-<g>-0-<i>.<jobset>.<namespace>.svc``
  through the JobSet's headless Service; a dock shard binds ``0.0.0.0`` on ``SHARD_PORT``; a sandbox
  executor (``env.sandbox.backend=pod``) is an agent-sandbox Sandbox of its own (``sandbox_pod.py``), at
  ``<jobset>-sandbox-<stage>.<namespace>.svc`` through the Sandbox's headless Service;
* the launcher: members reach servers of the launcher's process (the weight channel's
  ``TCPStore``) at the launcher pod's IP, ``POD_IP`` from the downward API (the pipeline's
  train task sets it): the store lives exactly as long as the launcher's process;
* files: every pod mounts the platform's shared volume at ``shared_mount_path``, the launcher
  too; the launcher puts the run's folder (data, checkpoints) under ``shared_dir``;
* secrets: the dock's bearer tokens are in the run's Secret, each pod reading its group's through ``secretKeyRef``.

``check`` (called every half second by the driver; it asks the API at most every ``poll_s``)
fails the run with ``WorkerFailed`` naming the pod, the reason and its log tail when a
worker pod failed or cannot start in time (``kubernetes_watch.py`` lists the reasons and their
timeouts), and when the JobSet itself failed (its deadline, its failure policy) or was deleted.
A JobSet Kueue suspends after admitting it was preempted: ``check`` raises ``WorkersSuspended``
instead, and ``preempted`` keeps it (``teardown`` looks once more before it deletes the JobSet, for
a run that noticed the preemption first as a shard that stopped answering), so the launcher resumes
the run instead of failing it (``dockrl.kubeflow.train_task``).
"""

from __future__ import annotations

import contextlib
import logging
import math
import os
import time
from pathlib import Path
from typing import Any, Callable, Sequence

from dockrl.launch.backend import WorkerFailed, WorkerGroup, WorkersSuspended, served_stage
from dockrl.launch.jobset import (
    RUN_LABEL,
    VOLCANO_GROUP,
    VOLCANO_PLURAL,
    VOLCANO_VERSION,
    check_run_id,
    jobset_name,
    member_host,
    render_jobset,
)
from dockrl.launch.kubernetes_objects import create_object, delete_run_objects, list_run_objects, run_objects
from dockrl.launch.kubernetes_watch import RunWatch, get_field, running_members
from dockrl.launch.launcher_pod import OwnerPod, launcher_namespace
from dockrl.launch.platform import Platform, get_platform
from dockrl.launch.pod_spec import pod_shape
from dockrl.launch.sandbox_pod import SANDBOX_GROUP, SANDBOX_PLURAL, SANDBOX_VERSION, render_sandboxes, sandbox_host
from dockrl.launch.trainjob import render_trainjob

logger = logging.getLogger(__name__)

ENTRY_POINT: tuple[str, ...] = ()
"""What a member's command starts with: nothing, since the images' ENTRYPOINT is ``dockrl`` (on
the NPU image a script that sources CANN's environment first), and a pod gives only its arguments."""
SHARD_PORT = 8815
"""Port of a dock shard in its pod (Arrow Flight's customary port; each shard has its own pod IP)."""

def _describe(group: WorkerGroup, platform: Platform) -> str:
    shape = pod_shape(group, platform)
    if not group.devices:
        return f"{group.name}×{shape.pods}"
    return f"{group.name}×{shape.pods} ({shape.members} rank process(es), {group.devices * shape.members} device(s) per pod)"


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
    sidecars = True  # dock.placement=beside: a shard container in every stage pod

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
        self._attempts = 0  # JobSets this backend started: a resumed run's Secret is a new one
        self._watch = self._new_watch()
        self._last_look = -math.inf
        self.preempted: WorkersSuspended | None = None
        """The preemption of this run's workers (Kueue suspended their JobSet), once seen; None while there was none."""

    def _new_watch(self) -> RunWatch:
        return RunWatch(self.core, self.custom, namespace=self.namespace, name=self.name, selector=self.selector,
                        platform=self.platform, log_lines=self.log_lines)

    def _look(self, now: float) -> list[Any]:
        try:
            return self._watch.look(now)
        except WorkersSuspended as paused:
            self.preempted = paused
            raise

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
        if served_stage(group):  # a sandbox executor: its Sandbox's Service (sandbox_pod.py)
            return f"{sandbox_host(self.run_id, group, self.namespace)}:{port}"
        return f"{member_host(self.run_id, group, replica, self.namespace)}:{port}"

    def nodes(self, group: WorkerGroup) -> int:
        return pod_shape(group, self.platform).pods

    @classmethod
    def from_cluster(cls, run_id: str, *, namespace: str = "", platform: str | Platform = "cpu", **kwargs) -> KubernetesBackend:
        """A backend with the pod's in-cluster credentials (or ``~/.kube/config`` outside a cluster).

        The namespace defaults to this pod's own: ``POD_NAMESPACE`` or the service account's
        namespace; the owner is the pod named by ``POD_NAME`` / ``POD_UID``, the launcher's IP
        ``POD_IP`` (the pipeline's train task sets all four).

        Raises:
            ValueError: no credentials (neither in-cluster nor a kubeconfig); no namespace given or
                found; or, in an owner pod, a ``namespace`` other
                than the pod's own (the workers of a run live in its launcher's namespace).
        """
        from kubernetes import client, config  # lazy: the kubernetes client is the kfp extra

        try:
            config.load_incluster_config()
        except config.ConfigException as in_cluster:
            try:
                config.load_kube_config()
            except (config.ConfigException, OSError) as outside:
                raise ValueError(f"no Kubernetes credentials: not in a pod with a service account ({in_cluster}) and no usable "
                                 f"kubeconfig ({outside}); set KUBECONFIG or write ~/.kube/config (kubectl config view "
                                 "shows which one kubectl uses)") from outside
        namespace, owner = launcher_namespace(namespace)
        platform = get_platform(platform) if isinstance(platform, str) else platform
        kwargs.setdefault("launcher_ip", os.environ.get("POD_IP", ""))
        return cls(run_id, namespace=namespace, platform=platform, core_api=client.CoreV1Api(),
                   custom_api=client.CustomObjectsApi(), owner=owner, **kwargs)

    def render(self, groups: Sequence[WorkerGroup]) -> list[dict[str, Any]]:
        """The run's objects in creation order: the workload's (``jobset.render_jobset``, or ``trainjob.render_trainjob``
        with ``platform.workload='trainjob'``), and before the JobSet or TrainJob, whose stages call them, the sandbox
        executors' NetworkPolicies and Sandboxes (``sandbox_pod.render_sandboxes``)."""
        owner = self.owner.reference() if self.owner else None
        render = render_trainjob if self.platform.workload == "trainjob" else render_jobset
        executors = [g for g in groups if served_stage(g.name)]
        objects = render([g for g in groups if not served_stage(g.name)], run_id=self.run_id, namespace=self.namespace,
                         platform=self.platform, owner=owner, attempt=self._attempts)
        if not executors:
            return objects
        [secret] = [obj for obj in objects if obj["kind"] == "Secret"]
        sandboxes = render_sandboxes(executors, run_id=self.run_id, namespace=self.namespace, platform=self.platform, secret=secret,
                                     owner=owner)
        return objects[:-1] + sandboxes + objects[-1:]

    # ---- start ----

    def start(self, groups: Sequence[WorkerGroup]) -> None:
        """Create the run's Secret, NetworkPolicies, sandbox executors' Sandboxes (``env.sandbox.backend=pod``), PodGroup
        (Volcano) and JobSet, or its TrainJob: every group at once.

        Raises:
            RuntimeError: the run's objects exist already (started before), the launcher may
                not create them (RBAC), the JobSet, PodGroup or TrainJob API is not installed, or the
                Trainer refused the TrainJob (its ClusterTrainingRuntime missing).
        """
        if self._expected:
            raise RuntimeError(f"kubernetes backend: run {self.run_id!r} started already; a run is one JobSet, "
                               "so start takes every group at once")
        objects = self.render(groups)
        self._attempts += 1  # a JobSet after a preemption gets a Secret of its own
        self._watch, self._last_look, self.preempted = self._new_watch(), -math.inf, None  # a resumed run's JobSet: seen afresh
        created: dict[str, dict[str, Any]] = {}
        for obj in objects:
            created[obj["kind"]] = create_object(self.core, self.custom, obj, namespace=self.namespace, run_id=self.run_id)
        self._expected = {g.name: pod_shape(g, self.platform).pods for g in groups}
        if "TrainJob" in created:  # the Trainer makes the JobSet, and a PodGroup of the runtime's podGroupPolicy
            logger.info("created TrainJob %s/%s of ClusterTrainingRuntime %s: %s", self.namespace, self.name,
                        self.platform.training_runtime, ", ".join(_describe(g, self.platform) for g in groups))
            return
        # what only the run uses goes with its JobSet (TTL, teardown, garbage collection)
        jobset = created["JobSet"]
        owned = [{"apiVersion": jobset["apiVersion"], "kind": "JobSet", "name": self.name, "uid": get_field(jobset, "metadata", "uid")}]
        if owned[0]["uid"] and "PodGroup" in created:
            self.custom.patch_namespaced_custom_object(VOLCANO_GROUP, VOLCANO_VERSION, self.namespace, VOLCANO_PLURAL,
                                                       self.name, {"metadata": {"ownerReferences": owned}})
        if self.owner is None:
            logger.warning("the run's Secret %s/%s has no owner pod and stays after the run (the launcher may not delete "
                           "Secrets): delete it with kubectl", self.namespace, created["Secret"]["metadata"]["name"])
        logger.info("created JobSet %s/%s: %s", self.namespace, self.name,
                    ", ".join(_describe(g, self.platform) for g in groups))

    # ---- watching ----

    def check(self) -> None:
        """Raise ``WorkerFailed`` (pod, reason, log tail) when a worker failed or cannot start
        (see the module docstring); asks the API at most every ``poll_s``."""
        now = self.clock()
        if not self._expected or now - self._last_look < self.poll_s:
            return
        self._last_look = now
        self._look(now)

    def wait_ready(self, timeout_s: float) -> None:
        """Block until every member's container runs (queued, scheduled, pulled, started), and every Sandbox of the
        run is ``Ready`` (its pod ready, its Service made).

        Raises:
            WorkerFailed: a worker failed or cannot start (``check``'s reasons and timeouts).
            TimeoutError: not every member runs after ``timeout_s``; names the groups short of members and the
                Sandboxes not Ready, with their ``Ready`` condition's reason.
        """
        deadline = self.clock() + timeout_s
        while True:
            now = self.clock()
            self._last_look = now
            running = running_members(self._look(now))
            short = {g: f"{running[g]}/{n}" for g, n in self._expected.items() if running[g] < n}
            not_ready = self._sandboxes_not_ready()
            if not short and not not_ready:
                return
            if now > deadline:
                raise TimeoutError(f"workers of run {self.run_id!r} (JobSet {self.namespace}/{self.name}) not running "
                                   f"after {timeout_s:.0f} s: running/expected per group {short}"
                                   + (f"; Sandboxes not Ready: {not_ready}" if not_ready else ""))
            time.sleep(self.poll_s)

    def _sandboxes_not_ready(self) -> dict[str, str]:
        """``Sandbox/<name>`` → its ``Ready`` condition's reason and message, for each of the run's Sandboxes not Ready."""
        if not any(served_stage(g) for g in self._expected):
            return {}
        short: dict[str, str] = {}
        for box in list_run_objects(self.custom, SANDBOX_GROUP, SANDBOX_VERSION, self.namespace, SANDBOX_PLURAL, self.selector):
            ready = [c for c in get_field(box, "status", "conditions") or [] if c.get("type") == "Ready"]
            if not ready or ready[0].get("status") != "True":
                said = f"{ready[0].get('reason')}: {ready[0].get('message')}" if ready else "no Ready condition yet"
                short[f"Sandbox/{box['metadata']['name']}"] = said
        return short

    # ---- teardown ----

    def remains(self) -> list[str]:
        """What of this run exists in the cluster, as ``Kind/name``: its PodGroup, JobSet and
        worker pods (a retried launcher finds the failed attempt's, which it tears down and waits for
        before it creates its own under the same names)."""
        return run_objects(self.core, self.custom, namespace=self.namespace, selector=self.selector,
                           scheduler=self.platform.scheduler, workload=self.platform.workload)

    def teardown(self) -> int:
        """Delete the run's JobSet (its Jobs and pods go with it) and PodGroup; returns
        how many objects were deleted. With ``teardown_wait_s`` waits that long for the pods to
        be gone (each has ``terminationGracePeriodSeconds`` 30). Safe to call twice. A preemption
        not seen yet is looked for first (``preempted``)."""
        if self._expected and self.preempted is None:
            with contextlib.suppress(WorkerFailed):  # a Workload deactivated by hand: a stop, nothing to resume
                self.preempted = self._watch.preemption()
        removed = delete_run_objects(self.custom, namespace=self.namespace, selector=self.selector,
                                     scheduler=self.platform.scheduler, workload=self.platform.workload)
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


def trainer_runtime_main(argv: list[str] | None = None) -> int:
    """``dockrl trainer-runtime``: print the ClusterTrainingRuntime (YAML) of the runs of a config's shape on a platform,
    for a site administrator to review and apply (``trainjob.render_training_runtime``)."""
    import argparse

    import yaml

    from dockrl.config import load_config
    from dockrl.launch.distributed import dock_shards, worker_groups  # lazy: the driver's side of a run, only to know its groups
    from dockrl.launch.platform_files import platform_from_file
    from dockrl.launch.trainjob import render_training_runtime

    parser = argparse.ArgumentParser(prog="dockrl trainer-runtime", description=trainer_runtime_main.__doc__)
    parser.add_argument("--platform", default="npu", help="preset: npu, gpu or cpu (default npu)")
    parser.add_argument("--platform-config", help="YAML file of the site's platform fields (as `dockrl pipeline compile`)")
    parser.add_argument("--name", default="dockrl-hybrid", help="the runtime's name (Platform.training_runtime)")
    parser.add_argument("--config", help="the runs' config file; the groups and pods follow its layout and stages")
    parser.add_argument("overrides", nargs="*", help="section.field=value, e.g. parallel.tp=2 parallel.dp=4")
    args = parser.parse_args(argv)
    cfg = load_config(args.config, args.overrides)
    platform = get_platform(args.platform)
    if args.platform_config:
        platform = platform_from_file(platform, args.platform_config)
    # the shape alone matters: what addresses, tokens and the run's name give is patched in by each TrainJob
    backend = KubernetesBackend("runtime", namespace="default", platform=platform, core_api=None, custom_api=None)
    groups = worker_groups(cfg, backend, backend.serve_ports(dock_shards(cfg, backend)), "launcher:29500", "token", "runtime")
    print(yaml.safe_dump(render_training_runtime(groups, name=args.name, platform=platform), sort_keys=False), end="")
    return 0
