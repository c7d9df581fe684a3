"""The pipeline's SFT task: one ``dockrl sft`` run for the sft step (the SFT and alignment pipelines), and the
hand-over of its model to the step after (``start_from_overrides``).

``run_sft_training`` is what the KFP ``sft`` component calls. SFT is one process on one device
(``dockrl/sft/loop.py``): it runs in the task's own pod, which holds the platform's accelerator, with either
worker backend. Its run folder is ``run_dir`` itself, or, where the platform's shared volume is mounted in the
pod, ``<shared_mount_path>/runs/<run_id>-sft/``: there the checkpoints stay, the ``model`` artifact names the
final one (``write_checkpoint_pointer``: no model-sized copy into KFP's artifact store) and the rest of the
folder is copied to ``run_dir``; without the shared volume the final checkpoint moves into the artifact.
The data are the prepared dataset's train and test files (GSM8K rows train on their worked answers; chat rows
too: ``sft.format``). As the train task, it skips the evaluation after training (``trainer.eval_after=false``)
unless the overrides say otherwise: the pipeline's evaluate step measures the exported model.
"""

from __future__ import annotations

import logging
import math
from pathlib import Path
from typing import Callable, Sequence

from dockrl.config import load_config
from dockrl.kubeflow.train_task import MODEL_COPY, fetch_model, hand_over_model, shared_mount
from dockrl.launch.artifacts import dataset_files, resolve_checkpoint
from dockrl.launch.platform import Platform

logger = logging.getLogger(__name__)

SFT_RUN_SUFFIX = "-sft"
"""The SFT run's folder on the shared volume: ``runs/<run_id>-sft`` beside the GRPO run's ``runs/<run_id>``."""


def run_sft_training(
    overrides: Sequence[str],
    dataset_dir: str | Path,
    checkpoint_dir: str | Path,
    run_dir: str | Path,
    *,
    log_metric: Callable[[str, float], None],
    run_id: str = "",
    platform: str | Platform = "cpu",
) -> dict[str, float]:
    """Run SFT on a prepared dataset; the final checkpoint into (or named by) ``checkpoint_dir``, metrics to ``log_metric``.

    Args:
        overrides: the run's ``section.field=value`` config overrides; the data paths and ``run.output_dir``
            are set here and win over any given ones.
        dataset_dir: folder written by ``prepare_dataset``.
        checkpoint_dir: the ``model`` artifact: receives the final HF checkpoint, or names it on the shared volume.
        run_dir: receives the rest of the run folder (config.yaml, metrics.jsonl, tensorboard/, metrics.png, summary.json).
        run_id: the pipeline run's id (names the shared run folder).
        platform: preset name or ``Platform`` of the task's pod (its shared volume).

    Returns:
        The SFT run's summary (``dockrl.sft.sft``), each finite number also given to ``log_metric``.

    Raises:
        ConfigError: an invalid override (the message names the field).
        RuntimeError: SFT finished without a final checkpoint.
    """
    from dockrl.sft import sft  # lazy: torch and transformers, only in the task that trains

    train_file, test_file = dataset_files(dataset_dir)
    run = Path(run_dir)
    out = run
    if run_id and (shared := shared_mount(platform)) is not None:
        out = shared / "runs" / f"{run_id}{SFT_RUN_SUFFIX}"
    model_copy = fetch_model(overrides, out / MODEL_COPY)
    cfg = load_config(None, ["trainer.eval_after=false", *overrides, f"data.train_path={train_file}", f"data.test_path={test_file}",
                             f"run.output_dir={out}", "run.progress=false", *([f"model.path={model_copy}"] if model_copy else [])])
    summary = sft(cfg)
    hand_over_model(out, run, checkpoint_dir, model_copy, "SFT")
    for key, value in summary.items():
        if isinstance(value, (int, float)) and math.isfinite(value):
            log_metric(key, float(value))
    return summary


def start_from_overrides(overrides: Sequence[str], model_dir: str | Path) -> list[str]:
    """``overrides`` with ``model.path`` set to the model a model artifact holds or names (``resolve_checkpoint``):
    how the step after a training step starts from its model. Checked as the command line's overrides are.

    Raises:
        FileNotFoundError: the artifact names a folder this pod cannot see (``resolve_checkpoint``).
        ConfigError: the overrides do not make a valid config.
    """
    out = [*overrides, f"model.path={resolve_checkpoint(model_dir)}"]
    load_config(None, out)
    return out
