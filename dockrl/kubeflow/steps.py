"""The work of the short pipeline steps: size the train pod, prepare the data, export the model, evaluate it, tear the workers down.

Each function takes plain paths and the run's ``section.field=value`` overrides, so the KFP
components in ``components/`` stay thin and every step is testable without KFP. Training, the
long step, lives in ``dockrl/kubeflow/train_task.py``.

``teardown_run`` is what the pipeline's exit handler calls: it finds a run's workers from the
run id alone, so it works from a different process than the one that started them.

With the ``kubernetes`` worker backend the evaluate step is a launcher too
(``evaluate_on_cluster``): the greedy evaluation runs in a JobSet of its own, one replicated job
``evaluate`` whose pod holds the rollout's TP' devices (``parallel.infer_tp``) and is rendered
as every worker pod of the run is (``jobset.render_jobset``: the platform's ``host_paths``,
``env``, extra resources, labels, annotations, device group, scheduler and queue), running
``dockrl evaluate`` (``evaluate_main``) on the model and test split on the shared volume.

A dataset folder holds ``train.<ext>``, ``test.<ext>`` and ``dataset.json`` (the file names and
row counts); ``artifacts.dataset_files`` reads it back.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import logging
import math
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any, Mapping, Sequence

import yaml

from dockrl.config import Config, ConfigError, dump_config, load_config, resolve_auto
from dockrl.launch.artifacts import (
    DATASET_MANIFEST,
    dataset_files,
    fetch_s3,
    is_s3,
    model_location,
    resolve_checkpoint,
    resolve_model,
    upload_s3,
    write_checkpoint_pointer,
)
from dockrl.launch.backend import WorkerGroup, worker_backend_name
from dockrl.launch.jobset import JOBSET_GROUP, JOBSET_PLURAL, JOBSET_VERSION
from dockrl.launch.kubernetes import KubernetesBackend
from dockrl.launch.kubernetes_watch import get_field
from dockrl.launch.local import LocalBackend
from dockrl.launch.platform import Platform
from dockrl.process.vllm_support import vllm_support
from dockrl.run.data import check_data_file, load_prompts

if TYPE_CHECKING:
    from dockrl.engines.rollout_engine import RolloutEngine

logger = logging.getLogger(__name__)

TEARDOWN_WAIT_S = 90.0
"""How long the exit handler waits for a Kubernetes run's pods to be gone (their grace period is 30 s)."""
EVALUATE_GROUP = "evaluate"
"""The worker group (replicated job) of the evaluate step with the ``kubernetes`` backend."""
EVALUATE_RESULT = "metrics.json"
"""What ``dockrl evaluate --out`` writes: the step's metrics as JSON."""


def _count_rows(path: Path) -> int:
    if path.suffix == ".parquet":
        import pyarrow.parquet as pq  # lazy: only a parquet dataset needs pyarrow; teardown_run stays light

        return pq.ParquetFile(path).metadata.num_rows
    with path.open("rb") as f:  # bytes: a line that is not UTF-8 is counted as the loader reports it, one bad line
        return sum(1 for line in f if line.strip())


def prepare_dataset(overrides: Sequence[str], out_dir: str | Path) -> dict[str, int | str]:
    """Write the run's train and test prompt files into ``out_dir``.

    The files are the configured ones (``data.train_path``, ``data.test_path``, ``champ``) or
    the seeded generated problems, exactly as ``dockrl train`` would use them. A configured file
    is a path this task's pod sees (on the shared volume, which the pipeline mounts here) or an
    ``s3://`` URI, fetched with the ``dock`` section's S3 settings (``artifacts.fetch_s3``).

    Returns:
        Metadata for the Dataset artifact: file names, row counts, seed.

    Raises:
        ConfigError: an override is invalid, or a configured data file does not exist in this pod or is not a
            data file (the message names the field).
        FileNotFoundError: a configured ``s3://`` data file is not in the object store.
    """
    from dockrl.run.setup import resolve_data  # lazy: dockrl.run.setup imports torch

    cfg = load_config(None, overrides)
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix="dockrl-data-") as tmp:
        # generated files go to a scratch cache; configured files are read where they are, s3:// ones fetched there
        fetched: dict[str, Any] = {f: str(fetch_s3(getattr(cfg.data, f), Path(tmp) / "s3" / f, cfg.dock))
                   for f in ("train_path", "test_path") if is_s3(getattr(cfg.data, f))}
        cfg = dataclasses.replace(cfg, run=dataclasses.replace(cfg.run, cache_dir=tmp), data=dataclasses.replace(cfg.data, **fetched))
        train_src, test_src = resolve_data(cfg)  # a configured file that is not there fails here, naming its field
        train_dst, test_dst = out / f"train{train_src.suffix}", out / f"test{test_src.suffix}"
        shutil.copyfile(train_src, train_dst)
        shutil.copyfile(test_src, test_dst)
    info: dict[str, int | str] = {
        "train": train_dst.name, "test": test_dst.name,
        "train_rows": _count_rows(train_dst), "test_rows": _count_rows(test_dst), "seed": cfg.trainer.seed,
    }
    (out / DATASET_MANIFEST).write_text(json.dumps(info, indent=2) + "\n")
    logger.info("dataset in %s: %d train rows, %d test rows", out, info["train_rows"], info["test_rows"])
    return info


def export_model(checkpoint_dir: str | Path, out_dir: str | Path, dtype: str = "bfloat16", merge: bool = True) -> dict[str, int | str]:
    """Re-save an HF checkpoint as a self-contained safetensors folder in ``dtype``.

    The folder holds ``config.json``, ``generation_config.json``, ``model.safetensors`` and the
    tokenizer files, loadable with ``AutoModelForCausalLM.from_pretrained`` (and by vLLM). The
    checkpoint of a LoRA run (``trainer.lora``) also gives its adapter folder, copied to ``OUT/adapter``
    (peft's format, fp32: ``PeftModel.from_pretrained(base, OUT/adapter)`` over the run's
    ``model.path``); its weights are the merged policy W + (alpha / rank)·B·A, and ``merge=False``
    leaves them out (the adapter and the tokenizer only).

    Returns:
        Metadata for the Model artifact: format, dtype, architecture, parameter count (merged weights),
        and with an adapter ``adapter`` (its folder's name) and ``adapter_parameters``.

    Raises:
        ValueError: ``dtype`` is not ``float32``, ``bfloat16`` or ``float16``, or ``merge=False`` for a
            checkpoint without an adapter.
        FileNotFoundError: ``checkpoint_dir`` has no ``config.json``.
    """
    import torch  # lazy: torch and transformers take seconds to import; only this step needs them
    from transformers import AutoModelForCausalLM, AutoTokenizer  # lazy: as torch

    dtypes = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
    if dtype not in dtypes:
        raise ValueError(f"export dtype: got {dtype!r}; expected one of {', '.join(repr(d) for d in dtypes)}")
    src, out = resolve_checkpoint(checkpoint_dir), Path(out_dir)
    if not (src / "config.json").is_file():
        raise FileNotFoundError(f"{src / 'config.json'} does not exist: {src} is not an HF checkpoint")
    adapter = src / "adapter"  # hf_lora.ADAPTER_DIR (not imported: it loads peft)
    if not merge and not (adapter / "adapter_config.json").is_file():
        raise ValueError(f"export without --merge: {src} holds no LoRA adapter ({adapter.name}/); only a trainer.lora run's "
                         "checkpoint has one (export its full weights with --merge)")
    out.mkdir(parents=True, exist_ok=True)
    AutoTokenizer.from_pretrained(src).save_pretrained(out)
    extra: dict[str, int | str] = {}
    if adapter.is_dir():
        shutil.copytree(adapter, out / adapter.name, dirs_exist_ok=True)
        from safetensors import safe_open  # lazy: as torch

        with safe_open(str(adapter / "adapter_model.safetensors"), "pt") as f:
            extra = {"adapter": adapter.name, "adapter_parameters": sum(math.prod(f.get_slice(k).get_shape()) for k in f.keys())}
    if not merge:
        logger.info("exported the LoRA adapter of %s (%s parameters) to %s", src, extra["adapter_parameters"], out / adapter.name)
        return {"format": "peft-adapter", "framework": "peft", "dtype": "float32", **extra}
    model = AutoModelForCausalLM.from_pretrained(src, dtype=dtypes[dtype])
    model.save_pretrained(out, safe_serialization=True)
    info: dict[str, int | str] = {
        "format": "safetensors", "framework": "transformers", "dtype": dtype,
        "architecture": model.config.architectures[0] if model.config.architectures else type(model).__name__,
        "parameters": sum(p.numel() for p in model.parameters()), **extra,
    }
    logger.info("exported %s (%s, %d parameters) to %s", src, dtype, info["parameters"], out)
    return info


EXPORT_DIR = "export"
"""In a run folder on the shared volume: the exported model a pipeline run's ``model`` artifact names."""


def export_model_artifact(checkpoint: str | Path, artifact_dir: str | Path, dtype: str = "bfloat16", *,
                          copy: bool = False, uri: str = "", overrides: Sequence[str] = ()) -> dict[str, int | str]:
    """The pipeline's export step: export the train task's ``checkpoint`` artifact into the run folder
    (``<run>/export``, beside ``checkpoints/final`` on the shared volume), or to ``uri`` (``s3://<bucket>/<key>``
    in the store of the run's ``dock`` section, ``overrides``), and make ``artifact_dir`` name it
    (``write_checkpoint_pointer``): the weights never go through KFP's artifact store. With ``copy``, or
    where the checkpoint artifact holds the checkpoint itself (no shared volume), the export goes into
    ``artifact_dir`` (a model-sized upload to the artifact store).

    Returns:
        ``export_model``'s metadata, with where the model is (``path``: a folder or ``uri``), ``pointer`` and
        ``bytes`` (``model_location``).

    Raises:
        ValueError: both ``copy`` and ``uri``; as ``export_model``.
        ConfigError: an invalid override; with ``uri``, no S3 endpoint (naming ``dock.endpoint``).
    """
    src = resolve_checkpoint(checkpoint)
    out = Path(artifact_dir)
    if uri:
        if copy:
            raise ValueError(f"export to {uri} and a copy in the artifact store: choose one (copy_model or export_uri)")
        dock = load_config(None, overrides).dock
        with tempfile.TemporaryDirectory(prefix="dockrl-export-") as tmp:
            info = export_model(src, tmp, dtype)
            size = sum(p.stat().st_size for p in Path(tmp).rglob("*") if p.is_file())
            upload_s3(tmp, uri, dock)
        write_checkpoint_pointer(out, uri)
        logger.info("exported model uploaded to %s (%d bytes)", uri, size)
        return info | {"path": uri, "pointer": True, "bytes": size}
    where = out if copy or src == Path(checkpoint) else src.parent.parent / EXPORT_DIR
    if where.exists() and where != out:  # a retried step: the earlier attempt's export, maybe cut short
        shutil.rmtree(where)
    info = export_model(src, where, dtype)
    if where != out:
        write_checkpoint_pointer(out, where)
    return info | model_location(out)


def evaluation_engine(cfg: Config, model_dir: Path) -> RolloutEngine:
    """The evaluate step's engine on this process's device (``parallel.device``, which
    ``evaluate_model`` sets to where the pipeline placed the step; ``cfg`` as ``resolve_auto`` returns it): ``VLLMRolloutEngine`` where
    the resolved ``rollout.engine`` is ``vllm`` and vLLM runs on that device (``vllm_support``),
    else ``HFRolloutEngine`` (with a warning when the config asked for vLLM); ``rollout.dtype`` weights. Built by the
    rollout stage's factory (``dockrl.engines.factory.ROLLOUT_ENGINES``), without LoRA and with vLLM's default KV cache.

    Raises:
        RuntimeError: no device of ``parallel.device`` is visible (``torch_device``).
    """
    from dockrl.engines.factory import ROLLOUT_ENGINES  # lazy: imports torch and transformers
    from dockrl.parallel.device import torch_device  # lazy: dockrl.parallel.device imports torch

    r, kind = cfg.rollout, cfg.parallel.device
    device = torch_device(kind)  # one device: the step's pod holds one accelerator, or none
    name = r.engine
    if name == "vllm" and not (support := vllm_support(kind)).ok:
        logger.warning("evaluate: rollout.engine=vllm cannot run here (%s); evaluating with HF on %s", support.reason, device)
        name = "hf"
    return ROLLOUT_ENGINES[name](cfg, model_dir, device, seed=cfg.trainer.seed, lora=None, sized=False)


def evaluation_file(dataset: str | Path | None, cfg: Config, scratch: str | Path) -> Path:
    """The test file ``evaluate_model`` reads: ``dataset`` is a dataset folder (``prepare_dataset``'s:
    its test split), a data file (``.jsonl``, ``.parquet``), or None: the run's own test data as
    ``dockrl train`` takes it (``data.test_path``, ``champ``, an ``s3://`` URI fetched into ``scratch``,
    or the seeded generated test problems, in ``run.cache_dir``).

    Raises:
        FileNotFoundError: ``dataset`` does not exist, or is a folder without ``dataset.json``.
        ConfigError: ``dataset`` (or ``data.test_path``) is not a data file ``load_prompts`` reads.
    """
    from dockrl.run.setup import resolve_data  # lazy: dockrl.run.setup imports torch

    if dataset is None:
        if is_s3(cfg.data.test_path):
            fetched = str(fetch_s3(cfg.data.test_path, Path(scratch) / "s3" / "test_path", cfg.dock))
            cfg = dataclasses.replace(cfg, data=dataclasses.replace(cfg.data, test_path=fetched))
        return resolve_data(cfg)[1]
    path = Path(dataset)
    if path.is_dir() and not (path / DATASET_MANIFEST).is_file():
        raise FileNotFoundError(f"DATASET {path}: a folder without {DATASET_MANIFEST}; expected a folder written by prepare-dataset, "
                                "a .jsonl or .parquet test file, or none: the run's data.test_path (or its generated test problems)")
    if path.is_dir():
        return dataset_files(path)[1]
    try:
        return check_data_file(path)
    except ValueError as e:  # a directory, another extension: the user's input
        raise ConfigError(f"DATASET: {e}") from None


def evaluate_model(model_dir: str | Path, dataset_dir: str | Path | None, overrides: Sequence[str], *,
                   device: str = "cpu") -> dict[str, float]:
    """Greedy accuracy of ``model_dir`` (a model folder, or an artifact naming one: ``artifacts.resolve_model``)
    on the test data ``dataset_dir`` names (``evaluation_file``: a dataset folder's test split, a data file, or
    None for the run's own ``data.test_path``).

    Prompt formatting, ``data.eval_size``, the response length, the rollout engine and dtype
    (``rollout.engine=auto``: vLLM where it runs on ``device``, else HF) and the reward settings
    come from the run's config (``overrides``), as in ``dockrl train``; with an environment
    (``env.name``) the prompts show its tools and greedy multi-turn trajectories are scored
    (``dockrl.stages.evaluate.multi_turn_accuracy``).

    Args:
        device: the device kind to evaluate on, whatever ``parallel.device`` the training used:
            ``cpu``, or ``auto`` (the accelerator this process sees) where the pipeline gave the
            step one; the config's ``auto`` dtype and engine resolve for it.

    Returns:
        ``eval/accuracy``, ``eval/format_rate`` (fractions in [0, 1]) and ``eval/count``.

    Raises:
        ConfigError: an invalid override or ``device``, or test data that is not a data file.
        RuntimeError: ``device`` is an accelerator kind that this process does not see.
        FileNotFoundError: the model the artifact names is not there (the volume not mounted, nothing at the URI),
            or the test data (``evaluation_file``).
    """
    cfg = resolve_auto(load_config(None, [*overrides, f"parallel.device={device}"]))  # dtype and engine for this step's device
    with tempfile.TemporaryDirectory(prefix="dockrl-eval-model-") as scratch:
        test_file = evaluation_file(dataset_dir, cfg, scratch)
        # the export step's artifact names the model: on the shared volume, or in the object store (fetched here)
        return _evaluate(cfg, resolve_model(model_dir, cfg.dock, scratch), test_file)


def _evaluate(cfg: Config, model_dir: Path, test_file: Path) -> dict[str, float]:
    """``evaluate_model`` on the model folder ``model_dir``."""
    from dockrl.envs.prompting import tool_prompt  # lazy: as dockrl.stages.evaluate below
    from dockrl.envs.registry import build_environment  # lazy: as dockrl.stages.evaluate below
    from dockrl.rewards import RewardScorer  # lazy: the math verifier imports sympy (half a second)
    from dockrl.stages.evaluate import greedy_accuracy, multi_turn_accuracy  # lazy: imports torch and transformers
    from dockrl.stages.multi_turn import TurnLimits  # lazy: as dockrl.stages.evaluate above

    engine = evaluation_engine(cfg, model_dir)
    environment = build_environment(cfg)  # with one, the trajectories of the rollout's loop are evaluated
    shown = tool_prompt(engine.tokenizer, environment.tools if environment else [], cfg.env.tool_parser,
                        system_prompt=cfg.data.system_prompt, chat_template=cfg.data.chat_template)
    prompts, report = load_prompts(
        test_file, engine.tokenizer, system_prompt=shown.system_prompt, max_prompt_length=cfg.data.max_prompt_length,
        chat_template=cfg.data.chat_template, model=str(model_dir), tools=shown.tools,
    )
    if report.bad:
        logger.warning("%s", report.summary())
    if cfg.data.eval_size:
        prompts = prompts[: cfg.data.eval_size]
    a, r = cfg.algorithm, cfg.rollout
    scorer = RewardScorer(timeout_s=a.reward_timeout_s, correct_reward=a.correct_reward, format_reward=a.format_reward)
    try:
        if environment is None:
            res = greedy_accuracy(engine, prompts, scorer, correct_reward=a.correct_reward,
                                  max_new_tokens=r.max_response_length, batch_size=cfg.trainer.eval_batch_size)
        else:
            limits = TurnLimits(max_turns=r.max_turns, max_turn_tokens=r.max_response_length, max_total_tokens=r.max_total_tokens)
            res = multi_turn_accuracy(engine, prompts, scorer, environment, limits, correct_reward=a.correct_reward,
                                      batch_size=cfg.trainer.eval_batch_size)
    finally:
        scorer.close()
        if environment is not None:
            environment.close()
        if (close := getattr(engine, "close", None)) is not None:  # vLLM's engine holds its parallel state
            close()
    logger.info("greedy test accuracy %.3f (format %.3f, %d prompts, %s)", res["accuracy"], res["format_rate"], res["count"],
                type(engine).__name__)
    return {"eval/accuracy": res["accuracy"], "eval/format_rate": res["format_rate"], "eval/count": float(res["count"])}


def evaluate_main(argv: list[str] | None = None) -> int:
    """``dockrl evaluate --out metrics.json MODEL [DATASET] [overrides]``: ``evaluate_model``, its
    metrics written as JSON (the command of the evaluate step's pod). Options and overrides go in any order."""
    parser = argparse.ArgumentParser(prog="dockrl evaluate", description="greedy accuracy of a model on test data, written as "
                                     "JSON: a dataset folder's test split (prepare-dataset's), a .jsonl or .parquet file, or "
                                     "without DATASET the run's own test data as dockrl train takes it (data.test_path, or the "
                                     "seeded generated test problems)")
    parser.add_argument("model", help="an HF model folder, or a model artifact naming one (dockrl-checkpoint.json)")
    parser.add_argument("dataset", nargs="?", help="a dataset folder written by prepare-dataset, or a .jsonl/.parquet test file "
                        "(default: the run's data.test_path)")
    parser.add_argument("--out", required=True, help="the metrics' JSON file (written whole, or not at all)")
    parser.add_argument("--device", default="auto", help="cpu, or auto: the accelerator this process sees (default auto)")
    parser.add_argument("overrides", nargs="*", help="the run's section.field=value overrides, e.g. data.test_path=test.jsonl")
    args = parser.parse_intermixed_args(argv)
    if args.dataset is not None and "=" in args.dataset and not Path(args.dataset).exists():  # no DATASET: the first override
        args.overrides.insert(0, args.dataset)
        args.dataset = None
    logging.basicConfig(level=logging.INFO, stream=sys.stderr, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        metrics = evaluate_model(args.model, args.dataset, args.overrides, device=args.device)
    except (ConfigError, FileNotFoundError) as err:  # a user's input: one line, exit 2
        parser.error(str(err))
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    part = out.with_name(out.name + ".part")
    part.write_text(json.dumps(metrics) + "\n")
    os.replace(part, out)  # the launcher sees the whole file or none
    return 0


def evaluate_run_id(run_id: str) -> str:
    """The run id (label ``dockrl.io/run``) of a run's evaluate JobSet: its own objects beside the training's."""
    return f"{run_id}-{EVALUATE_GROUP}"


def evaluate_group(model_dir: Path, dataset_dir: Path, result: Path, overrides: Sequence[str], cfg: Config) -> WorkerGroup:
    """The evaluate step's worker group: one member holding the rollout's TP' devices
    (``parallel.infer_tp``) that runs ``dockrl evaluate`` on the shared volume's model and test split."""
    command = ("evaluate", "--out", str(result), "--device", "auto", str(model_dir), str(dataset_dir), *overrides)
    return WorkerGroup(name=EVALUATE_GROUP, command=command, devices=cfg.parallel.infer_tp, memory="16Gi")


def evaluate_on_cluster(model_dir: str | Path, dataset_dir: str | Path, overrides: Sequence[str], *, run_id: str,
                        backend: KubernetesBackend, poll_s: float = 5.0) -> dict[str, float]:
    """``evaluate_model`` in a worker group of the run (the module docstring), for the evaluate
    step with the ``kubernetes`` backend; ``backend`` is that of ``evaluate_run_id(run_id)``.

    The model is evaluated where it lies when it is on the shared volume (a checkpoint pointer,
    or a model folder there); one in the object store (``s3://``) is fetched to the volume; any
    other is copied to ``<shared>/runs/<run_id>/evaluate/model`` first (logged with its size). The
    dataset folder is copied beside it. Objects a failed attempt of the step left are torn down
    first, and the step's own at the end, however it ends.

    Returns:
        The metrics of ``evaluate_model``.

    Raises:
        WorkerFailed: the evaluate pod failed or cannot start (``KubernetesBackend.check``).
        RuntimeError: its JobSet completed without writing the metrics.
        TimeoutError: no metrics after the backend's start timeout plus ``Platform.worker_deadline_s``.
    """
    cfg = load_config(None, list(overrides))
    shared = backend.shared_dir
    folder = shared / "runs" / run_id / EVALUATE_GROUP
    model = resolve_model(model_dir, cfg.dock, folder / "fetched")  # one in the object store: fetched onto the volume
    if not model.resolve().is_relative_to(shared.resolve()):
        size = sum(f.stat().st_size for f in model.rglob("*") if f.is_file())
        logger.warning("evaluate: the model %s is not on the shared volume: copying it (%.2f GB) to %s", model, size / 1e9,
                       folder / "model")
        model = Path(shutil.copytree(model, folder / "model", dirs_exist_ok=True))
    dataset = Path(shutil.copytree(dataset_dir, folder / "dataset", dirs_exist_ok=True))
    result = folder / EVALUATE_RESULT
    result.unlink(missing_ok=True)  # a failed attempt's
    if backend.remains():
        backend.teardown()
    try:
        backend.start([evaluate_group(model, dataset, result, overrides, cfg)])
        limit = backend.start_timeout_s + backend.platform.worker_deadline_s
        deadline = time.monotonic() + limit
        while not result.is_file():
            backend.check()
            jobset = backend.custom.get_namespaced_custom_object(JOBSET_GROUP, JOBSET_VERSION, backend.namespace, JOBSET_PLURAL,
                                                                 backend.name)
            if get_field(jobset, "status", "terminalState") == "Completed" and not result.is_file():
                raise RuntimeError(f"evaluate: JobSet {backend.namespace}/{backend.name} completed without writing {result}; "
                                   f"its log: {backend.logs}")
            if time.monotonic() > deadline:
                raise TimeoutError(f"evaluate: no metrics in {result} after {limit:.0f} s; its log: {backend.logs}")
            time.sleep(poll_s)
    finally:
        backend.teardown()
    metrics = json.loads(result.read_text())
    logger.info("evaluate on the cluster: %s", metrics)
    return metrics


# ---- the pipeline's run-time parameters ----

RUN_PARAMETERS: dict[str, str] = {
    "iterations": "trainer.iterations",
    "global_batch": "trainer.global_batch",
    "mini_batch": "trainer.mini_batch",
    "group_size": "rollout.n",
    "learning_rate": "trainer.lr",
    "kl_loss_coef": "algorithm.kl_loss_coef",
    "max_response_length": "rollout.max_response_length",
    "adv_estimator": "algorithm.adv_estimator",
    "model_path": "model.path",
    "train_data": "data.train_path",
    "test_data": "data.test_path",
    "keep_checkpoints": "trainer.keep_checkpoints",
}
"""The knobs a user changes per run in the Kubeflow UI: pipeline parameter -> config field.
Everything else is a ``config_overrides`` entry (run-time) or a setting of the compiled package
(backend, platform, images, sizes: compile-time)."""

PIPELINE_DEFAULTS: dict[str, Any] = {"keep_checkpoints": 2}
"""Run parameters whose pipeline default is not the config's: a pipeline run keeps the newest 2
checkpoints and the final one (``trainer.keep_checkpoints``; the config's 0 keeps all), so that a
long run does not fill the shared volume (docs/kubeflow.md sizes it)."""


def config_defaults() -> dict[str, Any]:
    """Each run parameter's config default: the value of its field when no override sets it."""
    cfg = load_config(None)
    out: dict[str, Any] = {}
    for name, where in RUN_PARAMETERS.items():
        section, key = where.split(".")
        out[name] = getattr(getattr(cfg, section), key)
    return out


def run_parameter_defaults() -> dict[str, Any]:
    """Each run parameter's default (what the UI shows): its config default, or ``PIPELINE_DEFAULTS``'."""
    return config_defaults() | PIPELINE_DEFAULTS


def resolve_overrides(params: Mapping[str, object], overrides: Sequence[str]) -> list[str]:
    """The run's ``section.field=value`` overrides: the run parameters that differ from their
    config defaults (``config_defaults``: a pipeline default of its own, ``PIPELINE_DEFAULTS``, is one),
    then ``overrides`` (which win over a parameter setting the same field).

    Raises:
        ValueError: a name in ``params`` is not a run parameter.
        ConfigError: the resulting config is invalid (the message names the field).
    """
    unknown = sorted(set(params) - set(RUN_PARAMETERS))
    if unknown:
        raise ValueError(f"run parameters {unknown}: expected some of {', '.join(RUN_PARAMETERS)}")
    defaults = config_defaults()
    out = [f"{RUN_PARAMETERS[name]}={value}" for name, value in params.items() if value != defaults[name]]
    explicit = {o.split("=", 1)[0].strip() for o in overrides}
    for name, value in params.items():
        if value != defaults[name] and RUN_PARAMETERS[name] in explicit:
            logger.warning("run parameter %s=%r is overridden by config_overrides (%s=...)", name, value, RUN_PARAMETERS[name])
    out += list(overrides)
    load_config(None, out)  # fail here, naming the field, before the dataset or training starts
    return out


def local_run_devices(cfg: Config, platform: Platform) -> int:
    """Accelerators the processes of a ``worker_backend=local`` run use, all in the train task's pod.

    0 where they compute on the CPU: a platform without accelerators, or ``parallel.device=cpu``;
    with ``trainer.hybrid``, ``parallel.world_size`` (tp × pp × dp ranks, one device each); else
    1: every other stage process (actor, rollout, reference, reward model) uses device 0 of the pod.
    ``parallel.device=auto`` counts as the platform's accelerator, also where ``cfg`` was loaded on
    a CPU (the pipeline's resolve-config step), which resolved it to ``cpu``.
    """
    requested = yaml.safe_load(dump_config(cfg, portable=True))["parallel"]["device"]  # "auto" as written
    if not platform.accelerator or requested == "cpu":
        return 0
    return cfg.parallel.world_size if cfg.trainer.hybrid else 1


def local_run_resources(overrides: Sequence[str], platform: Platform) -> dict[str, str]:
    """Requests of a train pod that runs every stage of the run (``worker_backend=local``) on
    ``platform``: ``devices`` (``local_run_devices``), ``cpu`` and ``memory`` of a pod holding
    that many (``Platform.pod_requests``, at least one device's worth), as Kubernetes quantities.

    Raises:
        ConfigError: an invalid override (the message names the field).
    """
    devices = local_run_devices(load_config(None, overrides), platform)
    size = platform.pod_requests(devices)
    logger.info("train pod of a local run on %s: %d device(s), cpu %s, memory %s", platform.name, devices, size["cpu"], size["memory"])
    return {"devices": str(devices), "cpu": size["cpu"], "memory": size["memory"]}


def teardown_run(backend: str, run_id: str, *, namespace: str = "", state_dir: str = "") -> int:
    """Tear down every worker registered for ``run_id``; returns how many objects were removed.

    Args:
        backend: a worker backend name (``local`` or ``kubernetes``).
        run_id: the pipeline run's id (the value the launcher labelled its workers with).
        namespace: Kubernetes namespace ("" for the pod's own namespace).
        state_dir: local backend's state folder ("" for the default).

    Raises:
        ValueError: unknown backend or empty run id.
    """
    name = worker_backend_name(backend, "teardown: backend")
    if not run_id:
        raise ValueError("teardown: run_id is empty; pass the pipeline run's id")
    if name == "local":
        return LocalBackend(run_id, state_dir=state_dir or None).teardown()
    # the exit handler waits for the pods to be gone: a run ends with its workers, the evaluate step's too
    return sum(KubernetesBackend.from_cluster(rid, namespace=namespace, teardown_wait_s=TEARDOWN_WAIT_S).teardown()
               for rid in (run_id, evaluate_run_id(run_id)))
