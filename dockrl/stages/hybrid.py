"""Hybrid actor stage: generate, train and sync on the same devices (``trainer.hybrid=true``).

One worker plays the rollout and the actor roles with a ``HybridActor``
(``dockrl/engines/hybrid.py``): megatron-core trains, vLLM generates, and the allgather–swap
hands the updated weights from one to the other. Per iteration:

1. ``generation.run_iteration(dock)``: the ``RolloutWorker`` claims prompts and puts responses
   (reward, advantage and reference stages then work on them, elsewhere);
2. ``update.run_iteration(dock)``: training state back to the device, the ``ActorWorker``
   claims the scored groups and updates, then the sync; its metrics include the sync's
   (``weight_sync/*``, ``reshard/*``).

Both reuse the stage workers of the separate processes unchanged; the dock consumers are the
same (``rollout``, ``actor``). In-process, the driver runs ``generation`` first and ``update``
last among its workers; as a process (``dockrl worker --stage hybrid``) ``run_hybrid`` serves
the driver's iterations and reports ``ROLLOUT`` and ``ACTOR`` as the two separate processes
would, with no ``WEIGHT_SYNC`` report and no weight channel.

With ``parallel.tp × pp × dp > 1`` (distributed mode) the launcher starts one such process per
actor rank; they join one process group, and megatron shards the model over TP/PP and
replicates it over DP. Each rank holds a full vLLM copy (TP' = 1; vLLM sees the extra ranks as
external data parallelism) and generates for its share of the prompts; the ranks of one model
replica train on the same claimed rows (``ReplicaDock``), each replica on its part of the
batch, and the allgather–swap gathers the shards into every rank's copy.
"""

from __future__ import annotations

import logging
import os
import time
from pathlib import Path
from typing import Any, Callable, Sequence

import torch
import torch.distributed as dist

from dockrl.checkpoint.optimizer_state import load_optimizer, save_optimizer
from dockrl.checkpoint.resume import checkpoint_dir, checkpoint_due, final_dir, prepare_checkpoint, weights_path
from dockrl.config import Config
from dockrl.dock import Claim, Dock, StageDock
from dockrl.engines.factory import build_rollout_engine, build_train_engine
from dockrl.engines.hybrid import HybridActor
from dockrl.parallel.ranks import ProcessRanks
from dockrl.rewards.guard import build_scorer
from dockrl.run.setup import load_run_prompts, resolve_data, resolve_model
from dockrl.stages.actor import ActorWorker
from dockrl.stages.dynamic_sampling import groups_per_round
from dockrl.stages.evaluate import evaluate
from dockrl.stages.loop import Report, final_report, serve_iterations
from dockrl.stages.rollout import RolloutWorker, rollout_metrics

logger = logging.getLogger(__name__)


def mean_over_replicas(metrics: dict[str, float], group: dist.ProcessGroup | None) -> dict[str, float]:
    """The actor metrics of all data-parallel replicas in ``group`` as one set (a collective):
    ``*_max`` and ``timing_s/*`` the largest, ``perf/*`` (tokens per second) the sum, the rest
    (token means, the gradient norm, which is the same on all) the mean over replicas."""
    parts: list[Any] = [None] * dist.get_world_size(group)
    dist.all_gather_object(parts, metrics, group=group)
    merged = {}
    for key in metrics:
        values = [p[key] for p in parts]
        if key.endswith("_max") or key.startswith("timing_s/"):
            merged[key] = max(values)
        elif key.startswith("perf/"):
            merged[key] = sum(values)
        else:
            merged[key] = sum(values) / len(values)
    return merged


class UpdateThenSync:
    """The actor role of the hybrid: back to training, update on the scored groups, sync.

    Args:
        dp_group: with data-parallel replicas, their process group: the update's metrics are
            merged over it (``mean_over_replicas``) before the sync's are added.
    """

    def __init__(self, actor: HybridActor, worker: ActorWorker, *, dp_group: dist.ProcessGroup | None = None) -> None:
        self.actor, self.worker, self.dp_group = actor, worker, dp_group

    def run_iteration(self, dock: StageDock, *, before_sync: Callable[[], None] | None = None) -> dict[str, float]:
        """Returns the ``ActorWorker`` metrics plus the sync's (``HybridActor.sync``).

        ``before_sync()`` runs after the update, while the training weights and optimizer are
        on the device (a checkpoint).

        Raises:
            PhaseError: called while training (twice in a row without generating).
        """
        start = time.perf_counter()
        self.actor.start_training()
        swap_in_s = time.perf_counter() - start
        metrics = self.worker.run_iteration(dock)
        if self.dp_group is not None:
            metrics = mean_over_replicas(metrics, self.dp_group)
        if before_sync is not None:
            before_sync()
        metrics |= self.actor.sync()
        metrics["timing_s/swap_in"] = swap_in_s
        return metrics


class ReplicaDock:
    """The dock as the ranks of one model replica (a TP/PP group) see it while they train together.

    Megatron's ranks of one data-parallel replica must pass the same rows (``MegatronTrainEngine``):
    rank ``src`` claims from the dock and broadcasts the claim (row indexes and cells, pickled
    Arrow) over ``group``; the other ranks receive it instead of claiming. Only ``src`` puts and
    acks, so every row is written once. ``num_rows`` and ``group_size`` come from the dock on
    every rank.

    Args:
        dock: this rank's dock client.
        rank: this process's global rank.
        group: the process group of the replica's ranks (None: the default group).
        src: global rank of the member that talks to the dock.
    """

    def __init__(self, dock: Dock, *, rank: int, group: dist.ProcessGroup | None = None, src: int = 0) -> None:
        self.dock, self.group, self.src = dock, group, src
        self.leader = rank == src

    @property
    def num_rows(self) -> int:
        return self.dock.num_rows

    @property
    def group_size(self) -> int:
        return self.dock.group_size

    def claim(
        self, consumer: str, columns: Sequence[str], count: int, *, whole_groups: bool = False, timeout_s: float | None = None,
    ) -> Claim:
        """``dock.claim`` on ``src``, the same claim on every rank (a collective over ``group``).

        Raises:
            RuntimeError: the claim failed on ``src`` (its error, re-raised on every rank, so
                that no rank waits for a claim that never comes).
        """
        box: list[Any] = [None]
        if self.leader:
            try:
                box[0] = self.dock.claim(consumer, columns, count, whole_groups=whole_groups, timeout_s=timeout_s)
            except Exception as e:  # noqa: BLE001 - travels to the other ranks, then raised here too
                box[0] = e
        dist.broadcast_object_list(box, src=self.src, group=self.group)
        if isinstance(box[0], Exception):
            if self.leader:
                raise box[0]
            raise RuntimeError(f"claim by {consumer!r} failed on actor rank {self.src}: {box[0]}")
        return box[0]

    def put(self, rows: Sequence[int], columns: Any, *, iteration: int | None = None, ack: Claim | None = None) -> None:
        if self.leader:
            self.dock.put(rows, columns, iteration=iteration, ack=ack)

    def ack(self, claim: Claim) -> None:
        if self.leader:
            self.dock.ack(claim)


class HybridWorker:
    """The hybrid actor's two roles as stage workers over one ``HybridActor``.

    Args:
        ranks: processes of the actor (TP × PP × DP); each generates with its own full
            inference copy (TP' = 1), claiming its share of the prompts.
        dp_group: with ``parallel.dp > 1``, megatron's data-parallel group of this rank: each
            replica updates on its part of the batch (``ActorWorker(replicas=dp)``).
    """

    def __init__(self, actor: HybridActor, cfg: Config, *, ranks: int = 1, dp_group: dist.ProcessGroup | None = None) -> None:
        self.actor = actor
        self.generation = RolloutWorker(actor.rollout_engine, cfg.rollout, shares=ranks, round_groups=groups_per_round(cfg))
        worker = ActorWorker(actor.train_engine, trainer=cfg.trainer, algo=cfg.algorithm, rollout=cfg.rollout, replicas=cfg.parallel.dp,
                             warmup_iterations=cfg.critic.warmup_iterations)
        self.update = UpdateThenSync(actor, worker, dp_group=dp_group)


def build_hybrid_worker(cfg: Config, model_path: Path, ranks: ProcessRanks, *, optimizer_from: Path | None = None) -> HybridWorker:
    """Megatron engine first, then vLLM (which joins the process's default group), then the first sync.

    Args:
        model_path: HF weights both engines start from (a checkpoint when resuming).
        ranks: this process's ranks with megatron's groups (``factory.process_ranks(trains=True)``).
        optimizer_from: a checkpoint whose optimizer state of this rank (``dockrl.checkpoint.resume``) is
            loaded into megatron's optimizer before the first sync swaps it out, so it is
            restored where it lives while training.

    Raises:
        ValueError: ``optimizer_from`` has no optimizer state for this rank.
    """
    train = build_train_engine(cfg, model_path, ranks)
    if optimizer_from is not None:
        load_optimizer(train, optimizer_from, rank=ranks.rank)
    rollout = build_rollout_engine(cfg, model_path, ranks)
    actor = HybridActor(train, rollout, bucket_bytes=cfg.parallel.bucket_mb << 20, infer_dtype=getattr(torch, cfg.rollout.dtype))
    return HybridWorker(actor, cfg, ranks=ranks.world_size, dp_group=ranks.dp_group)


def run_hybrid(cfg: Config, dock: Dock, ranks: ProcessRanks, weight_sync: str = "", first_wait_s: float | None = None) -> None:
    """The ``hybrid`` stage process, one per actor rank: evaluate, serve the iterations, checkpoint, evaluate again.

    Every rank generates for its share of the prompts; rank 0 reports ``rollout`` (metrics over
    all ranks' responses) once all generated, and ``actor`` once they updated and synced (so the
    driver merges the same metrics as from two processes). The ranks train on the same rows
    (``ReplicaDock``) and write checkpoints while training, before the sync (megatron gathers
    its shards; each rank its own optimizer state). The evaluations run on rank 0, as the
    rollout process's do.
    """
    model_path = resolve_model(cfg)
    train_file, test_file = resolve_data(cfg)
    rank, world = ranks.rank, ranks.world_size  # joined by the entry point: parallel.tp × pp × dp ranks, one process each
    if world > 1 and ranks.device.type == "cpu" and not cfg.run.num_threads:
        torch.set_num_threads(max(1, len(os.sched_getaffinity(0)) // world))  # ranks that each take all cores generate ~10× slower
    resume = Path(cfg.run.resume) if cfg.run.resume else None  # a checkpoint folder: the driver resolves 'latest'
    hybrid = build_hybrid_worker(cfg, weights_path(cfg, model_path), ranks, optimizer_from=resume)
    engine = hybrid.actor.rollout_engine
    _, test_prompts = load_run_prompts(cfg, engine.tokenizer, train_file, test_file, tools=[])  # the config refuses an environment here
    scorer = build_scorer(cfg.algorithm, cfg.env.sandbox.backend)
    t = cfg.trainer
    update_dock: StageDock = dock
    if cfg.parallel.tp * cfg.parallel.pp > 1:  # the ranks of one model replica train on the same rows
        update_dock = ReplicaDock(dock, rank=rank, group=ranks.model_group, src=ranks.model_leader)

    def save(path: Path) -> None:
        if rank == 0:
            prepare_checkpoint(path)
        hybrid.actor.save(path)  # a collective: rank 0 writes the HF weights
        save_optimizer(hybrid.actor, path, rank=rank)

    def step(it: int) -> dict[str, float]:
        lengths, truncated, seconds = hybrid.generation.generate_iteration(dock)
        logger.info("rank %d generated %d responses in %.1f s", rank, len(lengths), seconds)
        if world > 1:  # the rollout metrics cover every rank's responses
            parts: list[Any] = [None] * world
            dist.all_gather_object(parts, (lengths, truncated, seconds))
            lengths, truncated, seconds = [n for p in parts for n in p[0]], sum(p[1] for p in parts), max(p[2] for p in parts)
        if rank == 0:
            dock.report(it, Report.ROLLOUT, rollout_metrics(lengths, truncated, seconds))
        before_sync = (lambda: save(checkpoint_dir(cfg.run.output_dir, it + 1))) if checkpoint_due(t, it) else None
        return hybrid.update.run_iteration(update_dock, before_sync=before_sync)

    def checkpoint(it: int) -> None:
        if checkpoint_due(t, it) and rank == 0:  # the driver snapshots the dock once this is reported
            dock.report(it, Report.CHECKPOINT, {})

    try:
        if t.eval_before and resume is None and rank == 0:  # the driver waits for it on a fresh run only
            dock.report(0, Report.EVAL_BEFORE, evaluate(engine, test_prompts, scorer, cfg, "before"))
        serve_iterations(dock, Report.ACTOR, step, timeout_s=cfg.dock.timeout_s, after_report=checkpoint, seed=t.seed, report=rank == 0,
                         first_timeout_s=first_wait_s)
        hybrid.actor.start_training()  # the final weights are saved from where they train
        save(final_dir(cfg.run.output_dir))  # weights and optimizer; the driver completes it
        if t.eval_after:
            hybrid.actor.sync()  # back to generating; the last collective, so no rank waits through the evaluation
            if rank == 0:
                dock.report(t.iterations, Report.EVAL_AFTER, evaluate(engine, test_prompts, scorer, cfg, "after"))
        if rank == 0:
            dock.report(t.iterations, final_report("hybrid"), {})
    finally:
        scorer.close()
        hybrid.actor.close()
