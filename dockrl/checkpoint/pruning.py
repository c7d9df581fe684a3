"""Checkpoint retention, ``trainer.keep_checkpoints`` (docs/resume.md): ``prune_checkpoints`` removes the
complete intermediate checkpoints older than the newest K, each with its dock snapshot where that lies
outside its folder (``dockrl.checkpoint.resume.dock_snapshot_uri``). The driver calls it as each newer one completes.

Run folder retention, ``dockrl runs prune`` (docs/kubeflow.md): ``prune_runs`` removes the run folders of a
shared volume's ``runs/`` that nothing wrote to for a given number of days, except the newest few and any a live
run holds; recurring runs add one folder per run, and nothing else removes them.
"""

from __future__ import annotations

import logging
import shutil
import time
from pathlib import Path

import pyarrow as pa
import pyarrow.fs as pafs

from dockrl.checkpoint.resume import FINAL_DIR, ITER_DIR, read_state
from dockrl.run.lock import lock_holder

logger = logging.getLogger(__name__)


PRUNING = ".pruning-"
"""Prefix a pruned checkpoint folder is renamed to before its files go (``prune_checkpoints``)."""


def prune_checkpoints(run_dir: str | Path, keep: int, newest: Path) -> list[Path]:
    """Remove the complete intermediate checkpoints of ``run_dir`` older than the newest ``keep``
    (``trainer.keep_checkpoints``; 0 removes nothing); call it once ``newest`` is complete.

    ``newest`` is the checkpoint just completed: an ``iter_*`` folder counts as one of the
    ``keep``, ``final`` does not (it is always kept). Only complete ``iter_*`` checkpoints that
    resume before ``newest`` are candidates: never ``final``, never an incomplete folder (a
    stage may be writing it), never one that resumes after ``newest`` (left by an earlier run
    that went further; a run resumed from an older checkpoint overwrites it when it gets there).
    The checkpoint a run resumed from is such a candidate only once ``newest``, written by this
    run, is complete: every stage loaded it before it reported the iteration ``newest`` follows.

    A pruned folder is first renamed to ``.pruning-iter_<k>`` (``latest_checkpoint`` no longer
    sees it), then its dock snapshot is deleted where it lies outside the folder (the S3 store of
    ``dock.warehouse=s3``, ``dock_snapshot_uri``), then the folder; what an earlier call left half
    done (the process stopped in between) is finished here. One log line per pruned checkpoint.

    Returns:
        The checkpoint folders removed (their ``iter_*`` paths), oldest first.

    Errors deleting files are logged as warnings, never raised: a checkpoint left over only takes
    disk space, and a training run must not fail for it.
    """
    folder = Path(run_dir) / "checkpoints"
    for left in sorted(folder.glob(f"{PRUNING}*")):  # a removal an earlier call did not finish
        _remove_pruned(left)
    if keep <= 0:
        return []
    newest_doc = read_state(newest)
    if newest_doc is None:
        raise AssertionError(f"prune_checkpoints: {newest} is not complete; prune only after a newer checkpoint is complete")
    bound = int(newest_doc["next_iteration"])
    complete: list[tuple[int, Path]] = []
    for path in folder.glob("iter_*"):
        doc = read_state(path) if ITER_DIR.fullmatch(path.name) and path.is_dir() else None
        if doc is not None and int(doc.get("next_iteration", -1)) < bound:
            complete.append((int(doc["next_iteration"]), path))
    room = keep - 1 if newest.name != FINAL_DIR else keep  # `newest` itself takes one of the places
    complete.sort()
    pruned = [path for _, path in complete[: max(0, len(complete) - room)]]
    for path in pruned:
        trash = path.with_name(f"{PRUNING}{path.name}")
        try:
            path.rename(trash)
        except OSError as e:
            logger.warning("checkpoint %s could not be removed (trainer.keep_checkpoints=%d): %s", path, keep, e)
            continue
        _remove_pruned(trash)
        logger.info("checkpoint %s removed: trainer.keep_checkpoints=%d keeps the newest", path, keep)
    return pruned


def _remove_pruned(trash: Path) -> None:
    """Delete a folder ``prune_checkpoints`` renamed, and its dock snapshot where that lies outside it."""
    doc = read_state(trash)
    uri = str((doc or {}).get("dock_snapshot") or "")
    # a local snapshot is the folder's dock/ and goes with it; a path recorded elsewhere (a run folder
    # copied from another place names the original's) is never followed
    if "://" in uri and not uri.startswith("file://"):
        _delete_snapshot(uri)
    shutil.rmtree(trash, ignore_errors=True)
    if trash.exists():
        logger.warning("the pruned checkpoint %s could not be deleted entirely: delete it", trash)


def _delete_snapshot(uri: str) -> None:
    """Delete the dock snapshot at ``uri`` (a ``pyarrow.fs`` URI, e.g. ``s3://…``); a missing one is fine."""
    try:
        fs, root = pafs.FileSystem.from_uri(uri)
        if fs.get_file_info(root).type != pafs.FileType.NotFound:
            fs.delete_dir(root)
    except (OSError, ValueError, pa.ArrowException) as e:
        where = uri.partition("?")[0]  # the query names the endpoint only, never a credential, but is long
        logger.warning("the dock snapshot %s of a pruned checkpoint could not be deleted (%s): delete it", where, e)


DAY_S = 86400.0


def last_write(folder: Path, depth: int = 2) -> float:
    """The newest modification time (seconds since the epoch) of ``folder`` and what lies up to ``depth`` levels
    below it: a live run writes ``metrics.jsonl``, its logs and a checkpoint folder at least once an iteration."""
    newest = folder.stat().st_mtime
    if depth > 0:
        for child in folder.iterdir():
            newest = max(newest, last_write(child, depth - 1) if child.is_dir() and not child.is_symlink() else child.lstat().st_mtime)
    return newest


def prune_runs(runs_dir: str | Path, *, older_than_days: float, keep: int = 0, dry_run: bool = False,
               now: float | None = None) -> list[Path]:
    """Remove the run folders in ``runs_dir`` (the shared volume's ``runs/``: one per pipeline run, and the
    ``<run id>.attempt-<n>`` a retry set aside) that nothing wrote to for ``older_than_days`` days (``last_write``),
    except the ``keep`` newest and any whose run lock a live process holds (``run_lock.lock_holder``; on a network
    file system only a holder on this node is seen, hence the age as well). A folder is renamed ``.pruning-<name>``
    before its files go; what an earlier call left so is removed too. A dock snapshot in the S3 store
    (``dock.warehouse=s3``) stays: the store's own lifecycle rules remove it.

    Returns:
        The removed folders (with ``dry_run``: those that would be), oldest first.

    Raises:
        ValueError: a negative ``older_than_days`` or ``keep``.
        FileNotFoundError: ``runs_dir`` is not a folder.
    """
    if older_than_days < 0 or keep < 0:
        raise ValueError(f"prune_runs: older_than_days={older_than_days}, keep={keep}: expected numbers >= 0")
    root = Path(runs_dir)
    if not root.is_dir():
        raise FileNotFoundError(f"{root} is not a folder: expected the runs/ folder of the shared volume")
    now = time.time() if now is None else now
    folders = sorted((last_write(p), p) for p in root.iterdir() if p.is_dir() and not p.name.startswith("."))
    candidates = folders[:max(len(folders) - keep, 0)]
    removed = [p for written, p in candidates if now - written > older_than_days * DAY_S and lock_holder(p) is None]
    if dry_run:
        return removed
    for folder in removed:
        trash = folder.with_name(f"{PRUNING}{folder.name}")
        folder.rename(trash)
        logger.info("pruned run folder %s (last written %.1f days ago)", folder, (now - last_write(trash, 0)) / DAY_S)
    for trash in root.glob(f"{PRUNING}*"):
        shutil.rmtree(trash, ignore_errors=True)
    return removed
