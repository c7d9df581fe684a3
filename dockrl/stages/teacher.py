"""Teacher stage (on-policy distillation): claim the student's responses, put their log-probs under the teacher.

Only started with ``teacher.enable``. Shaped like the reference (``dockrl/stages/reference.py``,
whose worker it runs) over the teacher's own frozen model (``teacher.model.path``), on its own
device and, in a cluster, its own pod; the advantage stage reads ``teacher_log_prob`` beside the
rollout's log-probs (``dockrl.algorithms.distillation``).
"""

from __future__ import annotations

from dockrl.config import Config
from dockrl.dock import Dock
from dockrl.engines.factory import build_teacher_engine
from dockrl.engines.train_engine import ScoringEngine
from dockrl.parallel.ranks import ProcessRanks
from dockrl.run.setup import resolve_model, resolve_teacher
from dockrl.stages.inprocess import InProcessContext, InProcessParts
from dockrl.stages.loop import Report, final_report, serve_iterations, snapshot_after
from dockrl.stages.reference import ReferenceWorker


def teacher_worker(cfg: Config, engine: ScoringEngine) -> ReferenceWorker:
    """The teacher's worker: the reference's, as consumer ``teacher`` writing ``teacher_log_prob``."""
    return ReferenceWorker(engine, temperature=cfg.rollout.temperature, micro_batch=cfg.trainer.micro_batch,
                           micro_batch_tokens=cfg.trainer.micro_batch_tokens, consumer="teacher", output="teacher_log_prob")


def run_teacher(cfg: Config, dock: Dock, ranks: ProcessRanks, weight_sync: str = "", first_wait_s: float | None = None) -> None:
    """The ``teacher`` stage process: the teacher's log-probs of every iteration's responses (``TEACHER``).

    Raises:
        ConfigError: the teacher's folder or tokenizer does not fit (``resolve_teacher``).
    """
    worker = teacher_worker(cfg, build_teacher_engine(cfg, resolve_teacher(cfg, resolve_model(cfg)), ranks))
    serve_iterations(dock, Report.TEACHER, lambda it: worker.run_iteration(dock), timeout_s=cfg.dock.timeout_s,
                     seed=cfg.trainer.seed, first_timeout_s=first_wait_s, hold=snapshot_after(cfg))
    dock.report(cfg.trainer.iterations, final_report("teacher"), {})


def inprocess_parts(ctx: InProcessContext) -> InProcessParts:
    """The stage in-process: it scores after the rollout's stages, before the advantages."""
    engine = build_teacher_engine(ctx.cfg, resolve_teacher(ctx.cfg, ctx.plan.model_path), ctx.ranks)
    return InProcessParts(score=[teacher_worker(ctx.cfg, engine)])
