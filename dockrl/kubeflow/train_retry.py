"""A retried train task finds what its failed attempt left (``dockrl.kubeflow.train_task.run_training``).

* ``prepare_retry``: the run folder on the shared volume, keyed by the pipeline run's id: the
  complete checkpoint to continue from, or the folder set aside and a fresh start.
* ``clear_failed_attempt``: with the ``kubernetes`` worker backend, the failed attempt's JobSet
  (its pods) torn down and gone before the new attempt creates its own under the same names.
"""

from __future__ import annotations

import logging
import shutil
import time
from pathlib import Path

from dockrl.checkpoint.resume import checkpoint_resumes_at, latest_checkpoint
from dockrl.kubeflow.steps import TEARDOWN_WAIT_S
from dockrl.launch.kubernetes import KubernetesBackend
from dockrl.run.lock import RunLock, lock_holder

logger = logging.getLogger(__name__)


def prepare_retry(out: Path, run_id: str, *, resume_given: bool = False, lock_wait_s: float = 0.0) -> Path | None:
    """Where a train task starts in its run folder ``out`` (``<shared>/runs/<run_id>``, which only
    an earlier, failed attempt of the same pipeline run can have written): the complete checkpoint
    it continues from, or None to start fresh.

    * No folder, or an empty one: nothing to do, None.
    * A folder whose lock a process of another host holds (the failed attempt's, on a node that
      was lost: its lock lasts until the file system's lease expires): waits up to
      ``lock_wait_s`` seconds for it to go (``run.lock_wait_s``, ``dockrl.run.lock``), then goes on;
      one a live process of this host holds, or still held after the wait: ``RunLockedError``
      naming the holder.
    * A complete checkpoint (``latest_checkpoint``): it is returned and logged, ``retry of run
      <id>: resuming at iteration k from …``; the caller resumes with ``run.resume=latest``
      unless ``resume_given`` (a ``run.resume`` override, which wins).
    * No complete checkpoint: the folder is renamed ``<run_id>.attempt-<n>`` beside it (n = 1, 2,
      … over the failed attempts), its incomplete checkpoints removed (never resumed from, and
      the weights take the disk) and the rest kept (logs, metrics, config); None.
    """
    if not out.is_dir() or not any(out.iterdir()):
        return None
    if lock_holder(out) is not None:
        RunLock(out, wait_s=lock_wait_s).acquire().release()  # released by then, or RunLockedError naming the holder
    found = latest_checkpoint(out)
    if found is not None:
        if not resume_given:
            logger.info("retry of run %s: resuming at iteration %s from %s", run_id, checkpoint_resumes_at(found), found)
        return found
    n = 1 + sum(1 for p in out.parent.glob(f"{out.name}.attempt-*") if p.is_dir())
    aside = out.with_name(f"{out.name}.attempt-{n}")
    out.rename(aside)
    shutil.rmtree(aside / "checkpoints", ignore_errors=True)
    logger.info("retry of run %s: the failed attempt left no complete checkpoint; its folder (logs, metrics) is kept in %s, "
                "the run starts fresh", run_id, aside)
    return None


def clear_failed_attempt(backend: KubernetesBackend, wait_s: float = TEARDOWN_WAIT_S) -> list[str]:
    """Tear down what a failed attempt of this run left in the cluster and wait until it is gone.

    A retried train task's launcher finds the JobSet (and its Secret and pods) of the attempt
    before when that launcher died before its own teardown. The new objects have the same names
    (they would be refused as existing), and the old pods may still write into the run folder.

    Returns:
        What was there (``Kind/name``; empty for a first attempt).

    Raises:
        RuntimeError: something of it is still there after ``wait_s`` seconds (names it).
    """
    left = backend.remains()
    if not left:
        return []
    logger.info("retry of run %s: the failed attempt's workers are still there (%s); tearing them down", backend.run_id,
                ", ".join(left))
    backend.teardown()
    deadline = backend.clock() + wait_s
    still = backend.remains()
    while still and backend.clock() < deadline:
        time.sleep(min(backend.poll_s, 1.0))
        still = backend.remains()
    if still:
        raise RuntimeError(f"retry of run {backend.run_id}: the failed attempt's {', '.join(still)} still exist {wait_s:.0f} s "
                           f"after their deletion; a new attempt would meet them (same names, the same run folder): delete them "
                           f"(kubectl delete jobset,pod,secret -n {backend.namespace} -l {backend.selector}) and retry")
    return left
