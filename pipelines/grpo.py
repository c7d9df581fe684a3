"""The GRPO pipeline: resolve_config → prepare_dataset → train → export_model → evaluate; workers torn down on exit.

    dockrl pipeline compile grpo.yaml --platform npu     # IR for the Kubeflow UI / kfp.Client
    dockrl pipeline compile grpo.yaml --platform npu --worker-backend kubernetes \\
        --registry registry.example.com/ml --tag 0.1.0 --pull-secret regcred     # stages as pods
    dockrl pipeline run --local trainer.iterations=2     # the whole pipeline on this machine

Compile-time (settings of the package, ``PipelineSettings``): the worker backend, the platform
(image registry, tag or digests, pull secret, accelerators, node selector, tolerations), the
workers' namespace and every task's CPU and memory requests. Run-time (the pipeline's
parameters, what a user changes per run in the UI): ``dockrl.launch.tasks.RUN_PARAMETERS``
(iterations, batch sizes, group size, learning rate, KL coefficient, response length,
algorithm, model and data paths) with the config's defaults, ``config_overrides``
(``section.field=value`` strings, for any other config field; they win over a parameter) and
``export_dtype``.

The steps run inside a ``dsl.ExitHandler`` whose exit task tears down the run's worker groups
whatever happened. With the ``local`` backend the train task (the launcher) runs the whole job
in its pod: it carries the platform's image, accelerators, node selector and tolerations. With
``kubernetes`` it only drives: the stages run in pods of their own (``dockrl/launch/kubernetes.py``),
the train task runs on the CPU image without accelerators and mounts the shared volume (the run
folder: data, checkpoints, TensorBoard events) and the object-store Secret; export-model mounts
the shared volume too (it reads the final checkpoint there). Local runs ignore every platform
setting (kfp.local).

Nothing is compiled at import: ``build_pipeline`` and ``compile_pipeline`` do it when asked.
"""

# no `from __future__ import annotations`: kfp reads the pipeline's parameter types at runtime
import re
from dataclasses import dataclass, field
from pathlib import Path

from kfp import compiler, dsl, kubernetes

from components.evaluate import evaluate
from components.export_model import export_model
from components.prepare_dataset import prepare_dataset
from components.resolve_config import resolve_config
from components.teardown_workers import teardown_workers
from components.train import train
from dockrl.launch.backend import WORKER_BACKENDS, WorkerBackendName, worker_backend_name
from dockrl.launch.platform import OBJECT_STORE_KEYS, Platform, get_platform
from dockrl.launch.tasks import run_parameter_defaults

PIPELINE_NAME = "dockrl-grpo"
POD_FIELDS_AS_ENV = {"POD_NAME": "metadata.name", "POD_NAMESPACE": "metadata.namespace", "POD_UID": "metadata.uid",
                     "POD_IP": "status.podIP"}
STEPS = ("resolve-config", "prepare-dataset", "train", "export-model", "evaluate", "teardown-workers")

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
    "train": Requests(cpu="2", memory="8Gi"),  # with the kubernetes backend (drives only); local: the platform's stage size
    "export-model": Requests(cpu="2", memory="16Gi"),
    "evaluate": Requests(cpu="4", memory="16Gi"),
    "teardown-workers": Requests(cpu="250m", memory="512Mi"),
}


@dataclass(frozen=True, kw_only=True)
class PipelineSettings:
    """What a compiled package fixes (compile-time); a run cannot change it."""

    platform: Platform = field(default_factory=lambda: get_platform("npu"))
    """Accelerators, scheduling, images and pull secret of the accelerator-bound pods."""
    worker_backend: WorkerBackendName = "local"
    """``local`` (the stages run in the train task's pod) or ``kubernetes`` (stages as pods)."""
    workers_namespace: str = ""
    """Namespace of the worker pods ("" for the launcher's own: the run's profile namespace)."""
    requests: dict[str, Requests] = field(default_factory=dict)
    """Task name -> requests, over ``DEFAULT_REQUESTS`` (the train task with the local backend
    defaults to the platform's stage size: it runs every stage)."""

    def __post_init__(self) -> None:
        worker_backend_name(self.worker_backend)
        unknown = sorted(set(self.requests) - set(STEPS))
        if unknown:
            raise ValueError(f"requests for {unknown}: no such task; expected some of {', '.join(STEPS)}")
        if self.workers_namespace and not re.match(r"^[a-z0-9]([-a-z0-9]{0,61}[a-z0-9])?$", self.workers_namespace):
            raise ValueError(f"workers_namespace {self.workers_namespace!r}: expected a Kubernetes namespace name")

    def requests_of(self, task: str) -> Requests:
        if task in self.requests:
            return self.requests[task]
        if task == "train" and self.worker_backend == "local":
            return Requests(cpu=self.platform.stage_cpu, memory=self.platform.stage_memory)
        return DEFAULT_REQUESTS[task]


def _common(task: dsl.PipelineTask, name: str, settings: PipelineSettings) -> None:
    """Image, requests, pull secret and label of every task."""
    req = settings.requests_of(name)
    task.set_cpu_request(req.cpu).set_memory_request(req.memory)
    task.set_container_image(settings.platform.cpu_image)
    if settings.platform.image_pull_secret:
        kubernetes.set_image_pull_secrets(task, [settings.platform.image_pull_secret])
    kubernetes.add_pod_label(task, label_key="app.kubernetes.io/part-of", label_value="dockrl")


def _shared_volume(task: dsl.PipelineTask, platform: Platform) -> None:
    if platform.shared_volume_claim:
        kubernetes.mount_pvc(task, pvc_name=platform.shared_volume_claim, mount_path=platform.shared_mount_path)


def _configure_launcher(task: dsl.PipelineTask, settings: PipelineSettings) -> None:
    """The train task: with the local backend the platform's image, accelerators and scheduling
    (it runs every stage); with kubernetes the shared volume and the object-store Secret."""
    platform = settings.platform
    task.set_caching_options(False)  # a training run is never served from the cache
    if settings.worker_backend == "local":
        task.set_container_image(platform.image)
        if platform.accelerator:
            task.set_accelerator_type(platform.accelerator).set_accelerator_limit(platform.accelerators_per_pod)
        for key, value in platform.node_selector.items():
            kubernetes.add_node_selector(task, label_key=key, label_value=value)
        for t in platform.tolerations:
            kubernetes.add_toleration(task, key=t.key, operator=t.operator, value=t.value or None, effect=t.effect)
    else:
        if platform.object_store_secret:
            kubernetes.use_secret_as_env(task, secret_name=platform.object_store_secret,
                                         secret_key_to_env={k: k for k in OBJECT_STORE_KEYS})
        _shared_volume(task, platform)
    for env, path in POD_FIELDS_AS_ENV.items():
        kubernetes.use_field_path_as_env(task, env_name=env, field_path=path)


def build_pipeline(platform: Platform | str = "npu", worker_backend: WorkerBackendName = "local", *,
                   settings: PipelineSettings | None = None):
    """The GRPO pipeline for ``platform`` (a preset name or a ``Platform``) and ``worker_backend``,
    or for ``settings`` (which then fix both).

    Raises:
        ValueError: unknown platform, worker backend or task, or a bad request quantity.
    """
    if settings is None:
        settings = PipelineSettings(platform=get_platform(platform) if isinstance(platform, str) else platform,
                                    worker_backend=worker_backend)
    s = settings
    p = run_parameter_defaults()

    @dsl.pipeline(name=PIPELINE_NAME,
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
        config_overrides: list[str] = [],  # noqa: B006 - KFP writes the default into the pipeline spec; never mutated
        export_dtype: str = "bfloat16",
    ):
        teardown = teardown_workers(run_id=dsl.PIPELINE_JOB_ID_PLACEHOLDER, worker_backend=s.worker_backend,
                                    workers_namespace=s.workers_namespace)
        teardown.set_caching_options(False)
        _common(teardown, "teardown-workers", s)
        kubernetes.use_field_path_as_env(teardown, env_name="POD_NAMESPACE", field_path="metadata.namespace")
        with dsl.ExitHandler(teardown, name="grpo-run"):
            resolved = resolve_config(
                iterations=iterations, global_batch=global_batch, mini_batch=mini_batch, group_size=group_size,
                learning_rate=learning_rate, kl_loss_coef=kl_loss_coef, max_response_length=max_response_length, adv_estimator=adv_estimator,
                model_path=model_path, train_data=train_data, test_data=test_data, config_overrides=config_overrides)
            _common(resolved, "resolve-config", s)
            overrides = resolved.output
            data = prepare_dataset(config_overrides=overrides)
            _common(data, "prepare-dataset", s)
            trained = train(config_overrides=overrides, dataset=data.outputs["dataset"], worker_backend=s.worker_backend,
                            run_id=dsl.PIPELINE_JOB_ID_PLACEHOLDER, workers_namespace=s.workers_namespace,
                            platform=s.platform.to_json())
            _common(trained, "train", s)
            _configure_launcher(trained, s)
            exported = export_model(checkpoint=trained.outputs["model"], dtype=export_dtype)
            _common(exported, "export-model", s)
            if s.worker_backend == "kubernetes":  # the final checkpoint stays on the shared volume
                _shared_volume(exported, s.platform)
            evaluated = evaluate(model=exported.outputs["model"], dataset=data.outputs["dataset"], config_overrides=overrides)
            _common(evaluated, "evaluate", s)

    return grpo


def compile_pipeline(out: str | Path, platform: str = "npu", worker_backend: WorkerBackendName = "local", *,
                     settings: PipelineSettings | None = None) -> Path:
    """Compile the pipeline IR to ``out`` (``.yaml``); returns the path (see ``build_pipeline``)."""
    out = Path(out)
    if out.suffix not in (".yaml", ".yml", ".json"):
        raise ValueError(f"pipeline package {out}: expected a .yaml or .json file name")
    pipeline = build_pipeline(platform, worker_backend, settings=settings)
    out.parent.mkdir(parents=True, exist_ok=True)
    compiler.Compiler().compile(pipeline, str(out))
    return out


def compiled_worker_backend(package: str | Path) -> str:
    """The worker backend a compiled package was built for (its train task's constant input).

    Raises:
        ValueError: ``package`` is not a dockrl pipeline package (no train task).
    """
    import yaml

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


def run_local(overrides: list[str], pipeline_root: str | Path, *, export_dtype: str = "bfloat16") -> Path:
    """Run the whole pipeline on this machine with ``kfp.local`` (tasks as subprocesses).

    Needs no Docker, cluster or network: tasks run in this Python environment one at a time;
    platform settings (accelerators, node selectors, Secrets) are ignored locally.

    Returns:
        The run's folder under ``pipeline_root``: one sub-folder per task with its artifacts
        (``prepare-dataset/dataset``, ``train/model``, ``train/run_dir``, ``train/curves``,
        ``export-model/model``) and its ``executor_output.json`` (artifact metadata, metrics).

    Raises:
        ConfigError: an invalid override, before any task starts.
        RuntimeError: a task failed (kfp.local names the task and shows its log).
    """
    from kfp import local

    from dockrl.config import load_config

    load_config(None, overrides)  # fail here, naming the field, before any task starts
    root = Path(pipeline_root).resolve()
    root.mkdir(parents=True, exist_ok=True)
    before = set(root.glob(f"{PIPELINE_NAME}-*"))
    local.init(runner=local.SubprocessRunner(use_venv=False), pipeline_root=str(root), raise_on_error=True)
    build_pipeline("cpu", "local")(config_overrides=list(overrides), export_dtype=export_dtype)
    new = sorted(set(root.glob(f"{PIPELINE_NAME}-*")) - before)
    if len(new) != 1:
        raise RuntimeError(f"expected one new run folder under {root}, found {[p.name for p in new]}")
    return new[0]


def local_summary(run_dir: str | Path) -> dict:
    """What ``dockrl pipeline run --local`` prints: where the artifacts are, the greedy test
    accuracy before training (train step) and of the exported model (evaluate step), and the
    training seconds."""
    run = Path(run_dir)
    train = task_metadata(run, "train", "metrics")
    summary = {
        "run_dir": str(run),
        "dataset": str(run / "prepare-dataset" / "dataset"),
        "model": str(run / "export-model" / "model"),
        "train_run_dir": str(run / "train" / "run_dir"),
        "curves": str(run / "train" / "curves"),
    }
    summary |= {k: train[k] for k in ("eval/accuracy_before", "eval/format_rate_before", "run/seconds") if k in train}
    return summary | task_metadata(run, "evaluate", "metrics")


def task_metadata(run_dir: str | Path, task: str, artifact: str) -> dict:
    """Metadata of output ``artifact`` of ``task`` in a local run folder (metrics for Metrics)."""
    import json

    path = Path(run_dir) / task / "executor_output.json"
    outputs = json.loads(path.read_text()).get("artifacts", {})
    if artifact not in outputs:
        raise KeyError(f"{path}: task {task!r} has no output artifact {artifact!r}; it has {sorted(outputs)}")
    return dict(outputs[artifact]["artifacts"][0].get("metadata", {}))


__all__ = ["DEFAULT_REQUESTS", "PIPELINE_NAME", "PipelineSettings", "Requests", "build_pipeline",
           "compile_pipeline", "compiled_worker_backend", "local_summary", "run_local", "task_metadata"]
