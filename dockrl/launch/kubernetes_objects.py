"""A Kubernetes run's objects in the API: create one, list what is left, delete them.

The objects are those ``jobset.render_jobset`` renders (a Secret, a NetworkPolicy, a Volcano
PodGroup if asked for, the JobSet) or ``trainjob.render_trainjob`` (a Secret, a NetworkPolicy, a
TrainJob) and, with ``env.sandbox.backend=pod``, ``sandbox_pod.render_sandboxes`` (a NetworkPolicy and an
agent-sandbox Sandbox per executor), found again by the run's label selector (``dockrl.io/run=<run_id>``).
A cluster without agent-sandbox has no Sandbox resource: listing them there finds none.
``KubernetesBackend`` (``kubernetes.py``) calls these with its ``CoreV1Api`` and
``CustomObjectsApi`` (or the tests' fakes):

* ``create_object``: create one, with the API's refusals explained (exists, RBAC, no such resource);
* ``run_objects``: what of a run exists, as ``Kind/name`` (a retried launcher's check);
* ``delete_run_objects``: delete a run's NetworkPolicies, Sandboxes, PodGroup, TrainJob and JobSet (their pods go with them).

The NetworkPolicy (``networking.k8s.io/v1``) goes through the ``CustomObjectsApi`` as the
JobSet does: its generic calls serve any resource of a named API group.

The run's Secret is neither listed nor deleted: the launcher may create Secrets, never read or
delete one; it goes with the launcher pod that owns it (``jobset.py``).
"""

from __future__ import annotations

from typing import Any

from dockrl.launch.jobset import (
    JOBSET_GROUP,
    JOBSET_PLURAL,
    JOBSET_VERSION,
    POLICY_GROUP,
    POLICY_PLURAL,
    POLICY_VERSION,
    VOLCANO_GROUP,
    VOLCANO_PLURAL,
    VOLCANO_VERSION,
)
from dockrl.launch.kubernetes_watch import api_exception
from dockrl.launch.sandbox_pod import SANDBOX_GROUP, SANDBOX_PLURAL, SANDBOX_VERSION
from dockrl.launch.trainjob import TRAINER_GROUP, TRAINER_VERSION, TRAINJOB_PLURAL

PLURALS = {"JobSet": JOBSET_PLURAL, "NetworkPolicy": POLICY_PLURAL, "PodGroup": VOLCANO_PLURAL, "Sandbox": SANDBOX_PLURAL,
           "TrainJob": TRAINJOB_PLURAL}
"""The resource (plural) of each kind the backend creates through the ``CustomObjectsApi``."""


def create_object(core: Any, custom: Any, obj: dict[str, Any], *, namespace: str, run_id: str) -> dict[str, Any]:
    """Create ``obj`` (a Secret, NetworkPolicy, PodGroup or JobSet of run ``run_id``) in ``namespace``; returns it as created.

    Raises:
        RuntimeError: it exists already (the run was started before), the launcher may not
            create it (RBAC), or its API (JobSet, Volcano) is not installed.
    """
    ApiException = api_exception()
    kind, name = obj["kind"], obj["metadata"]["name"]
    try:
        if kind == "Secret":
            core.create_namespaced_secret(namespace=namespace, body=obj)
            return obj
        group, version = obj["apiVersion"].split("/")
        return custom.create_namespaced_custom_object(group, version, namespace, PLURALS[kind], obj)
    except ApiException as err:
        if err.status == 409:
            raise RuntimeError(f"{kind} {namespace}/{name} already exists: run {run_id!r} was started "
                               "before; tear it down first (`teardown_run('kubernetes', run_id)`)") from None
        if err.status == 403:
            raise RuntimeError(f"not allowed to create {kind} in namespace {namespace!r}: apply manifests/base "
                               "(its Role dockrl-launcher adds these rights to KFP's pipeline-runner account)") from None
        needs = {"JobSet": "the JobSet controller (jobset.x-k8s.io/v1alpha2, v0.9 or later)",
                 "PodGroup": "Volcano (scheduling.volcano.sh/v1beta1), or platform scheduler='default'",
                 "Sandbox": "kubernetes-sigs/agent-sandbox (agents.x-k8s.io/v1beta1), or env.sandbox.backend=local",
                 "TrainJob": "Kubeflow Trainer v2 (trainer.kubeflow.org/v1alpha1), or platform workload='jobset'"}
        if err.status == 404 and kind in needs:
            raise RuntimeError(f"{kind} is not a resource of this cluster: install {needs[kind]} (docs/kubernetes.md)") from None
        if err.status in (400, 422) and kind == "TrainJob":  # the Trainer's webhook: its runtime first of all
            runtime = obj["spec"]["runtimeRef"]["name"]
            raise RuntimeError(f"TrainJob {namespace}/{name} refused ({err.reason}: {str(err.body)[:500]}): does the "
                               f"ClusterTrainingRuntime {runtime!r} exist (kubectl get clustertrainingruntime {runtime}; "
                               "`dockrl trainer-runtime` renders one, docs/kubeflow.md)?") from None
        raise


def _kinds(scheduler: str, workload: str) -> list[tuple[str, str, str, str]]:
    """(kind, group, version, plural) of a run's objects the ``CustomObjectsApi`` serves, each owner after what it owns
    (so each is counted once): the NetworkPolicies, the Sandboxes, the PodGroup (``volcano``, a JobSet run: a
    TrainJob's is the Trainer's), the TrainJob (a ``trainjob`` run), the JobSet."""
    kinds = [("NetworkPolicy", POLICY_GROUP, POLICY_VERSION, POLICY_PLURAL), ("Sandbox", SANDBOX_GROUP, SANDBOX_VERSION, SANDBOX_PLURAL)]
    if scheduler == "volcano" and workload == "jobset":
        kinds.append(("PodGroup", VOLCANO_GROUP, VOLCANO_VERSION, VOLCANO_PLURAL))
    if workload == "trainjob":
        kinds.append(("TrainJob", TRAINER_GROUP, TRAINER_VERSION, TRAINJOB_PLURAL))
    return [*kinds, ("JobSet", JOBSET_GROUP, JOBSET_VERSION, JOBSET_PLURAL)]


def list_run_objects(custom: Any, group: str, version: str, namespace: str, plural: str, selector: str) -> list[dict[str, Any]]:
    """The run's objects of one resource; none where the cluster has no such resource (agent-sandbox not installed)."""
    try:
        return custom.list_namespaced_custom_object(group, version, namespace, plural, label_selector=selector).get("items", [])
    except api_exception() as err:
        if err.status == 404 and plural == SANDBOX_PLURAL:
            return []
        raise


def run_objects(core: Any, custom: Any, *, namespace: str, selector: str, scheduler: str, workload: str = "jobset") -> list[str]:
    """What of the run labelled ``selector`` exists in ``namespace``, as ``Kind/name``: its NetworkPolicies, Sandboxes,
    PodGroup (with the ``volcano`` scheduler), TrainJob (``workload='trainjob'``), JobSet and pods."""
    left: list[str] = []
    for kind, group, version, plural in _kinds(scheduler, workload):
        left += [f"{kind}/{obj['metadata']['name']}" for obj in list_run_objects(custom, group, version, namespace, plural, selector)]
    pods = core.list_namespaced_pod(namespace=namespace, label_selector=selector).items
    return left + [f"Pod/{p.metadata.name}" for p in pods]


def delete_run_objects(custom: Any, *, namespace: str, selector: str, scheduler: str, workload: str = "jobset") -> int:
    """Delete the NetworkPolicies, Sandboxes, PodGroup (with the ``volcano`` scheduler), TrainJob (``workload='trainjob'``)
    and JobSet of the run labelled ``selector`` (in the background: their Jobs and pods go with them, on their own
    time); returns how many objects were deleted. What is already gone is skipped: safe to call twice."""
    ApiException = api_exception()
    removed = 0
    for _, group, version, plural in _kinds(scheduler, workload):  # what went with an owner deleted before is not listed
        for obj in list_run_objects(custom, group, version, namespace, plural, selector):
            try:
                custom.delete_namespaced_custom_object(group, version, namespace, plural, obj["metadata"]["name"],
                                                       propagation_policy="Background")
                removed += 1
            except ApiException as err:
                if err.status != 404:
                    raise
    return removed
