"""What the Kubernetes backend reads in a run's JobSet and worker pods: which one failed or cannot start, and why.

``KubernetesBackend.check`` (``kubernetes.py``) fails the run with ``WorkerFailed`` naming the
pod, the reason and its log tail when a worker pod

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

and when the JobSet itself failed (its deadline, its failure policy) or was deleted. A JobSet
suspended after it was admitted was preempted (Kueue suspends it; the JobSet controller deletes
its Jobs, so its pods go away): ``WorkersSuspended``, before anything its vanishing pods say,
naming the Workload's ``Evicted`` condition (a Workload deactivated by hand, ``InactiveWorkload``,
fails the run instead).

While the run waits for admission, ``RunWatch`` logs every ``WAIT_LOG_S`` what it waits for: the
JobSet's suspension and its Kueue Workload's ``QuotaReserved`` and ``Admitted`` conditions (the
Workload is found by Kueue's ``kueue.x-k8s.io/job-uid`` label), or the Volcano PodGroup's phase
and conditions. It fails within ``Platform.admission_timeout_s`` (minutes), not
``queue_timeout_s``, where Kueue will not admit the run by waiting: the JobSet is suspended and
no Workload appears for it (Kueue down, its JobSet integration off), or its Workload is
``Inadmissible`` (its LocalQueue missing or stopped; a JobSet without a queue name where Kueue
manages the namespace) or asks for more than any flavor of the queue can ever hold. ``RunWatch`` looks; the backend decides when (``check``:
at most every ``poll_s``; ``wait_ready``: until every member runs).

A ``trainjob`` run (``Platform.workload``): Kueue queues, suspends and evicts the TrainJob, so admission and
preemption are read there (its Workload found by the TrainJob's uid); the Trainer makes the JobSet once the TrainJob
runs, and a run whose JobSet has not appeared within ``Platform.admission_timeout_s`` of an unsuspended TrainJob
fails, naming the TrainJob's conditions (no Trainer running, its runtime missing); a TrainJob that failed or is gone
fails the run as a JobSet does.
"""

from __future__ import annotations

import logging
import math
from collections import Counter
from typing import Any, Sequence

from dockrl.launch.backend import WorkerFailed, WorkersSuspended
from dockrl.launch.jobset import GROUP_LABEL, JOBSET_GROUP, JOBSET_PLURAL, JOBSET_VERSION, VOLCANO_GROUP, VOLCANO_PLURAL, VOLCANO_VERSION
from dockrl.launch.platform import Platform
from dockrl.launch.pod_spec import COMPLETION_INDEX, CONTAINER
from dockrl.launch.trainjob import TRAINER_GROUP, TRAINER_VERSION, TRAINJOB_PLURAL

logger = logging.getLogger(__name__)

PULL_FAILED = ("ErrImagePull", "ImagePullBackOff")
"""Waiting reasons of a failed image pull: the kubelet retries, so they count against a budget."""
FATAL_WAITING = {"InvalidImageName", "CrashLoopBackOff", "CreateContainerConfigError", "CreateContainerError", "RunContainerError"}
"""Waiting reasons that will not resolve by waiting."""
NO_SCALE_UP = "NotTriggerScaleUp"
"""Cluster autoscaler event: no node group can ever fit the pod."""
WAIT_LOG_S = 60.0
"""How often a run waiting for admission says what it waits for, seconds."""
KUEUE_GROUP, KUEUE_VERSION, KUEUE_PLURAL = "kueue.x-k8s.io", "v1beta1", "workloads"
"""Kueue's Workload API (v1beta1: served by old and new Kueue releases alike)."""
KUEUE_JOB_UID_LABEL = "kueue.x-k8s.io/job-uid"
"""Label of a Workload with the uid of the job it stands for (here the JobSet)."""
DEACTIVATED = "InactiveWorkload"
"""Reason of a Workload's ``Evicted`` condition when someone set its ``spec.active`` false: a stop, not a preemption."""
KUEUE_CONDITIONS = ("QuotaReserved", "Admitted", "Evicted")
"""The Workload conditions that say where its admission stands."""
INADMISSIBLE = "Inadmissible"
"""Reason of a Workload's ``QuotaReserved`` condition when its LocalQueue is missing or stopped, or
its ClusterQueue missing or inactive: waiting does not admit it."""
OVER_CAPACITY, MORE_NEEDED = "> maximum capacity", "more needed"
"""Parts of a ``QuotaReserved`` message of Kueue: a request no flavor of the queue can ever hold
(``request > maximum capacity (32 > 16)``, with several PodSets ``... + current podset request (8) >
maximum capacity (16)``), and a flavor that lacks unused quota only (``8 more needed``): quota that
preemptions or finished workloads can free."""


def get_field(obj: Any, *path: str) -> Any:
    """``obj.a.b`` of a client model (or ``obj["a"]["b"]`` of a dict), None where a part is unset."""
    for key in path:
        if obj is None:
            return None
        obj = obj.get(key) if isinstance(obj, dict) else getattr(obj, key, None)
    return obj


def api_exception() -> Any:
    """The kubernetes client's ``ApiException`` (the client is imported on first use)."""
    from kubernetes.client.exceptions import ApiException  # lazy: the kubernetes client is the kfp extra

    return ApiException


class RunWatch:
    """The Kubernetes backend's look at a run's JobSet and pods: the first failure, if any, and what
    it remembers between two looks (the first pod of each member, when each pod entered a phase,
    what it warned about already).

    Args:
        core_api, custom_api: ``kubernetes.client.CoreV1Api`` / ``CustomObjectsApi`` (or fakes).
        namespace: the run's namespace.
        name: its JobSet's (and PodGroup's) name.
        selector: the label selector of its objects.
        platform: its scheduler, image pull retries and timeouts.
        log_lines: lines of a failed worker's log in its error.
    """

    def __init__(self, core_api: Any, custom_api: Any, *, namespace: str, name: str, selector: str, platform: Platform,
                 log_lines: int):
        self.core, self.custom, self.namespace, self.name, self.selector = core_api, custom_api, namespace, name, selector
        self.platform, self.log_lines = platform, log_lines
        self.members: dict[tuple[str, str], tuple[str, str]] = {}  # (group, index) -> (pod name, uid) first seen
        self.since: dict[tuple[str, str], float] = {}  # (pod uid, phase) -> first seen in that phase
        self.warned: set[tuple[str, str]] = set()
        self.said_waiting = -math.inf  # when the wait for admission was last logged
        self.admitted = False  # seen admitted (not queued) once: a suspension from now on is a preemption

    def log_tail(self, pod: str) -> str:
        ApiException = api_exception()
        try:
            return self.core.read_namespaced_pod_log(name=pod, namespace=self.namespace, container=CONTAINER,
                                                     tail_lines=self.log_lines)
        except ApiException as err:
            return f"(no log: HTTP {err.status} {err.reason})"

    def events(self, pod: str) -> list[Any]:
        return self.core.list_namespaced_event(namespace=self.namespace, field_selector=f"involvedObject.name={pod}").items

    def first_seen(self, uid: str, phase: str, now: float) -> float:
        return self.since.setdefault((uid, phase), now)

    def jobset(self) -> dict[str, Any] | None:
        ApiException = api_exception()
        try:
            return self.custom.get_namespaced_custom_object(JOBSET_GROUP, JOBSET_VERSION, self.namespace, JOBSET_PLURAL, self.name)
        except ApiException as err:
            if err.status == 404:
                return None
            raise

    def trainjob(self) -> dict[str, Any] | None:
        ApiException = api_exception()
        try:
            return self.custom.get_namespaced_custom_object(TRAINER_GROUP, TRAINER_VERSION, self.namespace, TRAINJOB_PLURAL, self.name)
        except ApiException as err:
            if err.status == 404:
                return None
            raise

    @property
    def kind(self) -> str:
        """What Kueue queues and the run is made of: ``TrainJob`` (``Platform.workload='trainjob'``) or ``JobSet``."""
        return "TrainJob" if self.platform.workload == "trainjob" else "JobSet"

    def queued(self) -> dict[str, Any] | None:
        """The object Kueue queues, suspends and evicts: the run's TrainJob or JobSet; None once it is gone."""
        return self.trainjob() if self.kind == "TrainJob" else self.jobset()

    def podgroup(self) -> dict[str, Any] | None:
        """The run's Volcano PodGroup while Volcano has not admitted it (its phase ``Pending``), else None."""
        if self.platform.scheduler != "volcano":
            return None
        ApiException = api_exception()
        try:
            group = self.custom.get_namespaced_custom_object(VOLCANO_GROUP, VOLCANO_VERSION, self.namespace, VOLCANO_PLURAL, self.name)
        except ApiException as err:
            if err.status == 404:
                return None
            raise
        return group if get_field(group, "status", "phase") in (None, "Pending") else None

    def workload(self, jobset: dict[str, Any]) -> tuple[dict[str, Any] | None, str]:
        """The Kueue Workload of ``jobset`` (the run's ``queued`` object; None if there is none) and, when it cannot be read, why."""
        ApiException = api_exception()
        selector = f"{KUEUE_JOB_UID_LABEL}={get_field(jobset, 'metadata', 'uid')}"
        try:
            items = self.custom.list_namespaced_custom_object(KUEUE_GROUP, KUEUE_VERSION, self.namespace, KUEUE_PLURAL,
                                                              label_selector=selector).get("items", [])
        except ApiException as err:
            if err.status == 404:
                return None, "Kueue's Workload API is not installed"
            if err.status == 403:
                return None, ("not allowed to read Kueue Workloads (apply manifests/base: its Role dockrl-launcher "
                              "reads workloads.kueue.x-k8s.io)")
            raise
        return (items[0] if items else None), ""

    def admission(self, jobset: dict[str, Any], now: float, since: float) -> str:
        """What the suspended ``jobset`` waits for, as one line; raises ``WorkerFailed`` where waiting
        will not admit it within ``Platform.admission_timeout_s`` (see the module docstring)."""
        timeout = self.platform.admission_timeout_s
        waited = now - since
        workload, unread = self.workload(jobset)
        queue = (f"the LocalQueue {self.platform.queue!r} exists in namespace {self.namespace!r} (kubectl get "
                 "localqueue) and Kueue runs" if self.platform.scheduler == "kueue" else
                 f"the JobSet names no LocalQueue (platform scheduler={self.platform.scheduler!r}), but Kueue manages this "
                 "namespace: set Platform.scheduler='kueue' and Platform.queue")
        if workload is None:
            if waited > timeout:
                raise WorkerFailed("jobset", self.name, f"suspended for {waited:.0f} s and no Kueue Workload for it (more than "
                                   f"Platform.admission_timeout_s={timeout}): Kueue never set its QuotaReserved condition, "
                                   f"nor will by waiting; check that {queue}" + (f" ({unread})" if unread else ""))
            return (f"JobSet suspended; no Kueue Workload for it yet{f' ({unread})' if unread else ''}; failing after "
                    f"Platform.admission_timeout_s={timeout} s without one")
        conditions = {c.get("type"): c for c in get_field(workload, "status", "conditions") or []}
        said = [f"{t}={c.get('status')} ({c.get('reason')}: {c.get('message')})" for t in KUEUE_CONDITIONS
                if (c := conditions.get(t)) is not None]
        state = f"JobSet suspended; Kueue Workload {get_field(workload, 'metadata', 'name')}: " + (
            ", ".join(said) or "no QuotaReserved condition yet")
        quota = conditions.get("QuotaReserved") or {}
        message = str(quota.get("message") or "")
        never = quota.get("status") == "False" and (
            quota.get("reason") == INADMISSIBLE or (OVER_CAPACITY in message and MORE_NEEDED not in message))
        if never and waited > timeout:
            raise WorkerFailed("jobset", self.name, f"not admitted by Kueue for {waited:.0f} s, and waiting will not admit it "
                               f"(more than Platform.admission_timeout_s={timeout}): {state}; check that {queue}, and that "
                               "it can hold every pod of the run")
        return state + (f"; waiting will not admit it: failing after Platform.admission_timeout_s={timeout} s" if never else "")

    def preemption(self, jobset: dict[str, Any] | None = None) -> WorkersSuspended | None:
        """The preemption of the run, if its JobSet (``jobset``, or read now) is suspended after it
        was admitted, else None.

        Raises:
            WorkerFailed: the Workload was deactivated by hand (``InactiveWorkload``): a stop, not a pause.
        """
        jobset = jobset if jobset is not None else self.queued() if self.admitted else None
        if jobset is None or not self.admitted or not get_field(jobset, "spec", "suspend"):
            return None
        workload, unread = self.workload(jobset)
        evicted = next((c for c in get_field(workload, "status", "conditions") or [] if c.get("type") == "Evicted"), None)
        why = f"Evicted ({evicted.get('reason')}: {evicted.get('message')})" if evicted else unread or "no Evicted condition on its Workload"
        if evicted is not None and evicted.get("reason") == DEACTIVATED:
            raise WorkerFailed("jobset", self.name, f"suspended: its Kueue Workload was deactivated (spec.active=false): {why}")
        return WorkersSuspended("jobset", self.name, f"suspended by Kueue after it was admitted (preempted: {why}); its pods go away")

    def say_waiting(self, what: str, now: float, since: float) -> None:
        if now - self.said_waiting >= WAIT_LOG_S:
            self.said_waiting = now
            logger.info("run's JobSet %s/%s waiting for admission for %.0f s (fails after Platform.queue_timeout_s=%d s): %s",
                        self.namespace, self.name, now - since, self.platform.queue_timeout_s, what)

    def pod_failure(self, pod: Any, now: float, queued: bool) -> tuple[int, WorkerFailed] | None:
        """The most telling failure of one pod with its rank (lower wins), or None."""
        meta, status = pod.metadata, pod.status
        name, uid = meta.name, meta.uid
        group = (meta.labels or {}).get(GROUP_LABEL, "?")
        if status.phase == "Failed":
            why = f"pod failed: {status.reason or ''} {status.message or ''}".strip()
            for cs in status.container_statuses or []:
                term = get_field(cs, "state", "terminated")
                if term is not None:
                    why += f"; container exited with code {term.exit_code} ({term.reason})"
            return 0, WorkerFailed(group, name, why, self.log_tail(name))
        conditions = {c.type: c for c in status.conditions or []}
        for cs in status.container_statuses or []:
            term, waiting = get_field(cs, "state", "terminated"), get_field(cs, "state", "waiting")
            if term is not None and term.exit_code != 0:
                return 0, WorkerFailed(group, name, f"exited with code {term.exit_code} ({term.reason})", self.log_tail(name))
            if cs.restart_count:
                return 0, WorkerFailed(group, name, f"restarted {cs.restart_count}x: a restarted worker has lost its state",
                                       self.log_tail(name))
            if waiting is not None and waiting.reason in FATAL_WAITING:
                return 1, WorkerFailed(group, name, f"{waiting.reason}: {waiting.message or ''}".strip(), "")
            if waiting is not None and waiting.reason in PULL_FAILED:
                failed = [e for e in self.events(name) if (e.message or "").startswith("Failed to pull image")]
                attempts = sum(e.count or 1 for e in failed)
                if attempts > self.platform.image_pull_retries:
                    last = failed[-1].message if failed else waiting.message
                    return 1, WorkerFailed(group, name, f"{waiting.reason}: image pull failed {attempts} times (more than "
                                           f"Platform.image_pull_retries={self.platform.image_pull_retries}): {last}", "")
                if (uid, "pull") not in self.warned:
                    self.warned.add((uid, "pull"))
                    logger.warning("worker pod %s: %s (%s); the kubelet retries", name, waiting.reason, waiting.message)
        if meta.deletion_timestamp is not None:
            disruption = conditions.get("DisruptionTarget")
            why = f"{disruption.reason}: {disruption.message}" if disruption is not None else "deleted"
            return 2, WorkerFailed(group, name, f"pod is being deleted ({why}); a worker that goes away ends the run",
                                   self.log_tail(name))
        if status.phase != "Pending":
            return None
        scheduled = conditions.get("PodScheduled")
        if scheduled is not None and scheduled.status == "False" and scheduled.reason == "Unschedulable":
            if queued:  # waiting for Volcano's admission, not for a node
                return None
            since = self.first_seen(uid, "unschedulable", now)
            no_fit = [e for e in self.events(name) if e.reason == NO_SCALE_UP]
            if no_fit:
                return 3, WorkerFailed(group, name, f"Unschedulable, and the cluster autoscaler adds no node for it: "
                                       f"{no_fit[-1].message}", "")
            if now - since > self.platform.schedule_timeout_s:
                return 3, WorkerFailed(group, name, f"Unschedulable for {now - since:.0f} s (more than Platform.schedule_timeout_s="
                                       f"{self.platform.schedule_timeout_s}): {scheduled.message}", "")
            if (uid, "unschedulable") not in self.warned:
                self.warned.add((uid, "unschedulable"))
                logger.warning("worker pod %s unschedulable: %s; failing in %d s unless a node frees up", name,
                               scheduled.message, self.platform.schedule_timeout_s)
        elif scheduled is not None and scheduled.status == "True":
            since = self.first_seen(uid, "starting", now)
            if now - since > self.platform.image_pull_timeout_s:
                waiting = [f"{get_field(cs, 'state', 'waiting', 'reason')}" for cs in status.container_statuses or []]
                return 3, WorkerFailed(group, name, f"scheduled but not started after {now - since:.0f} s (more than "
                                       f"Platform.image_pull_timeout_s={self.platform.image_pull_timeout_s}): {waiting}", "")
        return None

    def look(self, now: float) -> list[Any]:
        """One look at the JobSet and its pods; raises on a failure, returns the pods."""
        jobset = self.jobset()
        queued_obj = self.queued() if self.kind == "TrainJob" else jobset
        if queued_obj is None:
            raise WorkerFailed("jobset", self.name, f"the run's {self.kind} is gone (deleted by hand, or by its TTL)")
        paused = self.preemption(queued_obj)
        if paused is not None:  # before what its pods say: they go away because of it
            raise paused
        suspended = bool(get_field(queued_obj, "spec", "suspend"))
        if jobset is None and not suspended:  # a TrainJob the Trainer has not made its JobSet of yet
            self.trainjob_failure(queued_obj)
            waited = now - self.first_seen(self.name, "made", now)
            if waited > self.platform.admission_timeout_s:
                raise WorkerFailed("jobset", self.name, f"TrainJob {self.namespace}/{self.name}: no JobSet made of it after "
                                   f"{waited:.0f} s (Platform.admission_timeout_s={self.platform.admission_timeout_s}): check that "
                                   f"Kubeflow Trainer runs and its ClusterTrainingRuntime {self.platform.training_runtime!r} exists; "
                                   f"the TrainJob's conditions: {self.conditions(queued_obj) or 'none'}")
            return []
        podgroup = None if suspended or self.kind == "TrainJob" else self.podgroup()
        queued = suspended or podgroup is not None
        if queued:
            since = self.first_seen(self.name, "queued", now)
            if suspended:
                what = self.admission(queued_obj, now, since)
            else:
                said = [f"{c.get('type')} ({c.get('reason')}: {c.get('message')})" for c in get_field(podgroup, "status", "conditions") or []]
                what = f"Volcano PodGroup {self.name} Pending" + (f": {'; '.join(said)}" if said else "")
            if now - since > self.platform.queue_timeout_s:
                where = f"queue {self.platform.queue!r}" if self.platform.queue else "the scheduler's queue"
                raise WorkerFailed("jobset", self.name, f"not admitted by {self.platform.scheduler} ({where}) within "
                                   f"Platform.queue_timeout_s={self.platform.queue_timeout_s} s: {what}")
            self.say_waiting(what, now, since)
        else:
            self.since.pop((self.name, "queued"), None)  # admitted: scheduling clocks run from here
            self.admitted = True
        pods = self.core.list_namespaced_pod(namespace=self.namespace, label_selector=self.selector).items
        failures = [f for f in (self.pod_failure(p, now, queued) for p in pods) if f is not None]
        failures += self.replaced(pods)
        first = min(failures, key=lambda f: f[0]) if failures else None
        if first is not None and first[0] <= 1:  # a worker that failed by itself says the most
            raise first[1]
        state = get_field(jobset, "status", "terminalState")
        failed = [c for c in get_field(jobset, "status", "conditions") or [] if c.get("type") == "Failed" and c.get("status") == "True"]
        if state == "Failed" or failed:  # before pods that vanished with it (its deadline, its failure policy)
            why = "; ".join(f"{c.get('reason')}: {c.get('message')}" for c in failed) or "terminal state Failed"
            raise WorkerFailed("jobset", self.name, f"JobSet failed ({why})")
        if self.kind == "TrainJob":
            self.trainjob_failure(queued_obj)
        if first is not None:
            raise first[1]
        return pods

    @staticmethod
    def conditions(obj: dict[str, Any]) -> str:
        return "; ".join(f"{c.get('type')}={c.get('status')} ({c.get('reason')}: {c.get('message')})"
                         for c in get_field(obj, "status", "conditions") or [])

    def trainjob_failure(self, trainjob: dict[str, Any]) -> None:
        """Raise ``WorkerFailed`` when ``trainjob`` has the condition ``Failed`` (the Trainer refused it, its JobSet failed)."""
        if any(c.get("type") == "Failed" and c.get("status") == "True" for c in get_field(trainjob, "status", "conditions") or []):
            raise WorkerFailed("jobset", self.name, f"TrainJob failed ({self.conditions(trainjob)})")

    def replaced(self, pods: Sequence[Any]) -> list[tuple[int, WorkerFailed]]:
        """Pods of a member (group, index) other than the first seen, and members whose pod vanished."""
        out: list[tuple[int, WorkerFailed]] = []
        now_members: dict[tuple[str, str], tuple[str, str]] = {}
        for pod in pods:
            meta = pod.metadata
            key = ((meta.labels or {}).get(GROUP_LABEL, "?"), (meta.annotations or {}).get(COMPLETION_INDEX, "?"))
            first = self.members.setdefault(key, (meta.name, meta.uid))
            if first[1] != meta.uid:
                out.append((2, WorkerFailed(key[0], first[0], f"replaced by pod {meta.name} (the first was deleted or failed: "
                                            "a drain, a preemption?); a replaced worker has lost its state", "")))
            now_members[key] = (meta.name, meta.uid)
        for key, (name, _) in self.members.items():
            if key not in now_members:
                out.append((2, WorkerFailed(key[0], name, "pod vanished (deleted); a worker that goes away ends the run", "")))
        return out


def running_members(pods: Sequence[Any]) -> Counter:
    """Running (or finished) members of each group among ``pods``: every container started."""
    running: Counter = Counter()
    for pod in pods:
        started = all(get_field(cs, "state", "running") is not None or get_field(cs, "state", "terminated") is not None
                      for cs in pod.status.container_statuses or [None])
        if pod.status.phase in ("Running", "Succeeded") and started:
            running[(pod.metadata.labels or {}).get(GROUP_LABEL)] += 1
    return running
