"""The launcher: runs one GRPO training job for a pipeline's train step and reports it.

``run_training`` is what the KFP ``train`` component calls. It runs the distributed mode
(``dock.mode=distributed`` unless the overrides say otherwise): the dock shards and every
stage as separate processes started through ``LocalBackend`` (``distributed.py``); the
pipeline's exit handler tears down whatever a run registered with it. The Kubernetes backend
renders and manages worker pods (``kubernetes.py``) but does not host the stages yet: with it
they still start as processes of the launcher's pod.

Per-iteration metrics stream to ``log_metric`` as each iteration ends, as
``<key>/iter_<NNNN>`` (``reward/mean/iter_0003``); run-level numbers
(``eval/accuracy_before``, ``run/seconds``, ...) follow under their own names.
"""

from __future__ import annotations

import logging
import math
import shutil
from pathlib import Path
from typing import Callable, Sequence

from dockrl.config import load_config
from dockrl.launch.tasks import dataset_files

logger = logging.getLogger(__name__)

WORKER_BACKENDS = ("local", "kubernetes")


def _log_finite(log_metric: Callable[[str, float], None], name: str, value: object, skipped: list[str]) -> None:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        skipped.append(name)
        return
    log_metric(name, float(value))


def run_training(
    overrides: Sequence[str],
    dataset_dir: str | Path,
    checkpoint_dir: str | Path,
    run_dir: str | Path,
    *,
    log_metric: Callable[[str, float], None],
    worker_backend: str = "local",
) -> dict[str, float]:
    """Train with GRPO on a prepared dataset; write the final checkpoint and report metrics.

    Args:
        overrides: the run's ``section.field=value`` config overrides; the data paths and
            ``run.output_dir`` are set here and win over any given ones.
        dataset_dir: folder written by ``prepare_dataset``.
        checkpoint_dir: receives the final HF checkpoint (weights, config, tokenizer); must
            not exist or be empty.
        run_dir: receives the rest of the run folder (config.yaml, metrics.jsonl,
            tensorboard/, metrics.png, summary.json, intermediate checkpoints).
        log_metric: called once per (name, value); non-finite values are skipped with a warning.
        worker_backend: ``local`` or ``kubernetes``: where stage workers would be started.

    Returns:
        The run summary (accuracies before/after, seconds).

    Raises:
        ValueError: unknown ``worker_backend``.
        ConfigError: an invalid override (the message names the field).
    """
    from dockrl import trainer

    if worker_backend not in WORKER_BACKENDS:
        raise ValueError(f"worker_backend: got {worker_backend!r}; expected one of {', '.join(map(repr, WORKER_BACKENDS))}")
    if worker_backend != "local":
        logger.warning("worker_backend=%r: the stages still start as processes of the launcher; the backend is used "
                       "for teardown only", worker_backend)
    train_file, test_file = dataset_files(dataset_dir)
    run = Path(run_dir)
    cfg = load_config(None, [
        "dock.mode=distributed", *overrides, f"data.train_path={train_file}", f"data.test_path={test_file}",
        f"run.output_dir={run}", "run.progress=false",
    ])
    skipped: list[str] = []

    def stream(it: int, metrics: dict[str, float]) -> None:
        for key, value in metrics.items():
            _log_finite(log_metric, f"{key}/iter_{it:04d}", value, skipped)

    summary = trainer.train(cfg, on_iteration=stream)

    final = run / "checkpoints" / "final"
    if not (final / "config.json").is_file():
        raise RuntimeError(f"training finished without a final checkpoint in {final}")
    dst = Path(checkpoint_dir)
    if dst.is_dir() and not any(dst.iterdir()):
        dst.rmdir()
    shutil.move(final, dst)  # a move, not a copy: a checkpoint can be many GB

    for key, value in summary.items():
        _log_finite(log_metric, key, value, skipped)
    if skipped:
        logger.warning("%d metric values were null or non-finite and not logged, e.g. %s", len(skipped), skipped[:5])
    return summary
