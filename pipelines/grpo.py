"""The GRPO pipeline: resolve_config → prepare_dataset → train → export_model → evaluate; workers torn down on exit.

    dockrl pipeline compile grpo.yaml --platform npu     # IR for the Kubeflow UI / kfp.Client
    dockrl pipeline compile grpo.yaml --platform npu --worker-backend kubernetes \\
        --registry registry.example.com/ml --tag 0.1.0 --pull-secret regcred     # stages as pods
    dockrl pipeline run --local trainer.iterations=2     # the whole pipeline on this machine

Compile-time (settings of the package, ``PipelineSettings``): the worker backend, the platform
(image registry, tag or digests, pull secret, accelerators, node selector, tolerations,
architectures), the tasks' CPU and memory requests and how long the cluster keeps a finished
run's workflow (``ttl_after_finished_s``, a ``dsl.PipelineConfig``). Run-time (the pipeline's parameters,
what a user changes per run in the UI): ``dockrl.kubeflow.steps.RUN_PARAMETERS`` (iterations,
batch sizes, group size, learning rate, KL coefficient, response length, algorithm, model and
data paths) with the config's defaults, ``config_overrides`` (a text of ``section.field=value`` lines,
for any other config field; they win over a parameter), ``export_dtype``, ``copy_model`` and ``export_uri``;
each has a description in the compiled package (the pipeline function's docstring), which the UI shows
beside it. A pipeline run keeps the newest ``keep_checkpoints`` = 2 checkpoints and the final one (the config keeps all). The
model artifacts (train's and export-model's) name the model's folder on the shared volume, with its
metadata; ``export_uri`` (``s3://<bucket>/<key>``) puts the exported model in the object store instead and
its artifact names that URI; the weights go through KFP's artifact store only with ``copy_model``.

The steps run inside a ``dsl.ExitHandler`` whose exit task tears down the run's worker groups
whatever happened. Every task is limited to the node architectures its image is built for
(``Platform.architectures_of``, a ``kubernetes.io/arch`` node affinity). With the ``local``
backend the train task (the launcher) runs the whole job in its pod: it carries the platform's
image, node selector and tolerations, and requests the accelerators its processes use and the
CPU and memory of a pod holding them, which resolve-config computes from the run's config
(``dockrl.kubeflow.steps.local_run_resources``; KFP's driver reads them from that task's outputs).
With ``kubernetes`` it only drives: the stages run in pods of their own in the run's namespace
(``dockrl/launch/kubernetes.py``), the train task runs on the CPU image without accelerators and
mounts the shared volume (the run folder: data, checkpoints, TensorBoard events). With either
backend every task that reads the run's config or a model (resolve-config, prepare-dataset, train,
export-model, evaluate) mounts the shared volume, where the user's model and data may be, and reads
the object-store Secret as optional: only a run with the S3 warehouse or ``s3://`` inputs needs it
(``tests/pipelines/test_task_inputs.py`` holds every compiled task to this). On a platform
with accelerators evaluate runs on the platform's image with one accelerator and the config's
rollout engine; with ``kubernetes`` evaluate drives too: its work runs in a JobSet of its own, a
worker group of the run (``dockrl.kubeflow.steps.evaluate_on_cluster``) whose pod has every hook
of the platform. KFP 2.17 can put on its own pods the platform's ``env``, ``pod_labels`` and
``pod_annotations`` (the tasks that hold accelerators get them), but no hostPath volume,
supplemental group, scheduler name or extended resource besides the one accelerator: compiling
for the ``local`` backend with ``host_paths``, ``accelerator_device_gid``, ``scheduler='volcano'``
or ``extra_resources`` set warns, naming them (``kfp_unapplied_hooks``). Local runs ignore every
platform setting (kfp.local).

Not used: kfp 2.17's task-config passthrough (``@dsl.component(task_config_passthroughs=...)``
with a ``dsl.TaskConfig`` input, kubeflow/pipelines #12185), which forwards one task's
resources, environment, scheduling and volumes to a workload it launches. A run's JobSet is
not one pod shape (CPU dock shards beside accelerator stages, each group sized by its devices),
the launcher's own pod needs other placement than its workers, and a passthrough field is either
forwarded or applied or both; the workers' placement travels in the compiled ``Platform`` instead.

Nothing is compiled at import: ``build_pipeline`` and ``compile_pipeline`` do it when asked.
"""

# no `from __future__ import annotations`: kfp reads the pipeline's parameter types at runtime
import json
import logging
import re
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Sequence

import yaml
from kfp import compiler, dsl, kubernetes, local

from dockrl.components.evaluate import evaluate
from dockrl.components.export_model import export_model
from dockrl.components.prepare_dataset import prepare_dataset
from dockrl.components.resolve_config import resolve_config
from dockrl.components.teardown_workers import teardown_workers
from dockrl.components.train import train
from dockrl.config import load_config
from dockrl.kubeflow.steps import run_parameter_defaults
from dockrl.launch.backend import WORKER_BACKENDS, WorkerBackendName, worker_backend_name
from dockrl.launch.platform import ARCH_LABEL, OBJECT_STORE_KEYS, TRACKER_KEYS, Platform, get_platform
from dockrl.launch.task_mounts import can_isolate, isolate_volumes
from dockrl.run.trackers.tracker import IMAGE_ENV

logger = logging.getLogger(__name__)

PIPELINE_NAME = "dockrl-grpo"
POD_FIELDS_AS_ENV = {"POD_NAME": "metadata.name", "POD_NAMESPACE": "metadata.namespace", "POD_UID": "metadata.uid",
                     "POD_IP": "status.podIP"}
STEPS = ("resolve-config", "prepare-dataset", "sft", "start-from", "train", "export-model", "evaluate", "teardown-workers")
"""Every task of the GRPO pipeline and of the SFT and alignment ones (``pipelines/alignment.py``)."""
SHM_VOLUME = "dshm"
"""The memory-backed emptyDir mounted at ``/dev/shm`` in the tasks that hold accelerators."""

_CPU = re.compile(r"^([0-9]+(\.[0-9]+)?|[0-9]+m)$")
_MEMORY = re.compile(r"^[0-9]+(\.[0-9]+)?(Ki|Mi|Gi|Ti|K|M|G|T)?$")


@dataclass(frozen=True, kw_only=True)
class Requests:
    """CPU and memory a task's pod requests (Kubernetes quantities): what the scheduler reserves
    and a ResourceQuota counts. No limits: a task may use idle CPU; memory beyond the request
    is what the node has spare."""

    cpu: str
    memory: str

    def __post_init__(self) -> None:
        if not _CPU.match(self.cpu):
            raise ValueError(f"cpu request {self.cpu!r}: expected a Kubernetes CPU quantity such as '2', '0.5' or '500m'")
        if not _MEMORY.match(self.memory):
            raise ValueError(f"memory request {self.memory!r}: expected a Kubernetes memory quantity such as '16Gi' or '512Mi'")


DEFAULT_REQUESTS: dict[str, Requests] = {
    "resolve-config": Requests(cpu="500m", memory="1Gi"),
    "prepare-dataset": Requests(cpu="1", memory="4Gi"),
    "start-from": Requests(cpu="250m", memory="512Mi"),
    "train": Requests(cpu="2", memory="8Gi"),  # with the kubernetes backend (drives only); local: sized by its devices
    "export-model": Requests(cpu="2", memory="16Gi"),
    "evaluate": Requests(cpu="4", memory="16Gi"),  # on the CPU image; with an accelerator: a one-device pod's size
    "teardown-workers": Requests(cpu="250m", memory="512Mi"),
}


@dataclass(frozen=True, kw_only=True)
class PipelineSettings:
    """What a compiled package fixes (compile-time); a run cannot change it. The workers of a
    ``kubernetes`` run live in the run's own namespace: the JobSet's owner reference (the
    launcher pod), the launcher's Role, the NetworkPolicy, the shared volume and the Secrets are
    all namespaced, so no other namespace is offered."""

    platform: Platform = field(default_factory=lambda: get_platform("npu"))
    """Accelerators, scheduling, architectures, images and pull secret of the run's pods."""
    worker_backend: WorkerBackendName = "local"
    """``local`` (the stages run in the train task's pod) or ``kubernetes`` (stages as pods)."""
    train_retries: int = 0
    """Times KFP retries a train task that failed by itself, after 60 s (``set_retry``); each retry
    resumes from the run's latest checkpoint on the shared volume (``dockrl.kubeflow.train_retry.prepare_retry``),
    as a retry of the run from the Kubeflow UI does. 0: none. KFP 2.17 compiles it into an Argo
    ``retryStrategy`` without a ``retryPolicy``, so Argo's default ``OnFailure`` applies: a launcher
    that exits non-zero (a worker pod failed, was evicted or lost: the launcher fails the run) is
    retried; a launcher pod that is itself deleted, evicted or on a lost node is not, unless the
    cluster's workflow controller sets a default retry policy (docs/kubeflow.md, Retries)."""
    ttl_after_finished_s: int = 0
    """Seconds the cluster keeps the run's Argo Workflow, and with it its pods and their logs, after the
    run finished, succeeded or failed (``dsl.PipelineConfig(ttl_seconds_after_finished=...)``, Argo's
    ``ttlStrategy.secondsAfterCompletion``); the run's record, artifacts and metrics stay in KFP. 0: the
    cluster's own clean-up (KFP's persistence agent, ``TTL_SECONDS_AFTER_WORKFLOW_FINISH``)."""
    requests: dict[str, Requests] = field(default_factory=dict)
    """Task name -> requests, over ``DEFAULT_REQUESTS`` (the train task with the local backend, and the sft task,
    default to the size of a pod holding the devices its run uses: ``Platform.pod_requests``;
    evaluate with an accelerator to that of a pod holding one)."""

    def __post_init__(self) -> None:
        worker_backend_name(self.worker_backend)
        if self.train_retries < 0:
            raise ValueError(f"train_retries={self.train_retries}: expected a count >= 0")
        if not 0 <= self.ttl_after_finished_s <= 2**31 - 1:
            raise ValueError(f"ttl_after_finished_s={self.ttl_after_finished_s}: expected seconds in 0-{2**31 - 1} (0: the cluster's default)")
        unknown = sorted(set(self.requests) - set(STEPS))
        if unknown:
            raise ValueError(f"requests for {unknown}: no such task; expected some of {', '.join(STEPS)}")

    def requests_of(self, task: str) -> Requests | None:
        """The CPU and memory requests of ``task``; None for the train task of a ``local`` run and the sft task
        without explicit ones: they follow its run's config (resolve-config's outputs)."""
        if task in self.requests:
            return self.requests[task]
        if (task == "train" and self.worker_backend == "local") or task == "sft":
            return None
        if task == "evaluate" and self.worker_backend == "kubernetes":  # drives a worker group, as the train task
            return DEFAULT_REQUESTS["train"]
        if task == "evaluate" and self.platform.accelerator:
            one = self.platform.pod_requests(1)
            return Requests(cpu=one["cpu"], memory=one["memory"])
        return DEFAULT_REQUESTS[task]

    def image_of(self, task: str) -> str:
        """Which image (``cpu``, ``npu``, ``gpu``) ``task`` runs: the platform's for the tasks that
        hold its accelerators (sft; train and evaluate with the local backend), else ``cpu``."""
        if task == "sft" or (task == "train" and self.worker_backend == "local"):
            return self.platform.name
        if task == "evaluate" and self.platform.accelerator and self.worker_backend == "local":
            return self.platform.name
        return "cpu"


def place_task(task: dsl.PipelineTask, name: str, settings: PipelineSettings) -> None:
    """Image, node architectures, requests, pull secret and label of every task."""
    platform, image = settings.platform, settings.image_of(name)
    task.set_container_image(platform.image_of(image))
    # images are built per architecture: a pod on a node of another one fails with "exec format error"
    kubernetes.add_node_affinity(task, match_expressions=[
        {"key": ARCH_LABEL, "operator": "In", "values": list(platform.architectures_of(image))}])
    req = settings.requests_of(name)
    if req is not None:
        task.set_cpu_request(req.cpu).set_memory_request(req.memory)
    if platform.image_pull_secret:
        kubernetes.set_image_pull_secrets(task, [platform.image_pull_secret])
    kubernetes.add_pod_label(task, label_key="app.kubernetes.io/part-of", label_value="dockrl")


def kfp_unapplied_hooks(settings: PipelineSettings) -> list[str]:
    """The platform's site hooks that the KFP tasks holding accelerators (train and evaluate with
    the ``local`` backend) do not get, since KFP 2.17 cannot express them on its pods: hostPath
    volumes, supplemental groups, a scheduler name, extended resources besides the accelerator.
    Empty with the ``kubernetes`` backend, whose worker pods get them all."""
    p = settings.platform
    if settings.worker_backend != "local" or not p.accelerator:
        return []
    hooks = {"host_paths (hostPath volumes)": bool(p.host_paths),
             f"accelerator_device_gid={p.accelerator_device_gid} (supplementalGroups)": bool(p.accelerator_device_gid),
             "scheduler='volcano' (schedulerName)": p.scheduler == "volcano",
             "extra_resources (extended resources)": bool(p.extra_resources)}
    return [name for name, set_ in hooks.items() if set_]


def _accelerator_nodes(task: dsl.PipelineTask, platform: Platform, shm_devices: int) -> None:
    """The platform's node selector and tolerations, its ``env``, ``pod_labels`` and
    ``pod_annotations`` (the hooks KFP can apply), and a ``/dev/shm`` for ``shm_devices``
    devices: vLLM's workers, NCCL and HCCL exchange through it, and a container's default is
    64 MiB. A memory-backed emptyDir counts against the pod's memory; its size is a cap."""
    for name, value in sorted(platform.env.items()):
        task.set_env_variable(name, value)
    for key, value in sorted(platform.pod_labels.items()):
        kubernetes.add_pod_label(task, label_key=key, label_value=value)
    for key, value in sorted(platform.pod_annotations.items()):
        kubernetes.add_pod_annotation(task, annotation_key=key, annotation_value=value)
    for key, value in platform.node_selector.items():
        kubernetes.add_node_selector(task, label_key=key, label_value=value)
    for t in platform.tolerations:
        kubernetes.add_toleration(task, key=t.key, operator=t.operator, value=t.value or None, effect=t.effect)
    kubernetes.empty_dir_mount(task, volume_name=SHM_VOLUME, mount_path="/dev/shm", medium="Memory",
                               size_limit=platform.shm_size(shm_devices))


def _shared_volume(task: dsl.PipelineTask, platform: Platform) -> None:
    if platform.shared_volume_claim:
        kubernetes.mount_pvc(task, pvc_name=platform.shared_volume_claim, mount_path=platform.shared_mount_path)


def _object_store(task: dsl.PipelineTask, platform: Platform) -> None:
    if platform.object_store_secret:
        # optional: a run with neither the S3 warehouse nor s3:// inputs needs no Secret (manifests/components/object-store)
        kubernetes.use_secret_as_env(task, secret_name=platform.object_store_secret,
                                     secret_key_to_env={k: k for k in OBJECT_STORE_KEYS}, optional=True)


def reads_run_inputs(task: dsl.PipelineTask, platform: Platform) -> None:
    """A task that reads the run's inputs or the model: the shared volume (a path there: the user's
    model and data, the run folder, an exported model's folder) and the object-store Secret (an
    ``s3://`` URI). Every task whose config or model artifact may name one of them gets both, so
    what it reads is there in its pod whatever the backend."""
    _shared_volume(task, platform)
    _object_store(task, platform)


def configure_launcher(task: dsl.PipelineTask, settings: PipelineSettings, size: dsl.PipelineTask) -> None:
    """The train task: the shared volume and the object-store Secret (``reads_run_inputs``); with the
    local backend the platform's accelerators and scheduling, sized by ``size`` (resolve-config: the
    devices its run uses, and the CPU and memory of a pod holding them)."""
    platform = settings.platform
    task.set_caching_options(False)  # a training run is never served from the cache
    if settings.worker_backend == "local":
        if settings.requests_of("train") is None:
            task.set_cpu_request(size.outputs["cpu"]).set_memory_request(size.outputs["memory"])
        if platform.accelerator:
            task.set_accelerator_type(platform.accelerator).set_accelerator_limit(size.outputs["devices"])
            # the size is known only at run time: room for as many devices as a node has
            _accelerator_nodes(task, platform, platform.devices_per_node)
    # the run folder lives on the shared volume with either backend (dockrl.kubeflow.train_task): a retry of
    # the task finds its checkpoints there and resumes instead of starting over
    reads_run_inputs(task, platform)
    if settings.train_retries:
        task.set_retry(num_retries=settings.train_retries, backoff_duration="60s")
    for env, path in POD_FIELDS_AS_ENV.items():
        kubernetes.use_field_path_as_env(task, env_name=env, field_path=path)
    # the driver's trackers (run.trackers): their lineage names the image, their server and keys come from a
    # Secret as the object store's do, optional as that one is: a run without MLflow or W&B needs none
    task.set_env_variable(IMAGE_ENV, platform.image_of(settings.image_of("train")))
    if platform.tracker_secret:
        kubernetes.use_secret_as_env(task, secret_name=platform.tracker_secret,
                                     secret_key_to_env={k: k for k in TRACKER_KEYS}, optional=True)


def configure_sft(task: dsl.PipelineTask, settings: PipelineSettings, size: dsl.PipelineTask) -> None:
    """The sft task (``pipelines/alignment.py``): one process on one device in its own pod with either worker
    backend, sized by ``size`` (its resolve-config: the devices, CPU and memory of a pod holding them), the
    platform's accelerators and scheduling, the shared volume and the object-store Secret; never cached."""
    platform = settings.platform
    task.set_caching_options(False)  # a training run is never served from the cache
    if settings.requests_of("sft") is None:
        task.set_cpu_request(size.outputs["cpu"]).set_memory_request(size.outputs["memory"])
    if platform.accelerator:
        task.set_accelerator_type(platform.accelerator).set_accelerator_limit(size.outputs["devices"])
        _accelerator_nodes(task, platform, 1)
    reads_run_inputs(task, platform)


def configure_evaluate(task: dsl.PipelineTask, settings: PipelineSettings) -> None:
    """Evaluate (the shared volume and the object-store Secret: ``reads_run_inputs``): with the kubernetes
    backend a launcher of its worker group (the pod's own name, namespace and uid: the JobSet's owner); else
    on a platform with accelerators one of them and its nodes."""
    platform = settings.platform
    reads_run_inputs(task, platform)
    if settings.worker_backend == "kubernetes":
        for env, path in POD_FIELDS_AS_ENV.items():
            kubernetes.use_field_path_as_env(task, env_name=env, field_path=path)
    elif platform.accelerator:
        task.set_accelerator_type(platform.accelerator).set_accelerator_limit(1)
        _accelerator_nodes(task, platform, 1)


def build_pipeline(platform: Platform | str = "npu", worker_backend: WorkerBackendName = "local", *,
                   settings: PipelineSettings | None = None):
    """The GRPO pipeline for ``platform`` (a preset name or a ``Platform``) and ``worker_backend``,
    or for ``settings`` (which then fix both).

    Raises:
        ValueError: unknown platform, worker backend or task, a bad request quantity, or an
            image built for none of the platform's architectures.
    """
    if settings is None:
        settings = PipelineSettings(platform=get_platform(platform) if isinstance(platform, str) else platform,
                                    worker_backend=worker_backend)
    s = settings
    p = run_parameter_defaults()
    unapplied = kfp_unapplied_hooks(s)
    if unapplied:
        logger.warning("platform %r with the local worker backend: KFP cannot put %s on the train and evaluate pods, which "
                       "hold the accelerators; they run without. Compile with --worker-backend kubernetes (every worker "
                       "pod gets every hook), or make the nodes work without them", s.platform.name, ", ".join(unapplied))

    config = dsl.PipelineConfig(ttl_seconds_after_finished=s.ttl_after_finished_s or None)

    @dsl.pipeline(name=PIPELINE_NAME, pipeline_config=config,
                  description=f"GRPO post-training through the transfer dock ({s.platform.name}, {s.worker_backend} workers)")
    def grpo(
        iterations: int = p["iterations"],
        global_batch: int = p["global_batch"],
        mini_batch: int = p["mini_batch"],
        group_size: int = p["group_size"],
        learning_rate: float = p["learning_rate"],
        kl_loss_coef: float = p["kl_loss_coef"],
        max_response_length: int = p["max_response_length"],
        adv_estimator: str = p["adv_estimator"],
        model_path: str = p["model_path"],
        train_data: str = p["train_data"],
        test_data: str = p["test_data"],
        keep_checkpoints: int = p["keep_checkpoints"],
        config_overrides: str = "",
        export_dtype: str = "bfloat16",
        copy_model: bool = False,
        export_uri: str = "",
    ):
        """GRPO post-training through the transfer dock.

        Args:
            iterations: RL iterations, one global batch of prompts each (trainer.iterations).
            global_batch: Prompts per iteration; each is answered group_size times (trainer.global_batch).
            mini_batch: Prompts per optimizer step; divides global_batch (trainer.mini_batch).
            group_size: Responses sampled per prompt: the group whose rewards are compared (rollout.n).
            learning_rate: AdamW learning rate of the policy (trainer.lr).
            kl_loss_coef: Weight of the KL penalty to the reference model in the loss; 0: none (algorithm.kl_loss_coef).
            max_response_length: Most generated tokens per response; a longer one is cut and flagged truncated
                (rollout.max_response_length).
            adv_estimator: Advantage estimator: grpo, rloo, reinforce_plus_plus, gae (PPO, with a critic) or dr_grpo
                (algorithm.adv_estimator).
            model_path: The model training starts from: a folder on the shared volume, an s3:// URI, or smollm2-135m,
                the model every image holds (model.path).
            train_data: Training prompts in GSM8K format (JSONL or Parquet): a path on the shared volume or an s3:// URI;
                empty: seeded generated problems (data.train_path).
            test_data: Evaluation prompts, as train_data; empty: a seeded held-out split; champ: the CHAMP problems
                (data.test_path).
            keep_checkpoints: Newest intermediate checkpoints kept on the shared volume besides the final one; 0 keeps
                all (trainer.keep_checkpoints).
            config_overrides: Any other config field, one section.field=value per line, e.g. trainer.save_every=10;
                empty lines and lines starting with # are skipped; they win over the parameters above. The
                resolve-config step checks them and fails naming the field.
            export_dtype: dtype of the exported model: bfloat16, float16 or float32.
            copy_model: Also put the exported model's weights into KFP's artifact store; false: they stay on the
                shared volume (or at export_uri) and the artifact names them.
            export_uri: s3://<bucket>/<key> to put the exported model in the object store; empty: the run's folder on
                the shared volume.
        """
        teardown = teardown_workers(run_id=dsl.PIPELINE_JOB_ID_PLACEHOLDER, worker_backend=s.worker_backend)
        teardown.set_caching_options(False)
        place_task(teardown, "teardown-workers", s)
        kubernetes.use_field_path_as_env(teardown, env_name="POD_NAMESPACE", field_path="metadata.namespace")
        with dsl.ExitHandler(teardown, name="grpo-run"):
            resolved = resolve_step(
                s, p, config_overrides, iterations=iterations, global_batch=global_batch, mini_batch=mini_batch, group_size=group_size,
                learning_rate=learning_rate, kl_loss_coef=kl_loss_coef, max_response_length=max_response_length, adv_estimator=adv_estimator,
                model_path=model_path, train_data=train_data, test_data=test_data, keep_checkpoints=keep_checkpoints)
            overrides = resolved.outputs["overrides"]
            data = dataset_step(s, overrides)
            trained = train_step(s, resolved, data, overrides)
            export_and_evaluate(s, trained.outputs["model"], data, overrides, export_dtype=export_dtype, copy_model=copy_model,
                                export_uri=export_uri)

    return grpo


def resolve_step(s: PipelineSettings, p: dict, config_overrides, **params) -> dsl.PipelineTask:
    """The resolve-config task of ``params`` (run parameters; the rest at their defaults ``p``) and ``config_overrides``."""
    names = ("iterations", "global_batch", "mini_batch", "group_size", "learning_rate", "kl_loss_coef", "max_response_length",
             "adv_estimator", "model_path", "train_data", "test_data", "keep_checkpoints")
    resolved = resolve_config(**{n: params.get(n, p[n]) for n in names}, config_overrides=config_overrides, platform=s.platform.to_json())
    place_task(resolved, "resolve-config", s)
    reads_run_inputs(resolved, s.platform)  # the model's shape is checked against the layout
    return resolved


def dataset_step(s: PipelineSettings, overrides) -> dsl.PipelineTask:
    """The prepare-dataset task of ``overrides``."""
    data = prepare_dataset(config_overrides=overrides)
    # never from the cache: its key is the overrides, which name a data file by its path, so a file changed
    # at the same path would give yesterday's data (docs/kubeflow.md, What a run keeps, and what is never cached)
    data.set_caching_options(False)
    place_task(data, "prepare-dataset", s)
    reads_run_inputs(data, s.platform)
    return data


def train_step(s: PipelineSettings, resolved: dsl.PipelineTask, data: dsl.PipelineTask, overrides) -> dsl.PipelineTask:
    """The train task (the GRPO launcher) on ``data``'s dataset, sized by ``resolved``."""
    trained = train(config_overrides=overrides, dataset=data.outputs["dataset"], worker_backend=s.worker_backend,
                    run_id=dsl.PIPELINE_JOB_ID_PLACEHOLDER, platform=s.platform.to_json())
    place_task(trained, "train", s)
    configure_launcher(trained, s, resolved)
    return trained


def export_and_evaluate(s: PipelineSettings, model, data: dsl.PipelineTask, overrides, *, export_dtype, copy_model, export_uri) -> None:
    """The export-model task of ``model`` (a model artifact) and the evaluate task of its export."""
    exported = export_model(checkpoint=model, dtype=export_dtype, copy=copy_model, uri=export_uri, config_overrides=overrides)
    place_task(exported, "export-model", s)
    reads_run_inputs(exported, s.platform)  # the final checkpoint stays on the shared volume
    evaluated = evaluate(model=exported.outputs["model"], dataset=data.outputs["dataset"], config_overrides=overrides,
                         device="auto" if s.platform.accelerator else "cpu", worker_backend=s.worker_backend,
                         run_id=dsl.PIPELINE_JOB_ID_PLACEHOLDER, platform=s.platform.to_json())
    place_task(evaluated, "evaluate", s)
    configure_evaluate(evaluated, s)


PIPELINE_KINDS = ("grpo", "sft", "alignment")
"""The pipelines ``dockrl pipeline compile --kind`` builds: GRPO (this module), SFT and SFT → GRPO (``pipelines/alignment.py``)."""


def build_kind(kind: str, settings: PipelineSettings):
    """The pipeline of ``kind`` (``PIPELINE_KINDS``) for ``settings``.

    Raises:
        ValueError: an unknown kind.
    """
    if kind == "grpo":
        return build_pipeline(settings=settings)
    from dockrl.pipelines.alignment import build_alignment_pipeline, build_sft_pipeline  # lazy: it imports this module

    builders = {"sft": build_sft_pipeline, "alignment": build_alignment_pipeline}
    if kind not in builders:
        raise ValueError(f"pipeline kind {kind!r}: expected one of {', '.join(PIPELINE_KINDS)}")
    return builders[kind](settings)


def compile_pipeline(out: str | Path, platform: Platform | str = "npu", worker_backend: WorkerBackendName = "local", *,
                     settings: PipelineSettings | None = None, kind: str = "grpo") -> Path:
    """Compile the pipeline IR of ``kind`` (``PIPELINE_KINDS``) to ``out`` (``.yaml``); returns the path (see ``build_pipeline``).

    Raises:
        ValueError: ``out`` is not a ``.yaml``/``.json`` file name, or its folder does not exist; an unknown kind.
    """
    out = Path(out)
    if out.suffix not in (".yaml", ".yml", ".json"):
        raise ValueError(f"pipeline package {out}: expected a .yaml or .json file name")
    if not out.parent.is_dir():  # a mistyped path is named, not created
        raise ValueError(f"pipeline package {out}: the folder {out.parent} does not exist")
    if settings is None:
        settings = PipelineSettings(platform=get_platform(platform) if isinstance(platform, str) else platform,
                                    worker_backend=worker_backend)
    compiler.Compiler().compile(build_kind(kind, settings), str(out))
    return out


def compiled_worker_backend(package: str | Path) -> str:
    """The worker backend a compiled package was built for (its train task's constant input).

    Raises:
        ValueError: ``package`` is not a dockrl pipeline package (no train task).
    """
    docs = list(yaml.safe_load_all(Path(package).read_text()))
    spec = docs[0] if docs else None
    if not isinstance(spec, dict):
        raise ValueError(f"{package}: not a compiled pipeline (no pipeline spec)")
    for component in (spec.get("components") or {}).values():
        task = ((component.get("dag") or {}).get("tasks") or {}).get("train")
        if task:
            param = task.get("inputs", {}).get("parameters", {}).get("worker_backend", {})
            value = param.get("runtimeValue", {}).get("constant")
            if value in WORKER_BACKENDS:
                return value
    raise ValueError(f"{package}: no train task with a compiled-in worker_backend: not a package of this dockrl version "
                     "(recompile it with `dockrl pipeline compile`)")


def run_local(overrides: list[str], pipeline_root: str | Path, *, export_dtype: str = "bfloat16",
              shared_dir: str | Path | None = None, isolate: bool | None = None, parameters: dict | None = None,
              kind: str = "grpo", sft_overrides: Sequence[str] = ()) -> Path:
    """Run the whole pipeline on this machine with ``kfp.local`` (tasks as subprocesses), shaped like the cluster.

    Needs no Docker, cluster or network: tasks run in this Python environment one at a time;
    platform settings (accelerators, node selectors, Secrets) are ignored locally. The shared volume is
    the folder ``shared_dir`` (default ``<pipeline_root>/shared``): the tasks that mount it in the
    compiled pipeline find it at that path, and with ``isolate`` each other task starts in a mount
    namespace where it is hidden (``dockrl.launch.task_mounts``), as it is from that task's pod. ``isolate``
    None: where this process may (root), else a warning. Put a run's own model and data there and give
    their paths (``model_path``, ``train_data``, ``test_data`` in ``parameters``, or the overrides) as on the cluster.

    ``kind`` (``PIPELINE_KINDS``): the pipeline; with ``alignment`` the SFT phase reads ``overrides`` then
    ``sft_overrides`` (which win), the GRPO phase ``overrides``.

    Returns:
        The run's folder under ``pipeline_root``: one sub-folder per task with its artifacts
        (``prepare-dataset/dataset``, ``train/model``, ``train/run_dir``, ``train/curves``,
        ``train/rollouts``, ``train/rollouts_page``, ``export-model/model``) and its ``executor_output.json`` (artifact metadata, metrics).

    Raises:
        ConfigError: an invalid override, before any task starts.
        ValueError: ``shared_dir`` holds ``pipeline_root``, or the folder above it does not exist.
        OSError: ``isolate=True`` where this process may not create mount namespaces.
        RuntimeError: a task failed (kfp.local names the task and shows its log).
    """
    load_config(None, overrides)  # fail here, naming the field, before any task starts
    if sft_overrides:
        if kind != "alignment":
            raise ValueError(f"sft_overrides: only the alignment pipeline has an SFT phase of its own (kind={kind!r}); "
                             "give them as the overrides")
        load_config(None, [*overrides, *sft_overrides])
    root = Path(pipeline_root).resolve()
    shared = Path(shared_dir).resolve() if shared_dir else root / "shared"
    if shared_dir and not shared.parent.is_dir():  # a mistyped path is named, not created
        raise ValueError(f"shared_dir {shared}: the folder above it, {shared.parent}, does not exist")
    root.mkdir(parents=True, exist_ok=True)
    if root.is_relative_to(shared):
        raise ValueError(f"shared_dir {shared} holds the pipeline root {root}: the tasks that do not mount the shared "
                         "volume could not write their outputs; give a folder beside it")
    shared.mkdir(parents=True, exist_ok=True)
    platform = replace(get_platform("cpu"), shared_mount_path=str(shared))
    pipeline = build_kind(kind, PipelineSettings(platform=platform, worker_backend="local"))
    if isolate is None:
        isolate = can_isolate()
        if not isolate:
            logger.warning("local run: not root, so every task sees the whole machine, %s included; on a cluster only the "
                           "tasks that mount the shared volume see it", shared)
    if isolate:
        isolate_volumes(pipeline, {platform.shared_volume_claim: shared})
    name = pipeline.pipeline_spec.pipeline_info.name
    before = set(root.glob(f"{name}-*"))
    local.init(runner=local.SubprocessRunner(use_venv=False), pipeline_root=str(root), raise_on_error=True)
    sft = {"sft_config_overrides": "\n".join([*overrides, *sft_overrides])} if kind == "alignment" else {}
    pipeline(**{"config_overrides": "\n".join(overrides), "export_dtype": export_dtype, **sft, **(parameters or {})})
    new = sorted(set(root.glob(f"{name}-*")) - before)
    if len(new) != 1:
        raise RuntimeError(f"expected one new run folder under {root}, found {[p.name for p in new]}")
    return new[0]


def local_summary(run_dir: str | Path) -> dict:
    """What ``dockrl pipeline run --local`` prints: where the artifacts are (the exported model: where its
    artifact names it, on the shared volume; the kept rollouts and their page only when the run kept them,
    ``run.keep_rollouts``), the greedy test accuracy before training (train step) and of the exported model
    (evaluate step), and the training seconds; with an sft step its numbers too, as ``sft/...``."""
    run = Path(run_dir)
    summary = {
        "run_dir": str(run),
        "dataset": str(run / "prepare-dataset" / "dataset"),
        "model": task_metadata(run, "export-model", "model").get("path", str(run / "export-model" / "model")),
    }
    if (run / "sft").is_dir():  # the SFT and alignment pipelines
        sft = task_metadata(run, "sft", "metrics")
        summary |= {"sft_run_dir": str(run / "sft" / "run_dir")}
        named = {"eval/accuracy_before": "sft/eval/accuracy_before", "sft/steps": "sft/steps", "run/seconds": "sft/run/seconds"}
        summary |= {to: sft[k] for k, to in named.items() if k in sft}
    if (run / "train").is_dir():
        train = task_metadata(run, "train", "metrics")
        summary |= {"train_run_dir": str(run / "train" / "run_dir"), "curves": str(run / "train" / "curves")}
        if task_metadata(run, "train", "rollouts").get("keep_rollouts", "off") != "off":  # an empty Dataset otherwise
            summary |= {"rollouts": str(run / "train" / "rollouts"), "rollouts_page": str(run / "train" / "rollouts_page")}
        summary |= {k: train[k] for k in ("eval/accuracy_before", "eval/format_rate_before", "run/seconds") if k in train}
    return summary | task_metadata(run, "evaluate", "metrics")


def task_metadata(run_dir: str | Path, task: str, artifact: str) -> dict:
    """Metadata of output ``artifact`` of ``task`` in a local run folder (metrics for Metrics)."""
    path = Path(run_dir) / task / "executor_output.json"
    outputs = json.loads(path.read_text()).get("artifacts", {})
    if artifact not in outputs:
        raise KeyError(f"{path}: task {task!r} has no output artifact {artifact!r}; it has {sorted(outputs)}")
    return dict(outputs[artifact]["artifacts"][0].get("metadata", {}))


__all__ = ["DEFAULT_REQUESTS", "PIPELINE_KINDS", "PIPELINE_NAME", "PipelineSettings", "Requests", "build_kind", "build_pipeline",
           "compile_pipeline", "compiled_worker_backend", "configure_sft", "dataset_step", "export_and_evaluate", "kfp_unapplied_hooks",
           "local_summary", "place_task", "reads_run_inputs", "resolve_step", "run_local", "task_metadata", "train_step"]
