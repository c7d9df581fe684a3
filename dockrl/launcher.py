"""The launcher: runs one GRPO training job for a pipeline's train step and reports it.

``run_training`` is what the KFP ``train`` component calls. It runs the distributed mode
(``distributed.py``): the dock shards and every stage as separate workers, started through
the worker backend the pipeline names; the pipeline's exit handler tears down whatever a run
registered with it.

* ``local``: processes in the launcher's pod (``dock.mode=distributed`` unless the overrides
  say otherwise), the run folder is ``run_dir`` itself.
* ``kubernetes``: one JobSet per run, a replicated job per dock shard and per stage
  (``KubernetesBackend.from_cluster``; rollout, reference and actor on the platform's
  accelerators, one device per rank process). The pods cannot see the
  launcher's files, so the run folder lives on the platform's shared volume,
  ``<shared_dir>/runs/<run_id>/``: the dataset is copied to its ``data/``, the actor writes
  its checkpoints there, and at the end the final checkpoint moves to ``checkpoint_dir`` and
  the rest of the folder to ``run_dir``. ``model.path`` must be visible in the pods: the
  packaged model (every image holds it), a path on the shared volume, or one baked into the
  image. A ``directory`` warehouse must be on the shared volume. The checkpoints stay there
  (the ``model`` artifact is a pointer to the final one, ``write_checkpoint_pointer``), and so
  does the rest of the folder after the run, failed or not (TensorBoard reads its events there).

Unless the overrides say otherwise, the train step skips the evaluation after training
(``trainer.eval_after=false``): the pipeline's ``evaluate`` step measures the exported model.

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

from dockrl import driver
from dockrl.config import Config, load_config
from dockrl.launch.backend import worker_backend_name
from dockrl.launch.platform import Platform
from dockrl.launch.tasks import dataset_files, write_checkpoint_pointer

logger = logging.getLogger(__name__)


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
    run_id: str = "",
    namespace: str = "",
    platform: str | Platform = "cpu",
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
        worker_backend: ``local`` or ``kubernetes``: where the stage workers start.
        run_id: the pipeline run's id (labels the pods; names the shared run folder); needed
            for ``kubernetes``.
        namespace: the workers' namespace ("" for the launcher pod's own).
        platform: preset name or ``Platform`` of the worker pods (image, accelerators, shared volume).

    Returns:
        The run summary (accuracy before training, seconds; after training too if
        ``trainer.eval_after=true`` is among the overrides).

    Raises:
        ValueError: unknown ``worker_backend``; for ``kubernetes``: no ``run_id``, no shared
            volume, ``dock.mode`` not distributed, a ``directory`` warehouse off the shared volume.
        ConfigError: an invalid override (the message names the field).
        WorkerFailed: a worker died or cannot start (its log tail in the message).
    """
    if worker_backend_name(worker_backend) == "kubernetes" and not run_id:
        raise ValueError("run_training: worker_backend='kubernetes' needs run_id (the pipeline run's id)")
    train_file, test_file = dataset_files(dataset_dir)
    run = Path(run_dir)
    out, backend = run, None
    if worker_backend == "kubernetes":
        from dockrl.launch.kubernetes import KubernetesBackend

        backend = KubernetesBackend.from_cluster(run_id, namespace=namespace, platform=platform)
        out = backend.shared_dir / "runs" / run_id
        train_file, test_file = _copy_into([train_file, test_file], out / "data")
    cfg = load_config(None, [
        # the pipeline's evaluate step measures the exported model: no second evaluation here
        "dock.mode=distributed", "trainer.eval_after=false", *overrides, f"data.train_path={train_file}", f"data.test_path={test_file}",
        f"run.output_dir={out}", "run.progress=false",
    ])
    skipped: list[str] = []

    def stream(it: int, metrics: dict[str, float]) -> None:
        for key, value in metrics.items():
            _log_finite(log_metric, f"{key}/iter_{it:04d}", value, skipped)

    if backend is not None:
        check_shared_config(cfg, backend.shared_dir)
    summary = driver.train(cfg, on_iteration=stream, backend=backend)

    final = out / "checkpoints" / "final"
    if not (final / "config.json").is_file():
        raise RuntimeError(f"training finished without a final checkpoint in {final}")
    dst = Path(checkpoint_dir)
    if out == run:
        if dst.is_dir() and not any(dst.iterdir()):
            dst.rmdir()
        shutil.move(final, dst)  # a move, not a copy: a checkpoint can be many GB
    else:
        # The checkpoints stay on the shared volume (never in this pod's emptyDir): the model
        # artifact names the final one, the run_dir artifact gets the small files (metrics,
        # TensorBoard events, plot, config); the shared folder stays, for TensorBoard and reuse.
        write_checkpoint_pointer(dst, final)
        shutil.rmtree(out / "data", ignore_errors=True)
        shutil.copytree(out, run, ignore=shutil.ignore_patterns("checkpoints"), dirs_exist_ok=True)

    for key, value in summary.items():
        _log_finite(log_metric, key, value, skipped)
    if skipped:
        logger.warning("%d metric values were null or non-finite and not logged, e.g. %s", len(skipped), skipped[:5])
    return summary


def _copy_into(files: Sequence[Path], folder: Path) -> list[Path]:
    """Copy ``files`` into ``folder`` (created); returns the copies' paths."""
    folder.mkdir(parents=True, exist_ok=True)
    return [Path(shutil.copy2(f, folder / f.name)) for f in files]


def _under(path: str | Path, root: Path) -> bool:
    return Path(path).resolve().is_relative_to(root.resolve())


def check_shared_config(cfg: Config, shared: Path) -> None:
    """Check that the stage pods can run ``cfg``: what they read or write must be on ``shared``.

    Raises:
        ValueError: ``dock.mode`` is not ``distributed``; ``run.output_dir`` or a ``directory``
            warehouse (``dock.directory``) is not under ``shared``.
    """
    if cfg.dock.mode != "distributed":
        raise ValueError(f"dock.mode={cfg.dock.mode!r}: the kubernetes worker backend runs the stages as pods; "
                         "use dock.mode=distributed")
    if not _under(cfg.run.output_dir, shared):
        raise ValueError(f"run.output_dir={cfg.run.output_dir!r}: with the kubernetes worker backend the run folder "
                         f"must be on the shared volume (under {shared})")
    if cfg.dock.warehouse == "directory" and not _under(cfg.dock.directory, shared):
        raise ValueError(f"dock.directory={cfg.dock.directory!r}: with the kubernetes worker backend a directory "
                         f"warehouse must be on the shared volume (under {shared}); or use dock.warehouse=s3")
    from dockrl.run_setup import PACKAGED_MODEL

    if cfg.model.path != PACKAGED_MODEL and not _under(cfg.model.path, shared):
        logger.warning("model.path=%r is not on the shared volume (%s): the stage pods must find it in their image",
                       cfg.model.path, shared)
