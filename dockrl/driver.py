"""The GRPO driver: the one iteration loop of every run, wherever its stages run.

    dockrl train [--config FILE] [section.field=value ...]

The driver never moves payload between stages: it opens an iteration, puts its prompt rows into
the dock, and each stage claims what it needs and puts its columns back. Where the stages run
is a ``StageRunner``, chosen by ``dock.mode``; nothing else differs: ``InProcessStages``
(``dockrl/stages/inprocess.py``, every stage in this process) or ``ProcessStages``
(``dockrl/launch/distributed.py``, every stage a process reporting through the dock). A run (``train`` → ``drive``): plan it
(``dockrl.run.setup``), start the stages, evaluate, then per iteration open it with its prompts,
collect the stages' metrics, close (with ``run.keep_rollouts`` the shards
keep its rows: ``dockrl.rollouts.keep``), log and checkpoint when due (``dockrl/checkpoint/writer.py``; older
ones pruned with ``trainer.keep_checkpoints``, ``dockrl/checkpoint/pruning.py``); then the final checkpoint, the evaluation after
training and the summary. The metrics go to ``metrics.jsonl`` and, live, to the run's trackers (``run.trackers``,
``dockrl/run/trackers/``), which never fail the run. With ``dock.max_inflight`` = m (distributed) up to m iterations are
open at once: the rollout generates the next ones while this one trains
(``dockrl.stages.rollout_process.sync_target`` bounds their staleness).
"""

from __future__ import annotations

import contextlib
import logging
import secrets
import time
from pathlib import Path
from typing import TYPE_CHECKING, Callable, Literal, Protocol

from dockrl.checkpoint.resume import CheckpointInProgress
from dockrl.checkpoint.writer import CheckpointWriter
from dockrl.config import Config
from dockrl.dock import Dock
from dockrl.launch.distributed import start_processes
from dockrl.launch.run_records import recorded_run
from dockrl.process.lifeline import sigterm_as_exit
from dockrl.rollouts.keep import keep_spec, write_dataset_meta
from dockrl.run.data import Prompt
from dockrl.run.lock import RunLock
from dockrl.run.metrics import MetricsWriter, plot_metrics, run_report
from dockrl.run.progress import Progress
from dockrl.run.setup import RunPlan, plan_run, prompt_batches
from dockrl.run.trackers import TrackerSet, run_info
from dockrl.stages.loop import Report

if TYPE_CHECKING:
    from dockrl.launch.backend import WorkerBackend

logger = logging.getLogger(__name__)

OnIteration = Callable[[int, dict[str, float]], None]


class StageRunner(Protocol):
    """Where the stages of a run execute; the driver's loop (``drive``) is the same over any.

    ``dock`` is the run's dock; the driver opens, fills, snapshots and closes its iterations.
    ``run`` is the run's name (the warehouse objects' root, ``dock_snapshot_uri``).
    """

    @property
    def dock(self) -> Dock: ...

    @property
    def run(self) -> str: ...

    def evaluate(self, tag: Literal["before", "after"]) -> dict[str, float]:
        """Greedy test accuracy as ``eval/accuracy_<tag>`` and ``eval/format_rate_<tag>``."""

    def run_iteration(self, iteration: int) -> dict[str, float]:
        """Every stage's metrics of the open ``iteration`` (the weight sync's too), once all are done."""

    def save_checkpoint(self, iteration: int, folder: Path) -> None:
        """Once ``folder`` holds the actor's weights and optimizer after ``iteration``."""

    def generated(self, iterations: range) -> dict[int, dict[str, dict[str, float]]]:
        """The rollout's reports of ``iterations`` (open, after a due checkpoint's: iterations in flight),
        ``{iteration: {"rollout": metrics}}``, once each is reported."""

    def finish(self) -> None:
        """No iteration follows: return once every stage ended and ``checkpoints/final`` holds weights and optimizer."""

    def close(self) -> None:
        """Stop every stage and free what they hold (also after an error)."""


def train(cfg: Config, *, on_iteration: OnIteration | None = None, backend: WorkerBackend | None = None) -> dict[str, float]:
    """Run GRPO as configured; returns the run summary (accuracies, seconds).

    ``on_iteration(i, metrics)`` is called once each iteration's metrics are written.
    ``run.resume`` continues from a checkpoint: weights, optimizer, dock and the next iteration
    come from it; ``metrics.jsonl`` keeps the iterations before it. ``backend`` is where
    ``dock.mode=distributed`` starts the stage processes (default: local processes).

    Writes to ``run.output_dir``: ``config.yaml``, ``metrics.jsonl``, ``tensorboard/`` (the ``tensorboard`` tracker),
    ``metrics.png``, ``summary.json``, ``checkpoints/`` (HF format), with ``run.keep_rollouts`` ``rollouts/``
    (written by the dock shards, docs/rollouts.md), distributed, ``logs/``, with MLflow or W&B ``trackers.json`` (their
    run ids) and the report files they keep (``metrics.html``, ``rollouts.html``), with W&B offline ``wandb/``.
    Nothing of the run folder is written before the run is accepted, and the folder is locked
    for the run's lifetime (``dockrl.run.lock``). A checkpoint whose write an error, Ctrl-C or
    SIGTERM cut short is removed once the stages stopped (``CheckpointInProgress``). While it
    runs, ``dockrl runs`` lists the run: distributed, from the launcher's record; in-process,
    from a record of its own (``dockrl.launch.run_records.recorded_run``).

    Raises:
        RunLockedError: another live run holds ``run.output_dir`` (one on another host: still after
            ``run.lock_wait_s``).
        ConfigError: what only the run can check (``model.path``, ``run.resume``, the data).
        WorkerFailed: a stage process died (distributed; its log tail in the message).
    """
    # `kill` runs the clean-up below (verifier pool, workers, the run's record, lock)
    with RunLock(cfg.run.output_dir, wait_s=cfg.run.lock_wait_s) as lock, sigterm_as_exit() as stop, contextlib.ExitStack() as stack:
        plan = plan_run(cfg)
        trackers = TrackerSet.open(cfg.run.trackers, run_info(cfg, plan.resume))  # a tracker's missing settings fail here
        lock.accept()  # from here the lock file keeps this run's pid (a refused run puts back what it found)
        if cfg.dock.mode == "distributed":
            runner: StageRunner = start_processes(plan, backend)  # its backend records the run
        else:
            from dockrl.stages.inprocess import InProcessStages  # lazy: the engines (transformers, ~2 s); distributed mode needs none here

            run = f"dockrl-{secrets.token_hex(6)}"
            stack.enter_context(recorded_run(run, cfg.run.output_dir))
            runner = InProcessStages(plan, run=run)
        checkpoint = CheckpointInProgress()
        try:
            summary = drive(plan, runner, on_iteration=on_iteration, checkpoint=checkpoint, stop=stop, trackers=trackers)
        finally:
            runner.close()  # first: no stage writes into a checkpoint any more
            checkpoint.remove()  # one cut short (an error, Ctrl-C, SIGTERM): incomplete, never resumed from
    run_dir = Path(cfg.run.output_dir)
    plot_metrics(run_dir / "metrics.jsonl", run_dir / "metrics.png")
    return summary


def drive(plan: RunPlan, runner: StageRunner, *, on_iteration: OnIteration | None = None,
          checkpoint: CheckpointInProgress | None = None, stop: sigterm_as_exit | None = None,
          trackers: TrackerSet | None = None) -> dict[str, float]:
    """The iteration loop of a planned run over started stages; returns the run summary.

    A checkpoint after iteration ``k`` (when ``checkpoint_due``) is written by the loop's
    ``CheckpointWriter`` (``dockrl.checkpoint.writer``): it opens iteration ``k+1`` unannounced,
    and the loop then announces ``k+1`` instead of opening it, as a run resumed from that checkpoint does.

    With ``dock.max_inflight`` = m > 1 the driver keeps iterations ``k`` … ``k+m-1`` open while
    it waits for ``k``'s reports, and closes ``k`` once they are in. A checkpoint after ``k``
    then holds ``k+1`` … ``k+m-2`` generated (the rollout took update ``k`` only after them),
    ``k+m-1`` opened unannounced with its prompts, and the rollout's reports of the generated
    ones; the other stages wait for the driver's ``SNAPSHOT`` report before they touch them.

    ``checkpoint.folder`` names the checkpoint the stages may be writing, from the start of the
    iteration after which it is due until the driver's state completes it: the caller removes it
    (``CheckpointInProgress.remove``) once the stages stopped when the loop is cut short.
    ``stop`` (the caller's ``sigterm_as_exit``) raises, before the first evaluation and at the start
    of each iteration, a SIGTERM or Ctrl-C whose exception was lost in a finalizer.
    ``trackers`` (default: ``run.trackers`` opened here) get every iteration's metrics, then the summary and, where
    they keep files, ``run_report``'s; the summary gets their failure counts.
    """
    t0 = time.perf_counter()
    cfg, point, dock = plan.cfg, plan.resume, runner.dock
    t, n = cfg.trainer, cfg.rollout.n
    run_dir = Path(cfg.run.output_dir)
    summary: dict[str, float] = {"eval/test_prompts": len(plan.test_prompts), "data/train_prompts": len(plan.train_prompts)}
    summary |= point.summary if point else {}
    checkpoints = CheckpointWriter(cfg, plan.fingerprint, runner, snapshot_report=Report.SNAPSHOT,
                                   in_progress=checkpoint or CheckpointInProgress(), summary=summary)
    rounds = cfg.algorithm.filter_groups.rounds  # dynamic sampling: prompts for every rollout round it may sample
    batches = list(prompt_batches(plan.train_prompts, t, rounds=rounds))
    gate = t.global_batch if cfg.algorithm.filter_groups.enable else 0
    inflight = cfg.dock.max_inflight
    first = point.next_iteration if point else 0
    unannounced = list(point.open_iterations) if point else []  # open and filled before a checkpoint's snapshot
    opened = max(unannounced, default=first - 1) + 1  # the next iteration to open
    if point:
        if point.dock_uri:  # checkpoints/final has no open iteration to restore
            dock.restore(point.dock_uri)  # before any stage asks for an iteration
        for it, reports in (point.reports or {}).items():  # handed in before the snapshot: the resumed stages do not repeat them
            for stage, stage_metrics in reports.items():
                dock.report(it, stage, stage_metrics)
        logger.info("resuming at iteration %d from %s", first, point.checkpoint)
    # run.keep_rollouts: the dataset's _meta.json here, the rows by the shards at each close, with this lineage
    kept = write_dataset_meta(cfg, point.checkpoint if point else None) if cfg.run.keep_fraction > 0 else None
    if trackers is None:
        trackers = TrackerSet.open(cfg.run.trackers, run_info(cfg, point))
    with MetricsWriter(run_dir, on_log=on_iteration, resume_from=first if point else None, trackers=trackers) as writer, \
            Progress(t.iterations - first, "GRPO", enable=cfg.run.progress) as progress:
        check_stop = stop.raise_if_stopped if stop is not None else lambda: None  # a SIGTERM or Ctrl-C a finalizer swallowed
        check_stop()  # one received while the stages loaded their models
        if t.eval_before and not point:
            summary |= runner.evaluate("before")
        for it in range(first, t.iterations):
            check_stop()
            start = time.perf_counter()
            for ready in unannounced:  # opened and filled before a checkpoint's snapshot: the stages may start now
                dock.announce(ready)
            unannounced = []
            checkpoints.begin(it)
            while opened < min(it + inflight, t.iterations):  # up to dock.max_inflight iterations open
                open_with_prompts(dock, opened, batches[opened], n, gate=gate)
                opened += 1
            metrics = runner.run_iteration(it)
            metrics |= dock.stats()
            # with kept rollouts the shards write their rows of `it` in the background: only where, and the lineage, go from here
            dock.close_iteration(it, keep=None if kept is None else keep_spec(cfg, it, metrics, kept))
            seconds = time.perf_counter() - start  # perf: response tokens of all rows per second
            responses = metrics.get("rollout/responses", len(batches[it]) * n)  # dynamic sampling: the rounds sampled
            metrics |= {"timing_s/iteration": seconds,
                        "perf/response_tokens_per_s": metrics["rollout/response_length_mean"] * responses / seconds}
            writer.log(it, metrics)
            progress.update(metrics)
            if checkpoints.due(it):
                following = checkpoints.write(it, opened, lambda k: open_with_prompts(dock, k, batches[k], n, announce=False, gate=gate))
                unannounced, opened = list(range(opened, following)), following
        if kept is not None:  # every kept iteration written before the run reports
            summary |= dock.flush_rollouts()
        checkpoints.finish()
        if t.eval_after:
            summary |= runner.evaluate("after")
        summary["run/seconds"] = time.perf_counter() - t0
        summary |= writer.finish(summary, run_report(run_dir) if trackers.artifacts else ())
        writer.log_summary(summary)
    return summary


def open_with_prompts(dock: Dock, iteration: int, picked: list[Prompt], n: int, *, announce: bool = True, gate: int = 0) -> None:
    """Open ``iteration`` with ``len(picked)·n`` rows; prompt ``i`` fills rows ``[i·n, (i+1)·n)``.

    ``announce=False`` leaves it unannounced to the stages (a checkpoint snapshots it first).
    ``gate`` (dynamic sampling: ``trainer.global_batch``): only the first ``gate`` prompts, the
    first round, get the ``released`` gate; the advantage stage releases the later rounds
    (``dockrl.stages.dynamic_sampling``).
    """
    dock.open_iteration(iteration, len(picked) * n, n, announce=announce)
    dock.put(range(len(picked) * n), {
        "prompt_ids": [p.prompt_ids for p in picked for _ in range(n)],
        "ground_truth": [p.ground_truth for p in picked for _ in range(n)],
    }, iteration=iteration)
    if gate:
        dock.put(range(gate * n), {"released": [True] * (gate * n)}, iteration=iteration)
