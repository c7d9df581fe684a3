"""A run's workers as one JobSet (jobset.x-k8s.io/v1alpha2): rendering only, no API calls.

``render_jobset`` turns the worker groups of a run into the API objects the Kubernetes worker
backend (``kubernetes.py``) creates, as dicts:

* one **Secret** ``<jobset>-secrets-<launcher pod's uid>`` with the values of the groups'
  ``secret_env`` (the dock's bearer tokens, one key per stage, and certificates); a container reads
  the keys of its group's ``secret_env`` only, through ``secretKeyRef``, never as a plain value. It
  is owned by the launcher pod from its creation and goes with it (garbage collection): the launcher
  may create Secrets, never read, change or delete one (``manifests/base/rbac.yaml``), so a retried
  launcher (a pod of its own) creates a Secret of its own;
* one **NetworkPolicy** named as the JobSet: the run's worker pods (the JobSet name label
  ``jobset.sigs.k8s.io/jobset-name``, which the JobSet controller puts on the pods it creates)
  take connections only from each other and from the pods of the run's pipeline (KFP's label
  ``pipeline/runid``, the launcher among them); created before the JobSet, so no worker pod is
  ever open to the namespace;
* one **JobSet** ``dockrl-<8 hex of the run id's hash>`` holding a replicated job per group
  (dock shards, rollout, reward, reference, actor or hybrid), each one Indexed Job of
  ``replicas`` pods, all created at once (no stage holds its accelerators while another is
  still being scheduled). Its parts, after Kubeflow Trainer v2 (which runs on JobSet):

  - pod DNS from the JobSet's headless Service (``network.subdomain`` = the JobSet's name):
    member ``i`` of group ``g`` is ``<jobset>-<g>-0-<i>.<jobset>.<namespace>.svc``;
  - failure policy: no restarts; any Job that fails (a pod failed, was evicted, deleted or
    replaced: ``backoffLimit: 0``) fails the JobSet, and the launcher fails the run;
  - ``activeDeadlineSeconds`` on every Job (``Platform.worker_deadline_s``) and
    ``ttlSecondsAfterFinished`` on the JobSet (``Platform.worker_ttl_s``): nothing outlives a
    lost launcher by more than the deadline;
  - optional gang scheduling (``Platform.scheduler``): Kueue queues the whole JobSet
    (labels ``kueue.x-k8s.io/queue-name`` and, with ``Platform.priority_class``,
    ``kueue.x-k8s.io/priority-class``); Kueue makes each replicated job one PodSet of the
    JobSet's Workload, and older Kueue releases admit at most ``KUEUE_MAX_PODSETS`` (8) of them,
    so a run renders at most that many replicated jobs (the dock shards are one: N indexed
    pods); Volcano schedules every pod (``schedulerName: volcano``) as one **PodGroup**
    (annotation ``scheduling.k8s.io/group-name``), rendered here too, with ``minMember`` =
    every pod of the run and the platform's ``pod_labels`` (a rank-table controller reads
    them on the job as well);

* every pod: as ``pod_spec.py`` renders it (requests, devices, Pod Security ``restricted``, no
  service-account token, no Istio sidecar), its members placed by ``pod_spec.pod_shape``.

Pod names are the JobSet controller's: ``<jobset>-<group>-0-<index>-<random>``; a pod's group is
its ``dockrl.io/group`` label, its index the Job's completion index.
"""

from __future__ import annotations

import hashlib
import re
from typing import Any, Sequence

from dockrl.launch.backend import WorkerGroup
from dockrl.launch.platform import Platform
from dockrl.launch.pod_spec import pod_shape, pod_spec

JOBSET_GROUP, JOBSET_VERSION, JOBSET_PLURAL = "jobset.x-k8s.io", "v1alpha2", "jobsets"
VOLCANO_GROUP, VOLCANO_VERSION, VOLCANO_PLURAL = "scheduling.volcano.sh", "v1beta1", "podgroups"
POLICY_GROUP, POLICY_VERSION, POLICY_PLURAL = "networking.k8s.io", "v1", "networkpolicies"
JOBSET_NAME_LABEL = "jobset.sigs.k8s.io/jobset-name"
"""Set by the JobSet controller on every pod of a JobSet: the run's NetworkPolicy selects by it."""
KFP_RUN_LABEL = "pipeline/runid"
"""Set by KFP's API server on every pod of a pipeline run (the launcher's): its value is the run id."""
RUN_LABEL = "dockrl.io/run"
GROUP_LABEL = "dockrl.io/group"
KUEUE_QUEUE_LABEL = "kueue.x-k8s.io/queue-name"
KUEUE_PRIORITY_LABEL = "kueue.x-k8s.io/priority-class"
KUEUE_MAX_PODSETS = 8
"""Most PodSets a Kueue Workload may hold in Kueue releases before mid-2026 (``spec.podSets``
``maxItems: 8`` of the Workload CRD; 18 since): a JobSet's replicated jobs are its Workload's
PodSets, and a Workload over the limit is refused by the API server, so the JobSet is never admitted.
dockrl holds to 8, so a run is admitted by older Kueue too."""
VOLCANO_GROUP_ANNOTATION = "scheduling.k8s.io/group-name"
ISTIO_INJECT = "sidecar.istio.io/inject"
FAILURE_RULE = "FailRunOnAnyWorkerFailure"
_LABEL_VALUE = re.compile(r"^[A-Za-z0-9]([-A-Za-z0-9_.]{0,61}[A-Za-z0-9])?$")


def check_run_id(run_id: str) -> None:
    """Raises ``ValueError`` unless ``run_id`` is a Kubernetes label value (it labels every object)."""
    if not _LABEL_VALUE.match(run_id):
        raise ValueError(f"run_id {run_id!r}: must be a Kubernetes label value (≤ 63 alphanumerics, '-', '_', '.')")


def jobset_name(run_id: str) -> str:
    """``dockrl-<8 hex of the run id's hash>`` (15 characters): with a group name of ≤ 32 and
    the indexes, pod host names stay within the 63 characters of a DNS label."""
    return f"dockrl-{hashlib.sha1(run_id.encode()).hexdigest()[:8]}"


def secret_name(run_id: str, owner_uid: str = "", attempt: int = 0) -> str:
    """The Secret of run ``run_id`` (the values of the groups' ``secret_env``) created by the
    launcher pod of uid ``owner_uid`` ('': a launcher outside a pod) for its ``attempt``-th JobSet
    (after a preemption the same launcher starts the run again, with new tokens, and may not
    change or delete its first Secret)."""
    return f"{jobset_name(run_id)}-secrets" + (f"-{owner_uid[:8]}" if owner_uid else "") + (f"-{attempt}" if attempt else "")


def member_host(run_id: str, group: str, replica: int, namespace: str) -> str:
    """DNS name of member ``replica`` of ``group``: ``<jobset>-<group>-<job 0>-<pod index>.<subdomain>.<ns>.svc``."""
    name = jobset_name(run_id)
    return f"{name}-{group}-0-{replica}.{name}.{namespace}.svc"


def run_labels(run_id: str, group: str | None = None) -> dict[str, str]:
    labels = {
        "app.kubernetes.io/name": "dockrl-worker", "app.kubernetes.io/part-of": "dockrl",
        "app.kubernetes.io/managed-by": "dockrl-launcher", RUN_LABEL: run_id,
    }
    if group is not None:
        labels |= {"app.kubernetes.io/component": group, GROUP_LABEL: group}
    return labels


def _secret_keys(groups: Sequence[WorkerGroup]) -> dict[str, str]:
    """Environment variable → value of every group's ``secret_env``; one value per name."""
    values: dict[str, str] = {}
    for g in [*groups, *(g.sidecar for g in groups if g.sidecar is not None)]:
        for key, value in g.secret_env.items():
            if values.setdefault(key, value) != value:
                raise ValueError(f"worker groups: secret_env {key!r} differs between groups; a run has one value per name")
    return values




def render_jobset(groups: Sequence[WorkerGroup], *, run_id: str, namespace: str, platform: Platform,
                  owner: dict[str, Any] | None = None, attempt: int = 0) -> list[dict[str, Any]]:
    """The API objects of a run's workers, in creation order: the Secret, the NetworkPolicy, the
    PodGroup (with ``scheduler=volcano``), the JobSet.

    Args:
        groups: the run's worker groups (distinct names).
        owner: owner reference of every object (the launcher pod), or None.
        attempt: how many JobSets of the run this launcher started before (``secret_name``).

    Raises:
        ValueError: ``run_id`` not a label value, no group, duplicate group names, more groups
            than ``KUEUE_MAX_PODSETS``, or one ``secret_env`` name with two values.
    """
    check_run_id(run_id)
    names = [g.name for g in groups]
    if not names:
        raise ValueError("worker groups: none given; a run has at least its dock shards and stages")
    if len(set(names)) != len(names):
        raise ValueError(f"worker groups: duplicate names in {names}")
    if len(names) > KUEUE_MAX_PODSETS:
        raise ValueError(f"worker groups: {len(names)} ({names}) would be {len(names)} replicated jobs, more than the "
                         f"{KUEUE_MAX_PODSETS} PodSets a Kueue Workload holds (KUEUE_MAX_PODSETS): Kueue would never admit the run")
    name = jobset_name(run_id)
    meta: dict[str, Any] = {"namespace": namespace, "labels": run_labels(run_id)}
    if owner is not None:
        meta["ownerReferences"] = [owner]
    secret = secret_name(run_id, owner["uid"] if owner else "", attempt)
    objects: list[dict[str, Any]] = [{
        "apiVersion": "v1", "kind": "Secret", "type": "Opaque",
        "metadata": {"name": secret, **meta}, "stringData": _secret_keys(groups),
    }, {
        "apiVersion": f"{POLICY_GROUP}/{POLICY_VERSION}", "kind": "NetworkPolicy", "metadata": {"name": name, **meta},
        "spec": {  # a podSelector without namespaceSelector: pods of this namespace only
            "podSelector": {"matchLabels": {JOBSET_NAME_LABEL: name}}, "policyTypes": ["Ingress"],
            "ingress": [{"from": [{"podSelector": {"matchLabels": {JOBSET_NAME_LABEL: name}}},
                                  {"podSelector": {"matchLabels": {KFP_RUN_LABEL: run_id}}}]}],
        },
    }]
    pod_annotations = {ISTIO_INJECT: "false"}
    if platform.scheduler == "volcano":
        pod_annotations[VOLCANO_GROUP_ANNOTATION] = name
        podgroup: dict[str, Any] = {"minMember": sum(pod_shape(g, platform).pods for g in groups)}  # all or nothing
        if platform.queue:
            podgroup["queue"] = platform.queue
        # the job carries the pods' labels too: MindCluster's rank-table controller reads ring-controller.atlas there
        group_meta = {"name": name, **meta, "labels": {**platform.pod_labels, **meta["labels"]}}
        objects.append({"apiVersion": f"{VOLCANO_GROUP}/{VOLCANO_VERSION}", "kind": "PodGroup",
                        "metadata": group_meta, "spec": podgroup})
    replicated = []
    for g in groups:
        labels = run_labels(run_id, g.name)
        pods = pod_shape(g, platform).pods
        pod_labels, annotations = {**labels, ISTIO_INJECT: "false"}, dict(pod_annotations)
        if g.devices:  # the platform's hook: a device plugin's or a secondary network's labels and annotations
            pod_labels, annotations = {**platform.pod_labels, **pod_labels}, {**platform.pod_annotations, **annotations}
        replicated.append({"name": g.name, "replicas": 1, "template": {
            "metadata": {"labels": labels},
            "spec": {
                "completionMode": "Indexed", "completions": pods, "parallelism": pods,
                "backoffLimit": 0,  # a pod that fails fails its Job, and so the JobSet
                "activeDeadlineSeconds": platform.worker_deadline_s,
                "template": {"metadata": {"labels": pod_labels, "annotations": annotations},
                             "spec": pod_spec(run_id, g, platform, secret=secret,
                                              master_addr=member_host(run_id, g.name, 0, namespace))},
            },
        }})
    jobset_meta = {"name": name, **meta, "labels": dict(meta["labels"])}
    if platform.scheduler == "kueue":
        jobset_meta["labels"][KUEUE_QUEUE_LABEL] = platform.queue
        if platform.priority_class:
            jobset_meta["labels"][KUEUE_PRIORITY_LABEL] = platform.priority_class
    objects.append({
        "apiVersion": f"{JOBSET_GROUP}/{JOBSET_VERSION}", "kind": "JobSet", "metadata": jobset_meta,
        "spec": {
            "network": {"enableDNSHostnames": True, "publishNotReadyAddresses": True, "subdomain": name},
            "failurePolicy": {"maxRestarts": 0, "rules": [{"name": FAILURE_RULE, "action": "FailJobSet"}]},
            "ttlSecondsAfterFinished": platform.worker_ttl_s,
            "replicatedJobs": replicated,
        },
    })
    return objects
