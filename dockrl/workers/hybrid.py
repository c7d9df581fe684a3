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
last among its workers; as a process (``python -m dockrl.workers.main --stage hybrid``)
``run_hybrid`` serves the driver's iterations and reports ``rollout`` and ``actor`` as the two
separate processes would, with no ``weight_sync`` report and no weight channel.
"""

from __future__ import annotations

import logging
import time
from pathlib import Path

import torch

from dockrl.config import Config
from dockrl.dock import TransferDock
from dockrl.engines.hybrid import HybridActor
from dockrl.workers.actor import ActorWorker
from dockrl.workers.rollout import RolloutWorker

logger = logging.getLogger(__name__)


class UpdateThenSync:
    """The actor role of the hybrid: back to training, update on the scored groups, sync."""

    def __init__(self, actor: HybridActor, worker: ActorWorker) -> None:
        self.actor, self.worker = actor, worker

    def run_iteration(self, dock: TransferDock) -> dict[str, float]:
        """Returns the ``ActorWorker`` metrics plus the sync's (``HybridActor.sync``).

        Raises:
            PhaseError: called while training (twice in a row without generating).
        """
        start = time.perf_counter()
        self.actor.start_training()
        swap_in_s = time.perf_counter() - start
        metrics = self.worker.run_iteration(dock)
        metrics |= self.actor.sync()
        metrics["timing_s/swap_in"] = swap_in_s
        return metrics


class HybridWorker:
    """The hybrid actor's two roles as stage workers over one ``HybridActor``."""

    def __init__(self, actor: HybridActor, cfg: Config) -> None:
        self.actor = actor
        self.generation = RolloutWorker(actor.rollout_engine, cfg.rollout)
        self.update = UpdateThenSync(actor, ActorWorker(actor.train_engine, trainer=cfg.trainer, algo=cfg.algorithm, rollout=cfg.rollout))


def build_hybrid_worker(cfg: Config, model_path: Path) -> HybridWorker:
    """Megatron engine first (it creates this process's group of one), then vLLM (which joins it), then the first sync."""
    from dockrl.engines.factory import build_rollout_engine, build_train_engine

    train = build_train_engine(cfg, model_path)
    rollout = build_rollout_engine(cfg, model_path)
    p = cfg.parallel
    actor = HybridActor(
        train, rollout, infer_tp=p.infer_tp, dp=p.dp, device=torch.device(p.device), bucket_bytes=p.bucket_mb << 20,
        infer_dtype=getattr(torch, cfg.rollout.dtype),
    )
    return HybridWorker(actor, cfg)


def run_hybrid(cfg: Config, dock) -> None:
    """The ``hybrid`` stage process: evaluate, serve the iterations, checkpoint, evaluate again.

    Reports ``rollout`` once it generated and ``actor`` once it updated and synced (so the
    driver merges the same metrics as from two processes); ``BEFORE_TRAINING``/``AFTER_TRAINING``
    evaluations under ``rollout``, as the rollout process does.
    """
    from dockrl.resume import CHECKPOINT_STAGE, checkpoint_dir, checkpoint_due, save_optimizer
    from dockrl.trainer import build_scorer, evaluate, load_run_prompts, resolve_data, resolve_model
    from dockrl.workers.main import AFTER_TRAINING, BEFORE_TRAINING, serve_iterations

    model_path = resolve_model(cfg)
    train_file, test_file = resolve_data(cfg)
    hybrid = build_hybrid_worker(cfg, model_path)
    engine = hybrid.actor.rollout_engine
    _, test_prompts = load_run_prompts(cfg, engine.tokenizer, train_file, test_file)
    scorer = build_scorer(cfg.algorithm)
    t = cfg.trainer
    checkpoints = Path(cfg.run.output_dir) / "checkpoints"

    def step(it: int) -> dict[str, float]:
        dock.report(it, "rollout", hybrid.generation.run_iteration(dock))
        return hybrid.update.run_iteration(dock)

    def checkpoint(it: int) -> None:
        if checkpoint_due(t, it):  # the driver snapshots the dock once this is reported
            save_optimizer(hybrid.actor, hybrid.actor.save(checkpoint_dir(cfg.run.output_dir, it + 1)))
            dock.report(it, CHECKPOINT_STAGE, {})

    try:
        if t.eval_before:
            dock.report(BEFORE_TRAINING, "rollout", evaluate(engine, test_prompts, scorer, cfg, "before"))
        serve_iterations(dock, "actor", step, timeout_s=cfg.dock.timeout_s, after_report=checkpoint, seed=t.seed)
        hybrid.actor.save(checkpoints / "final")
        dock.report(AFTER_TRAINING, "rollout", evaluate(engine, test_prompts, scorer, cfg, "after") if t.eval_after else {})
    finally:
        scorer.close()
        hybrid.actor.close()
