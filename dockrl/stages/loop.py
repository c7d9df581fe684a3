"""The stage loop: what a stage reports to the driver, and the loop a stage process serves the
driver's iterations with (the variables a backend sets for every process: ``dockrl/process/env.py``).
Which stages a run has, and which reports the driver waits for, is the stage table's
(``dockrl/stages/table.py``).

A stage reports through the dock (``dock.report(iteration, report, metrics)``; the value of a
``Report`` is its name on the wire) and the driver waits for the reports it expects
(``dock.wait_reports``). Every report belongs to a real iteration index: the evaluation before
training to the first iteration (0, a fresh run), the evaluation after training and the end of
each stage process's loop to ``trainer.iterations``, the index after the last iteration.
"""

from __future__ import annotations

import enum
import logging
from typing import TYPE_CHECKING, Callable

from dockrl.checkpoint.resume import checkpoint_due
from dockrl.config import Config
from dockrl.process.memory import stage_memory

if TYPE_CHECKING:  # the driver's reports only: no torch, no pyarrow here
    from dockrl.dock import Dock

logger = logging.getLogger(__name__)


class Report(enum.StrEnum):
    """What a stage tells the driver through the dock."""

    ROLLOUT = "rollout"  # an iteration's rollout/* metrics: every row has its response (partial rollout: or its carry-over)
    REWARD_MODEL = "reward-model"  # an iteration's reward-model scores are written (reward_model.enable)
    REWARD = "reward"  # an iteration's reward/* metrics (and the advantages')
    REFERENCE = "reference"  # an iteration's reference log-probs are written (algorithm.uses_reference)
    TEACHER = "teacher"  # an iteration's teacher log-probs are written (teacher.enable)
    ACTOR = "actor"  # an iteration's update is done (with trainer.hybrid its weight sync too)
    WEIGHT_SYNC = "weight_sync"  # the rollout holds the weights of the iteration's update (a separate rollout only)
    CRITIC = "critic"  # an iteration's values are written and the critic's update is done (critic.enable)
    SNAPSHOT = "snapshot"  # the driver snapshotted the dock of a due checkpoint (stages then take rows of the next)
    CHECKPOINT = "checkpoint"  # the actor wrote the weights and optimizer of the checkpoint after the iteration
    CRITIC_CHECKPOINT = "critic_checkpoint"  # the critic wrote its weights and optimizer there (critic.enable)
    EVAL_BEFORE = "eval_before"  # the greedy evaluation before training (eval/*_before), at iteration 0
    EVAL_AFTER = "eval_after"  # the greedy evaluation after training (eval/*_after), at trainer.iterations
    FINAL = "final"  # a stage process ended its loop (the actor wrote checkpoints/final), at trainer.iterations


def final_report(process: str) -> str:
    """The wire name of ``process``'s ``Report.FINAL``, one per stage process: ``final/<process>``."""
    return f"{Report.FINAL}/{process}"


def snapshot_after(cfg: Config) -> Callable[[int], bool] | None:
    """With iterations in flight (``dock.max_inflight`` > 1), the iterations after which a stage
    other than the rollout waits for the driver's ``SNAPSHOT`` before it takes rows of the next
    (those with a checkpoint due): the snapshot then holds the later open iterations as the
    rollout left them, untouched by the stages whose state the checkpoint holds as of that
    iteration (the actor's weights). ``None`` with one iteration in flight: the driver opens the
    next only after its snapshot."""
    if cfg.dock.max_inflight == 1:
        return None
    return lambda it: checkpoint_due(cfg.trainer, it)


def serve_iterations(
    dock: Dock, stage: str, step: Callable[[int], dict[str, float]], *, timeout_s: float,
    after_report: Callable[[int], None] | None = None, seed: int | None = None, report: bool = True,
    first_timeout_s: float | None = None, after: int = -1, hold: Callable[[int], bool] | None = None,
) -> int:
    """The loop of a stage process: ``step(iteration)`` for every iteration the driver opens
    after ``after`` (oldest first: several may be open, ``dock.max_inflight``), its
    metrics reported as ``stage`` (a ``Report``, or the report a stage table row names; unless ``report`` is false: ranks but the first of a stage),
    then ``after_report(iteration)`` (weight sync, checkpoints), then, where ``hold(iteration)``,
    a wait for the driver's ``SNAPSHOT`` of it (``snapshot_after``); with ``seed`` the generators are
    reseeded per iteration. ``first_timeout_s`` (default ``timeout_s``) bounds the wait for the
    first iteration, which opens after the rollout's evaluation. Returns the iterations served
    once the driver called ``finish()``.

    Raises:
        DockTimeoutError: no iteration opened within ``timeout_s`` of the previous one, or no
            ``SNAPSHOT`` report within ``timeout_s`` (the message names the report).
    """
    from dockrl.process.seeding import (
        seed_iteration,  # lazy: it imports torch; the stage table (dockrl.stages.table) imports this module and stays light
    )

    last, served = after, 0  # -1: before the first iteration
    while (it := dock.wait_iteration(last, first_timeout_s if served == 0 and first_timeout_s else timeout_s)) is not None:
        logger.info("%s: iteration %d", stage, it)
        if seed is not None:
            seed_iteration(seed, it)
        metrics: dict[str, float] = {}
        with stage_memory(str(stage), metrics):  # memory/*: this process's peak while it stepped
            metrics |= step(it)
        if report:
            dock.report(it, stage, metrics)
        if after_report is not None:
            after_report(it)
        if hold is not None and hold(it):  # the driver snapshots the later open iterations before this stage touches them
            dock.wait_reports(it, [Report.SNAPSHOT], timeout_s)
        last, served = it, served + 1
    logger.info("%s: finished after %d iterations", stage, served)
    return served
