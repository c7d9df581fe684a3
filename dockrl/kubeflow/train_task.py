"""The pipeline's train task: runs one GRPO training job for the train step and reports it.

``run_training`` is what the KFP ``train`` component calls. It runs the distributed mode
(``distributed.py``): the dock shards and every stage as separate workers, started through
the worker backend the pipeline names; the pipeline's exit handler tears down whatever a run
registered with it.

* ``local``: processes in the launcher's pod (``dock.mode=distributed`` unless the overrides
  say otherwise). The run folder is ``run_dir`` itself, or, where the platform's shared volume
  is mounted in the pod (``Platform.shared_volume_claim`` and ``shared_mount_path`` exists),
  ``<shared_mount_path>/runs/<run_id>/``, which outlives the pod: at the end ``checkpoint_dir``
  names the final checkpoint there (``write_checkpoint_pointer``) and the rest of the folder is
  copied to ``run_dir``. Without the shared volume the final checkpoint moves into ``checkpoint_dir``.
* ``kubernetes``: one JobSet per run, a replicated job for the dock shards (one pod each) and per stage
  (``KubernetesBackend.from_cluster``; rollout, reference and actor on the platform's
  accelerators, one device per rank process). The pods cannot see the
  launcher's files, so the run folder lives on the platform's shared volume,
  ``<shared_dir>/runs/<run_id>/``: the dataset is copied to its ``data/``, the actor writes
  its checkpoints there, and at the end ``checkpoint_dir`` names the final checkpoint and the
  rest of the folder is copied to ``run_dir``. ``model.path`` must be visible in the pods: the
  packaged model (every image holds it), a path on the shared volume, or one baked into the
  image. A ``directory`` warehouse must be on the shared volume. The checkpoints stay there
  (the ``model`` artifact is a pointer to the final one, ``write_checkpoint_pointer``), and so
  does the rest of the folder after the run, failed or not (TensorBoard reads its events there).

A retried train task (KFP's retry policy, or a retry of the run) finds its run folder on the
shared volume again, keyed by the same run id (``prepare_retry``): with a complete checkpoint it
continues with ``run.resume=latest`` (a ``run.resume`` among the overrides wins), without one
the failed attempt's folder is set aside as ``<run_id>.attempt-<n>`` and the run starts fresh.
With ``kubernetes`` the failed attempt's JobSet is torn down first, and gone, before anything
else (``clear_failed_attempt``): its launcher died before its own teardown, and Argo does not
reliably run the exit handler before a retry. Both live in ``dockrl.kubeflow.train_retry``.

A preemption is a pause, not a failure: when Kueue suspends the run's JobSet (its pods go away),
the backend says so (``KubernetesBackend.preempted``) whatever error the driver met first, and the
launcher goes on in the same way as a retry, in the same process: the JobSet torn down and gone,
the run resumed from its newest complete checkpoint (dock snapshot, weights, optimizer, data
position: docs/resume.md) in a new JobSet, which Kueue queues until it admits the run again.

Unless the overrides say otherwise, the train step skips the evaluation after training
(``trainer.eval_after=false``): the pipeline's ``evaluate`` step measures the exported model.

At the end the run's summary goes to ``log_metric``, once per number (``dockrl.run.metrics.run_summary``:
final and best reward and accuracy, KL, tokens/s, the wall time, ...; from the run folder's
``metrics.jsonl``, which holds every iteration once, those of a failed attempt a retry resumed from
included). Every iteration's metrics stay in ``metrics.jsonl`` and TensorBoard (the ``run_dir`` artifact).
"""

from __future__ import annotations

import json
import logging
import shutil
from pathlib import Path
from typing import Callable, Sequence

from dockrl import driver
from dockrl.checkpoint.resume import FINAL_DIR, checkpoint_resumes_at
from dockrl.config import Config, load_config
from dockrl.kubeflow.train_retry import clear_failed_attempt, prepare_retry
from dockrl.launch.artifacts import dataset_files, fetch_s3, is_s3, place_rollouts, write_checkpoint_pointer
from dockrl.launch.backend import WorkersSuspended, worker_backend_name
from dockrl.launch.kubernetes import KubernetesBackend
from dockrl.launch.platform import Platform, get_platform
from dockrl.rollouts.keep import ROLLOUTS_DIR
from dockrl.run.metrics import run_summary
from dockrl.run.setup import PACKAGED_MODEL

logger = logging.getLogger(__name__)


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
    rollouts_dir: str | Path | None = None,
) -> dict[str, float]:
    """Train with GRPO on a prepared dataset; write the final checkpoint and report metrics.

    Args:
        overrides: the run's ``section.field=value`` config overrides; the data paths and
            ``run.output_dir`` are set here and win over any given ones.
        dataset_dir: folder written by ``prepare_dataset``.
        checkpoint_dir: receives the final HF checkpoint (weights, config, tokenizer); must
            not exist or be empty.
        run_dir: receives the rest of the run folder (config.yaml, metrics.jsonl,
            tensorboard/, metrics.png, summary.json; the intermediate checkpoints unless the
            run folder is on the shared volume, where they stay).
        log_metric: called once per number of the run's summary (``run_summary``: finite values only), at the end.
        worker_backend: ``local`` or ``kubernetes``: where the stage workers start.
        run_id: the pipeline run's id (labels the pods; names the shared run folder); needed
            for ``kubernetes``.
        namespace: the workers' namespace ("" for the launcher pod's own).
        platform: preset name or ``Platform`` of the worker pods (image, accelerators, shared volume).
        rollouts_dir: receives the kept rollouts (``run.keep_rollouts``: the run folder's ``rollouts/``, then
            not in ``run_dir``) with the run's config and tokenizer (``place_rollouts``); empty when the run
            kept none. None: they stay in the run folder.

    Returns:
        The run summary (accuracy before training, seconds; after training too if
        ``trainer.eval_after=true`` is among the overrides).

    Raises:
        ValueError: unknown ``worker_backend``; for ``kubernetes``: no ``run_id``, no shared
            volume, ``dock.mode`` not distributed, a ``directory`` warehouse off the shared volume.
        ConfigError: an invalid override (the message names the field).
        WorkerFailed: a worker died or cannot start (its log tail in the message); not for a
            preemption (``WorkersSuspended``), after which the run resumes.
        RuntimeError: for ``kubernetes``, a failed attempt's objects of the same run id are not
            gone in time (``clear_failed_attempt``, names them).
    """
    if worker_backend_name(worker_backend) == "kubernetes" and not run_id:
        raise ValueError("run_training: worker_backend='kubernetes' needs run_id (the pipeline run's id)")
    train_file, test_file = dataset_files(dataset_dir)
    run = Path(run_dir)
    out, backend = run, None
    if worker_backend == "kubernetes":
        backend = KubernetesBackend.from_cluster(run_id, namespace=namespace, platform=platform)
        clear_failed_attempt(backend)  # before the run folder is looked at: its pods may still write there
        out = backend.shared_dir / "runs" / run_id
    elif run_id and (shared := shared_mount(platform)) is not None:
        out = shared / "runs" / run_id
    resume_given = any(o.split("=", 1)[0].strip() == "run.resume" for o in overrides)
    lock_wait_s = load_config(None, list(overrides)).run.lock_wait_s
    paused: WorkersSuspended | None = None
    while True:  # once, or again after each preemption of the workers (a pause: the run resumes)
        found = prepare_retry(out, run_id, resume_given=resume_given and paused is None, lock_wait_s=lock_wait_s) if out != run else None
        model_copy = fetch_model(overrides, out / MODEL_COPY)  # after the retry's clean-up of the folder; kept when there
        data = _copy_into([train_file, test_file], out / "data") if backend is not None else [train_file, test_file]
        latest = ["run.resume=latest"] if found else []
        cfg = load_config(None, [
            # the pipeline's evaluate step measures the exported model: no second evaluation here
            "dock.mode=distributed", "trainer.eval_after=false", *(latest if paused is None else []), *overrides,
            *(latest if paused is not None else []),  # after a preemption the newest checkpoint wins over a given run.resume
            f"data.train_path={data[0]}", f"data.test_path={data[1]}", f"run.output_dir={out}", "run.progress=false",
            *([f"model.path={model_copy}"] if model_copy else []),
        ])
        if backend is not None:
            check_shared_config(cfg, backend.shared_dir)
            check_platform_device(cfg, backend.platform)
        start = checkpoint_resumes_at(found) if found and (paused is not None or not resume_given) else None
        if found is not None and found.name == FINAL_DIR and start is not None and start >= cfg.trainer.iterations:
            # the failed attempt trained to the end and failed handing over: nothing is left to run
            logger.info("retry of run %s: all %d iterations were done (%s): handing over its final checkpoint", run_id, start, found)
            summary = _read_summary(out / "summary.json")
            break
        if backend is not None:
            backend.preempted = None  # an error before this attempt's workers start is no preemption
        try:
            summary = driver.train(cfg, backend=backend)
            break
        except Exception:
            paused = backend.preempted if backend is not None else None
            if backend is None or paused is None:
                raise
        # torn down by the driver; gone before the resumed run creates its JobSet under the same name
        logger.warning("run %s paused: %s; it resumes from its newest checkpoint in a new JobSet, which waits for "
                       "Kueue's admission", run_id, paused.reason)
        clear_failed_attempt(backend)

    dst = hand_over_model(out, run, checkpoint_dir, model_copy, "training",
                          skip=("checkpoints",) if rollouts_dir is None else ("checkpoints", ROLLOUTS_DIR),
                          drop_data=backend is not None)
    if rollouts_dir is not None:  # the train task's Dataset artifact (docs/rollouts.md)
        place_rollouts(out / ROLLOUTS_DIR, rollouts_dir, checkpoint=dst, config=out / "config.yaml", move=out == run)

    for key, value in run_summary(out).items():
        log_metric(key, value)
    return summary


def hand_over_model(out: Path, run: Path, checkpoint_dir: str | Path, model_copy: Path | None, what: str, *,
                    skip: Sequence[str] = ("checkpoints",), drop_data: bool = False) -> Path:
    """Give a finished run's final checkpoint to the ``model`` artifact ``checkpoint_dir`` and its other files to ``run``.

    ``out`` is the run's folder: ``run`` itself (the final checkpoint moves into the artifact: a move, not a copy, as a
    checkpoint can be many GB), or one on the shared volume, where the checkpoints stay (a retry or ``run.resume``
    finds them there, never in the pod's emptyDir) and the artifact only names the final one
    (``write_checkpoint_pointer``: every task that reads a model mounts the volume, pipelines/grpo.py); ``run`` then
    gets the small files (metrics, TensorBoard events, plot, config), less ``skip`` (and ``data/`` with ``drop_data``).
    ``model_copy`` (the fetched ``s3://`` start model, a model's size) is removed: the final checkpoint holds what a
    later step needs. Returns ``checkpoint_dir`` as a Path.

    Raises:
        RuntimeError: ``what`` (training, SFT) finished without a final checkpoint.
    """
    final = out / "checkpoints" / "final"
    if not (final / "config.json").is_file():
        raise RuntimeError(f"{what} finished without a final checkpoint in {final}")
    if model_copy is not None:
        shutil.rmtree(model_copy, ignore_errors=True)
    dst = Path(checkpoint_dir)
    if out == run:
        if dst.is_dir() and not any(dst.iterdir()):
            dst.rmdir()
        shutil.move(final, dst)
    else:
        write_checkpoint_pointer(dst, final)
        if drop_data:
            shutil.rmtree(out / "data", ignore_errors=True)
        shutil.copytree(out, run, ignore=shutil.ignore_patterns(*skip), dirs_exist_ok=True)
    return dst


MODEL_COPY = "model"
"""In the run folder: the copy of an ``s3://`` ``model.path`` the stages start from (removed after the run)."""


def fetch_model(overrides: Sequence[str], dest: Path) -> Path | None:
    """Where ``model.path`` is an ``s3://`` URI, its folder copied to ``dest`` (in the run folder: on the shared
    volume the worker pods see it too; a retry finds the copy of its failed attempt); None for a path.

    Raises:
        ConfigError: an invalid override; no S3 endpoint (naming ``dock.endpoint``).
        FileNotFoundError: nothing at the URI, or no ``config.json`` there.
    """
    cfg = load_config(None, overrides)
    if not is_s3(cfg.model.path):
        return None
    if not (dest / "config.json").is_file():
        logger.info("fetching model.path=%s into %s", cfg.model.path, dest)
        fetch_s3(cfg.model.path, dest, cfg.dock)
    if not (dest / "config.json").is_file():
        raise FileNotFoundError(f"model.path={cfg.model.path!r}: no config.json under it: not an HF model folder")
    return dest


def shared_mount(platform: str | Platform) -> Path | None:
    """The platform's shared volume where this pod has it mounted (``shared_mount_path`` exists), else None."""
    p = get_platform(platform) if isinstance(platform, str) else platform
    if p.shared_volume_claim and Path(p.shared_mount_path).is_dir():
        return Path(p.shared_mount_path)
    return None


def _read_summary(path: Path) -> dict[str, float]:
    try:
        doc = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return {}
    return doc if isinstance(doc, dict) else {}


def _copy_into(files: Sequence[Path], folder: Path) -> list[Path]:
    """Copy ``files`` into ``folder`` (created); returns the copies' paths."""
    folder.mkdir(parents=True, exist_ok=True)
    return [Path(shutil.copy2(f, folder / f.name)) for f in files]


def _under(path: str | Path, root: Path) -> bool:
    return Path(path).resolve().is_relative_to(root.resolve())


PLATFORM_DEVICE = {"npu": "npu", "gpu": "cuda", "cpu": "cpu"}
"""The ``parallel.device`` of the pods of each platform."""


def check_platform_device(cfg: Config, platform: Platform) -> None:
    """Check that ``parallel.device`` is the kind of device the platform's pods hold (or ``auto``).

    Raises:
        ValueError: another kind: the worker pods would request the platform's devices and compute
            elsewhere (``parallel.device=cpu`` on the npu platform), or fail to find theirs.
    """
    wanted = PLATFORM_DEVICE[platform.name]
    if cfg.parallel.device not in ("auto", wanted):
        raise ValueError(f"parallel.device={cfg.parallel.device!r}: the pipeline was compiled for platform {platform.name!r}, "
                         f"whose worker pods hold {wanted!r} devices; use parallel.device=auto or {wanted!r}, or compile for "
                         "the platform of that device (dockrl pipeline compile --platform)")


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
    if cfg.model.path != PACKAGED_MODEL and not _under(cfg.model.path, shared):
        logger.warning("model.path=%r is not on the shared volume (%s): the stage pods must find it in their image",
                       cfg.model.path, shared)
