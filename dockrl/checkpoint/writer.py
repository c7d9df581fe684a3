"""The driver's part of a run's checkpoints: ``CheckpointWriter``, which the iteration loop (``dockrl.driver.drive``) calls.

A checkpoint after iteration ``k`` (when ``checkpoint_due``): the stages write the actor's weights
and optimizer, then the writer opens iteration ``k+1`` with its prompts without announcing it,
snapshots the dock and writes the driver's state last (``write_driver_state``); the loop then
announces ``k+1`` instead of opening it, as a run resumed from that checkpoint does. After the
last iteration ``finish`` does the same for ``checkpoints/final`` (no dock snapshot: nothing is open).
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Callable, Protocol

from dockrl.checkpoint.pruning import prune_checkpoints
from dockrl.checkpoint.resume import (
    CheckpointInProgress,
    checkpoint_dir,
    checkpoint_due,
    dock_snapshot_uri,
    final_dir,
    write_driver_state,
    write_final_state,
)
from dockrl.config import Config
from dockrl.dock import Dock

logger = logging.getLogger(__name__)


class CheckpointingRunner(Protocol):
    """What the writer asks of the stage runner (``dockrl.driver.StageRunner``)."""

    @property
    def dock(self) -> Dock: ...

    @property
    def run(self) -> str: ...

    def save_checkpoint(self, iteration: int, folder: Path) -> None: ...

    def generated(self, iterations: range) -> dict[int, dict[str, dict[str, float]]]: ...

    def finish(self) -> None: ...


class CheckpointWriter:
    """The checkpoints of one planned run over started stages.

    Args:
        cfg: the run's config.
        prompts: the fingerprint of the run's prompts (``RunPlan.fingerprint``), written into each checkpoint.
        snapshot_report: the report that tells the stages the dock's snapshot is taken (``Report.SNAPSHOT``: the
            stages that wait for it may take rows of the open iterations).
        in_progress: names the folder the stages may be writing, from the start of the iteration after
            which a checkpoint is due until the driver's state completes it (the caller removes it,
            ``CheckpointInProgress.remove``, when the run is cut short).
        summary: the run's summary so far, written into each checkpoint (the same dict the loop adds to).
    """

    def __init__(self, cfg: Config, prompts: str, runner: CheckpointingRunner, *, snapshot_report: str,
                 in_progress: CheckpointInProgress, summary: dict[str, float]) -> None:
        self.cfg, self.prompts, self.runner, self.snapshot_report = cfg, prompts, runner, snapshot_report
        self.in_progress, self.summary = in_progress, summary
        self.run_dir = Path(cfg.run.output_dir)

    def due(self, iteration: int) -> bool:
        """A checkpoint is written after ``iteration`` (``trainer.save_every``; not after the last)."""
        return checkpoint_due(self.cfg.trainer, iteration)

    def begin(self, iteration: int) -> None:
        """At the start of ``iteration``: the stages write a due checkpoint once they are done with it,
        maybe before the driver hears of it."""
        self.in_progress.folder = checkpoint_dir(self.run_dir, iteration + 1) if self.due(iteration) else None

    def write(self, iteration: int, opened: int, open_unannounced: Callable[[int], None]) -> int:
        """The checkpoint after ``iteration``, once its reports are in; ``opened``: the next iteration to open.

        ``open_unannounced(k)`` opens iteration ``k`` with its prompts without announcing it; the writer
        calls it for ``opened`` when ``dock.max_inflight`` leaves room for it. Returns the next iteration
        to open after that (``opened``, or ``opened + 1`` when it opened one: the loop announces it).
        """
        cfg, dock, t = self.cfg, self.runner.dock, self.cfg.trainer
        folder = checkpoint_dir(self.run_dir, iteration + 1)
        self.runner.save_checkpoint(iteration, folder)
        ahead = range(iteration + 1, opened)  # in flight: the rollout took update `iteration` after generating them
        generated = self.runner.generated(ahead) if len(ahead) else {}
        if opened < min(iteration + 1 + cfg.dock.max_inflight, t.iterations):
            open_unannounced(opened)
            opened += 1
        uri = dock_snapshot_uri(cfg, folder, self.runner.run)
        dock.snapshot(uri)
        write_driver_state(folder, cfg, next_iteration=iteration + 1, dock_uri=uri, open_iteration=iteration + 1, summary=self.summary,
                           prompts=self.prompts, open_iterations=range(iteration + 1, opened), reports=generated,
                           generated_through=max(generated, default=iteration))
        dock.report(iteration, self.snapshot_report, {})  # the stages that wait for it may take rows of the open iterations now
        self.in_progress.folder = None
        logger.info("checkpoint %s written; iteration %d resumes from it", folder, iteration + 1)
        prune_checkpoints(self.run_dir, t.keep_checkpoints, folder)  # after a newer one is complete, as verl's max_actor_ckpt_to_keep
        return opened

    def finish(self) -> None:
        """After the last iteration: the stages end, writing ``checkpoints/final``; the driver's state completes it."""
        cfg = self.cfg
        self.in_progress.folder = final_dir(self.run_dir)
        self.runner.finish()
        write_final_state(final_dir(self.run_dir), cfg, summary=self.summary, prompts=self.prompts)  # a finished run continues from here
        self.in_progress.folder = None
        prune_checkpoints(self.run_dir, cfg.trainer.keep_checkpoints, final_dir(self.run_dir))  # final is kept besides the newest K
