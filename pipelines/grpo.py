"""The GRPO pipeline: prepare_dataset → train → export_model → evaluate; workers torn down on exit.

    dockrl pipeline compile grpo.yaml --platform npu     # IR for the Kubeflow UI / kfp.Client
    dockrl pipeline compile grpo.yaml --platform npu --worker-backend kubernetes   # stages as pods
    dockrl pipeline run --local trainer.iterations=2     # the whole pipeline on this machine

The four steps run inside a ``dsl.ExitHandler`` whose exit task tears down the run's worker
groups whatever happened. The train task (the launcher) carries the platform's settings
(``dockrl/launch/platform.py``): image, accelerator type and count, node selector,
tolerations, the object-store Secret as environment, the shared volume (where the run folder
lives when the stages run as pods), and its own pod name, namespace, uid (owner of the workers
it starts) and IP (where the workers reach it). Local runs ignore those settings (kfp.local).

Compiled for the ``kubernetes`` worker backend, the launcher only drives: the stages run in
pods of their own on the accelerators, so the train task runs on the CPU image without
accelerators, node selector or tolerations (and ``worker_backend`` defaults to ``kubernetes``).

Pipeline parameters: ``config_overrides`` (``section.field=value`` strings, as for
``dockrl train``), ``worker_backend`` (``local`` or ``kubernetes``), ``namespace`` (workers'
namespace; "" is the launcher's own), ``export_dtype``.
"""

# no `from __future__ import annotations`: kfp reads the pipeline's parameter types at runtime
from pathlib import Path
from typing import List, Union

from kfp import compiler, dsl, kubernetes

from components.evaluate import evaluate
from components.export_model import export_model
from components.prepare_dataset import prepare_dataset
from components.teardown_workers import teardown_workers
from components.train import train
from dockrl.launch.launcher import WORKER_BACKENDS
from dockrl.launch.platform import CPU_IMAGE, OBJECT_STORE_KEYS, Platform, get_platform

PIPELINE_NAME = "dockrl-grpo"
POD_FIELDS_AS_ENV = {"POD_NAME": "metadata.name", "POD_NAMESPACE": "metadata.namespace", "POD_UID": "metadata.uid",
                     "POD_IP": "status.podIP"}


def _configure_launcher(task: dsl.PipelineTask, platform: Platform, accelerators: bool = True) -> None:
    """Put the platform's image, accelerators, scheduling and credentials on the train task
    (with ``accelerators=False``: the CPU image and none of the accelerator scheduling)."""
    task.set_caching_options(False)  # a training run is never served from the cache
    task.set_container_image(platform.image if accelerators else CPU_IMAGE)
    if accelerators and platform.accelerator:
        task.set_accelerator_type(platform.accelerator).set_accelerator_limit(platform.accelerators_per_pod)
    for key, value in platform.node_selector.items() if accelerators else ():
        kubernetes.add_node_selector(task, label_key=key, label_value=value)
    for t in platform.tolerations if accelerators else ():
        kubernetes.add_toleration(task, key=t.key, operator=t.operator, value=t.value or None, effect=t.effect)
    if platform.object_store_secret:
        kubernetes.use_secret_as_env(task, secret_name=platform.object_store_secret,
                                     secret_key_to_env={k: k for k in OBJECT_STORE_KEYS})
    if platform.shared_volume_claim:
        kubernetes.mount_pvc(task, pvc_name=platform.shared_volume_claim, mount_path=platform.shared_mount_path)
    for env, path in POD_FIELDS_AS_ENV.items():
        kubernetes.use_field_path_as_env(task, env_name=env, field_path=path)
    kubernetes.add_pod_label(task, label_key="app.kubernetes.io/part-of", label_value="dockrl")


def build_pipeline(platform: Union[Platform, str] = "npu", worker_backend: str = "local"):
    """The GRPO pipeline for ``platform`` (a preset name or a ``Platform``).

    ``worker_backend`` is the default of the pipeline parameter of that name; ``kubernetes``
    also takes the accelerators off the train task (the stage pods hold them).

    Raises:
        ValueError: unknown platform or worker backend.
    """
    platform = get_platform(platform) if isinstance(platform, str) else platform
    if worker_backend not in WORKER_BACKENDS:
        raise ValueError(f"worker_backend: got {worker_backend!r}; expected one of {', '.join(map(repr, WORKER_BACKENDS))}")
    default_backend = worker_backend

    @dsl.pipeline(name=PIPELINE_NAME, description=f"GRPO post-training through the transfer dock ({platform.name})")
    def grpo(
        config_overrides: List[str] = [],
        worker_backend: str = default_backend,
        namespace: str = "",
        export_dtype: str = "bfloat16",
    ):
        teardown = teardown_workers(run_id=dsl.PIPELINE_JOB_ID_PLACEHOLDER, worker_backend=worker_backend, namespace=namespace)
        teardown.set_caching_options(False)
        kubernetes.use_field_path_as_env(teardown, env_name="POD_NAMESPACE", field_path="metadata.namespace")
        with dsl.ExitHandler(teardown, name="grpo-run"):
            data = prepare_dataset(config_overrides=config_overrides)
            trained = train(config_overrides=config_overrides, dataset=data.outputs["dataset"], worker_backend=worker_backend,
                            run_id=dsl.PIPELINE_JOB_ID_PLACEHOLDER, namespace=namespace, platform=platform.to_json())
            _configure_launcher(trained, platform, accelerators=default_backend == "local")
            exported = export_model(checkpoint=trained.outputs["model"], dtype=export_dtype)
            evaluate(model=exported.outputs["model"], dataset=data.outputs["dataset"], config_overrides=config_overrides)

    return grpo


grpo = build_pipeline("npu")
"""The production pipeline (Ascend NPUs)."""


def compile_pipeline(out: Union[str, Path], platform: str = "npu", worker_backend: str = "local") -> Path:
    """Compile the pipeline IR to ``out`` (``.yaml``); returns the path (see ``build_pipeline``)."""
    out = Path(out)
    if out.suffix not in (".yaml", ".yml", ".json"):
        raise ValueError(f"pipeline package {out}: expected a .yaml or .json file name")
    out.parent.mkdir(parents=True, exist_ok=True)
    compiler.Compiler().compile(build_pipeline(platform, worker_backend), str(out))
    return out


def run_local(overrides: List[str], pipeline_root: Union[str, Path], *, export_dtype: str = "bfloat16") -> Path:
    """Run the whole pipeline on this machine with ``kfp.local`` (tasks as subprocesses).

    Needs no Docker, cluster or network: tasks run in this Python environment one at a time;
    platform settings (accelerators, node selectors, Secrets) are ignored locally.

    Returns:
        The run's folder under ``pipeline_root``: one sub-folder per task with its artifacts
        (``prepare-dataset/dataset``, ``train/model``, ``train/run_dir``, ``export-model/model``)
        and its ``executor_output.json`` (artifact metadata, metrics).

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
    build_pipeline("cpu")(config_overrides=list(overrides), worker_backend="local", export_dtype=export_dtype)
    new = sorted(set(root.glob(f"{PIPELINE_NAME}-*")) - before)
    if len(new) != 1:
        raise RuntimeError(f"expected one new run folder under {root}, found {[p.name for p in new]}")
    return new[0]


def local_summary(run_dir: Union[str, Path]) -> dict:
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
    }
    summary |= {k: train[k] for k in ("eval/accuracy_before", "eval/format_rate_before", "run/seconds") if k in train}
    return summary | task_metadata(run, "evaluate", "metrics")


def task_metadata(run_dir: Union[str, Path], task: str, artifact: str) -> dict:
    """Metadata of output ``artifact`` of ``task`` in a local run folder (metrics for Metrics)."""
    import json

    path = Path(run_dir) / task / "executor_output.json"
    outputs = json.loads(path.read_text()).get("artifacts", {})
    if artifact not in outputs:
        raise KeyError(f"{path}: task {task!r} has no output artifact {artifact!r}; it has {sorted(outputs)}")
    return dict(outputs[artifact]["artifacts"][0].get("metadata", {}))
