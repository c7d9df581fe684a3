"""Reference stage: claim responses, put their log-probs under the frozen initial policy.

Only started when a KL term needs it (``algorithm.kl_loss_coef`` or ``kl_in_reward_coef`` > 0).
"""

from __future__ import annotations

import time

from dockrl.config import Config
from dockrl.dock import Dock, StageDock
from dockrl.engines.factory import build_reference_engine
from dockrl.engines.train_engine import ScoringEngine
from dockrl.parallel.ranks import ProcessRanks
from dockrl.run.setup import resolve_model
from dockrl.stages.inprocess import InProcessContext, InProcessParts
from dockrl.stages.loop import Report, final_report, serve_iterations, snapshot_after


class ReferenceWorker:
    """Puts the log-prob of every response token under a frozen model: the reference's
    ``ref_log_prob``, or with ``consumer="teacher"`` and ``output="teacher_log_prob"`` the
    distillation teacher's (``dockrl/stages/teacher.py``), at the rollout's temperature, as the
    rollout's own log-probs are.

    Args: ``after_advantages`` — with dynamic sampling, claim rows once their advantages are
    written: the groups the advantage stage keeps, never those it filters out."""

    def __init__(self, engine: ScoringEngine, *, temperature: float, micro_batch: int, after_advantages: bool = False,
                 micro_batch_tokens: int = 0, consumer: str = "reference", output: str = "ref_log_prob") -> None:
        self.engine, self.temperature, self.micro_batch = engine, temperature, micro_batch
        self.micro_batch_tokens, self.consumer, self.output = micro_batch_tokens, consumer, output
        self.columns = ["prompt_ids", "response_ids"] + (["advantages"] if after_advantages else [])

    @classmethod
    def from_config(cls, engine: ScoringEngine, cfg: Config) -> ReferenceWorker:
        return cls(engine, temperature=cfg.rollout.temperature, micro_batch=cfg.trainer.micro_batch,
                   micro_batch_tokens=cfg.trainer.micro_batch_tokens, after_advantages=cfg.algorithm.filter_groups.enable)

    def run_iteration(self, dock: StageDock) -> dict[str, float]:
        start = time.perf_counter()
        while claim := dock.claim(self.consumer, self.columns, self.micro_batch * 4):
            lps = self.engine.log_probs(
                claim.batch.column("prompt_ids").to_pylist(),
                claim.batch.column("response_ids").to_pylist(),
                temperature=self.temperature,
                micro_batch=self.micro_batch,
                micro_batch_tokens=self.micro_batch_tokens,
            )
            dock.put(claim.rows, {self.output: lps}, ack=claim)
        return {f"timing_s/{self.consumer}": time.perf_counter() - start}


def run_reference(cfg: Config, dock: Dock, ranks: ProcessRanks, weight_sync: str = "", first_wait_s: float | None = None) -> None:
    """The ``reference`` stage process: log-probs under the initial weights every iteration (``REFERENCE``)."""
    worker = ReferenceWorker.from_config(build_reference_engine(cfg, resolve_model(cfg), ranks), cfg)
    serve_iterations(dock, Report.REFERENCE, lambda it: worker.run_iteration(dock), timeout_s=cfg.dock.timeout_s,
                     seed=cfg.trainer.seed, first_timeout_s=first_wait_s, hold=snapshot_after(cfg))
    dock.report(cfg.trainer.iterations, final_report("reference"), {})


def inprocess_parts(ctx: InProcessContext) -> InProcessParts:
    """The stage in-process: it scores after the rollout's stages, before the advantages; with LoRA
    on the actor's module with its adapters disabled (``build_reference_engine``'s ``actor``)."""
    engine = build_reference_engine(ctx.cfg, ctx.plan.model_path, ctx.ranks, actor=ctx.actor)
    return InProcessParts(score=[ReferenceWorker.from_config(engine, ctx.cfg)])
