"""A run's workers as one Kubeflow Trainer TrainJob over a ClusterTrainingRuntime (trainer.kubeflow.org/v1alpha1):
rendering only, no API calls.

Kubeflow Trainer v2 runs a TrainJob as a JobSet that it makes from a training runtime, which the site's
administrators own (placement, RDMA, the Ascend environment, gang scheduling) and Kueue admits through the TrainJob.
A dockrl run is not one torchrun node group: CPU dock shards and the reward run beside the hybrid actor's node job
(and, not hybrid, one-device stages). So the runtime holds a run's whole shape, and the TrainJob only the run:

* ``render_training_runtime``: the ClusterTrainingRuntime of a run's worker groups: the JobSet ``jobset.render_jobset``
  renders for them (the same pods, ``pod_spec.py``), less what belongs to one run: each container's environment and
  arguments (a container runs ``dockrl from-env DOCKRL_ARGS``, the JSON list of its arguments), the run's label, the
  Volcano group annotation (the Trainer makes the PodGroup: ``podGroupPolicy.volcano``) and the headless Service's
  subdomain (the JobSet's name, which is the TrainJob's). The group of the torchrun-style node pods (the actor, or the
  hybrid actor) is the runtime's trainer step (``ANCESTOR_LABEL``), with ``mlPolicy.numNodes`` its pods. A runtime
  fits the runs of one shape (groups, pods, devices): ``dockrl trainer-runtime`` renders it from a config;
* ``render_trainjob``: the Secret and the NetworkPolicy of ``render_jobset``, then the TrainJob, named as the JobSet
  would be (``jobset.jobset_name``: the Trainer names its JobSet after the TrainJob, so the members' addresses and
  the watch are the JobSet mode's), referencing ``Platform.training_runtime``; one ``runtimePatches`` entry (manager
  ``PATCH_MANAGER``) puts the run in: its labels on the JobSet, Jobs and pods, and each container's environment
  with ``DOCKRL_ARGS``. Kueue's labels go on the TrainJob, which Kueue then queues whole.

Pod names are the JobSet controller's, as in the JobSet mode: ``<trainjob>-<group>-0-<index>-<random>``.
"""

from __future__ import annotations

import copy
import json
import os
from typing import Any, Mapping, Sequence

from dockrl.launch.backend import WorkerGroup
from dockrl.launch.jobset import (
    JOBSET_NAME_LABEL,
    KUEUE_PRIORITY_LABEL,
    KUEUE_QUEUE_LABEL,
    RUN_LABEL,
    VOLCANO_GROUP_ANNOTATION,
    jobset_name,
    render_jobset,
    run_labels,
)
from dockrl.launch.platform import Platform
from dockrl.launch.pod_spec import pod_shape

TRAINER_GROUP, TRAINER_VERSION = "trainer.kubeflow.org", "v1alpha1"
TRAINJOB_PLURAL, RUNTIME_PLURAL = "trainjobs", "clustertrainingruntimes"
ANCESTOR_LABEL = "trainer.kubeflow.org/trainjob-ancestor-step"
"""The label of a runtime's replicated job that the Trainer treats as the trainer step (value ``trainer``)."""
PATCH_MANAGER = "dockrl.io/launcher"
"""Who owns the TrainJob's ``runtimePatches`` entry."""
ARGS_ENV = "DOCKRL_ARGS"
"""The JSON list of a member's arguments, which ``dockrl from-env`` runs."""
NODE_GROUPS = ("hybrid", "actor")
"""The groups of torchrun-style node pods, in the order the trainer step is chosen from."""
_PLACEHOLDER_RUN = "runtime"  # render_jobset needs a run; what of it lands in the pods is taken out again


def refuse_sidecars(groups: Sequence[WorkerGroup]) -> None:
    """Raises ``ValueError`` when ``groups`` carry dock shards as sidecars (``dock.placement=beside``): a TrainJob's
    runtime patches reach the containers of its pods, not their init containers."""
    if any(g.sidecar is not None for g in groups):
        raise ValueError("dock.placement=beside: the stage pods' dock shard sidecars are rendered for Platform.workload='jobset' "
                         "only; a TrainJob's runtime patches reach its containers, not its init containers")


def trainer_group(groups: Sequence[WorkerGroup]) -> WorkerGroup:
    """The runtime's trainer step: the hybrid actor's group, else the actor's.

    Raises:
        ValueError: the run has neither (no group the Trainer can call its trainer), or its groups carry dock shards
            as sidecars (``dock.placement=beside``), whose arguments and environment the runtime's patches do not reach.
    """
    refuse_sidecars(groups)
    by_name = {g.name: g for g in groups}
    for name in NODE_GROUPS:
        if name in by_name:
            return by_name[name]
    raise ValueError(f"worker groups {sorted(by_name)}: none of {NODE_GROUPS} for the TrainJob's trainer step")


def _without_run(labels: dict[str, str]) -> dict[str, str]:
    """``labels`` less those of one run: its id, and Kueue's (the TrainJob carries those)."""
    return {k: v for k, v in labels.items() if k not in (RUN_LABEL, JOBSET_NAME_LABEL, KUEUE_QUEUE_LABEL, KUEUE_PRIORITY_LABEL)}


def render_training_runtime(groups: Sequence[WorkerGroup], *, name: str, platform: Platform) -> dict[str, Any]:
    """The ClusterTrainingRuntime ``name`` for runs of ``groups``' shape on ``platform`` (see the module docstring).

    Raises:
        ValueError: as ``render_jobset``, or no trainer step (``trainer_group``).
    """
    trainer = trainer_group(groups)
    [jobset] = [o for o in render_jobset(groups, run_id=_PLACEHOLDER_RUN, namespace="default", platform=platform)
                if o["kind"] == "JobSet"]
    spec = copy.deepcopy(jobset["spec"])
    del spec["network"]["subdomain"]  # the JobSet's name by default: the TrainJob's, which names the members' hosts
    for rjob in spec["replicatedJobs"]:
        job = rjob["template"]
        job["metadata"]["labels"] = _without_run(job["metadata"]["labels"])
        if rjob["name"] == trainer.name:
            job["metadata"]["labels"][ANCESTOR_LABEL] = "trainer"
        pod = job["spec"]["template"]
        pod["metadata"]["labels"] = _without_run(pod["metadata"]["labels"])
        pod["metadata"]["annotations"].pop(VOLCANO_GROUP_ANNOTATION, None)
        for container in pod["spec"]["containers"]:
            container["args"] = ["from-env", ARGS_ENV]
            container.pop("env", None)
    runtime_spec: dict[str, Any] = {
        "mlPolicy": {"numNodes": pod_shape(trainer, platform).pods},
        "template": {"metadata": {"labels": _without_run(jobset["metadata"]["labels"])}, "spec": spec},
    }
    if platform.scheduler == "volcano":
        runtime_spec["podGroupPolicy"] = {"volcano": {}}
    return {"apiVersion": f"{TRAINER_GROUP}/{TRAINER_VERSION}", "kind": "ClusterTrainingRuntime",
            "metadata": {"name": name, "labels": {"app.kubernetes.io/part-of": "dockrl"}}, "spec": runtime_spec}


def render_trainjob(groups: Sequence[WorkerGroup], *, run_id: str, namespace: str, platform: Platform,
                    owner: dict[str, Any] | None = None, attempt: int = 0) -> list[dict[str, Any]]:
    """The API objects of a run's workers as a TrainJob, in creation order: the Secret, the NetworkPolicy, the TrainJob.

    Args: as ``render_jobset``'s.

    Raises:
        ValueError: as ``render_jobset``, or dock shard sidecars (``refuse_sidecars``).
    """
    refuse_sidecars(groups)
    objects = render_jobset(groups, run_id=run_id, namespace=namespace, platform=platform, owner=owner, attempt=attempt)
    [jobset] = [o for o in objects if o["kind"] == "JobSet"]
    patched = []
    for rjob in jobset["spec"]["replicatedJobs"]:
        pod = rjob["template"]["spec"]["template"]
        containers = [{"name": c["name"], "env": [*c["env"], {"name": ARGS_ENV, "value": json.dumps(c["args"])}]}
                      for c in pod["spec"]["containers"]]
        patched.append({"name": rjob["name"], "template": {
            "metadata": {"labels": rjob["template"]["metadata"]["labels"]},
            "spec": {"template": {"metadata": {"labels": pod["metadata"]["labels"]}, "spec": {"containers": containers}}},
        }})
    labels = run_labels(run_id)
    meta: dict[str, Any] = {"name": jobset_name(run_id), "namespace": namespace, "labels": dict(labels)}
    if platform.scheduler == "kueue":  # Kueue queues the TrainJob whole; the JobSet the Trainer makes is the TrainJob's
        meta["labels"][KUEUE_QUEUE_LABEL] = platform.queue
        if platform.priority_class:
            meta["labels"][KUEUE_PRIORITY_LABEL] = platform.priority_class
    if owner is not None:
        meta["ownerReferences"] = [owner]
    trainjob = {
        "apiVersion": f"{TRAINER_GROUP}/{TRAINER_VERSION}", "kind": "TrainJob", "metadata": meta,
        "spec": {
            "runtimeRef": {"apiGroup": TRAINER_GROUP, "kind": "ClusterTrainingRuntime", "name": platform.training_runtime},
            "runtimePatches": [{"manager": PATCH_MANAGER, "trainingRuntimeSpec": {"template": {
                "metadata": {"labels": labels}, "spec": {"replicatedJobs": patched}}}}],
        },
    }
    return [o for o in objects if o["kind"] in ("Secret", "NetworkPolicy")] + [trainjob]


def args_from_env(argv: Sequence[str], environ: Mapping[str, str] | None = None) -> list[str]:
    """``dockrl from-env NAME``: the arguments that the JSON list in ``$NAME`` holds (a TrainJob member's, ``ARGS_ENV``).

    Raises:
        ValueError: not one name given, the variable unset, or not a JSON list of strings.
    """
    env = os.environ if environ is None else environ
    if len(argv) != 1:
        raise ValueError(f"dockrl from-env: got {list(argv)}; expected the name of one variable, e.g. {ARGS_ENV}")
    text = env.get(argv[0])
    if text is None:
        raise ValueError(f"dockrl from-env: ${argv[0]} is not set; the TrainJob's runtimePatches set it on every member")
    try:
        args = json.loads(text)
    except ValueError:
        args = None
    if not isinstance(args, list) or not all(isinstance(a, str) for a in args):
        raise ValueError(f"dockrl from-env: ${argv[0]}={text[:200]!r}; expected a JSON list of strings, the member's arguments")
    return args
