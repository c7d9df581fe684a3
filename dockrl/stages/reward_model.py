"""Reward-model stage: claim prompts and responses, score them with the frozen reward model, put ``rm_model_score``.

Only started with ``reward_model.enable``; the reward stage then waits for this column and
writes ``rm_score = rule_weight · rule + model_weight · rm_model_score`` (``dockrl/stages/reward.py``).
The model is a classifier (``HFRewardModel``) or, with ``reward_model.kind=generative``, a judge that writes a
verdict on each response (``GenerativeJudge``; it reads the rows' ``ground_truth`` too).
"""

from __future__ import annotations

import math
import time

from dockrl.config import Config
from dockrl.dock import Dock, StageDock
from dockrl.engines.hf.load import load_tokenizer
from dockrl.engines.judge import GenerativeJudge, build_judge
from dockrl.engines.reward_model import HFRewardModel, build_reward_model
from dockrl.parallel.ranks import ProcessRanks
from dockrl.run.setup import resolve_model, resolve_reward_model
from dockrl.stages.dynamic_sampling import divisor_at_most, groups_per_round
from dockrl.stages.inprocess import InProcessContext, InProcessParts
from dockrl.stages.loop import Report, final_report, serve_iterations, snapshot_after


class RewardModelWorker:
    """Args: ``micro_batch`` — rows per forward pass (a judge: per generate call) of the reward model; a claim
    takes four of them."""

    def __init__(self, model: HFRewardModel | GenerativeJudge, *, micro_batch: int, round_rows: int = 0) -> None:
        self.model, self.micro_batch = model, micro_batch
        self.columns = ["prompt_ids", "response_ids"] + (["ground_truth"] if isinstance(model, GenerativeJudge) else [])
        # dynamic sampling: a claim never waits for a round not yet released (dockrl.stages.dynamic_sampling)
        self.claim_rows = divisor_at_most(round_rows, micro_batch * 4) if round_rows else micro_batch * 4

    @classmethod
    def from_config(cls, model: HFRewardModel | GenerativeJudge, cfg: Config) -> RewardModelWorker:
        return cls(model, micro_batch=cfg.reward_model.micro_batch_size, round_rows=groups_per_round(cfg) * cfg.rollout.n)

    def run_iteration(self, dock: StageDock) -> dict[str, float]:
        """Score every row of the open iteration; returns ``reward_model/*`` metrics.

        Raises:
            ValueError: the reward model gave a score that is not a finite number (naming ``reward_model.model.path``).
        """
        start, scores, unparsed, verdict_tokens = time.perf_counter(), [], 0, 0
        while claim := dock.claim("reward_model", self.columns, self.claim_rows):
            prompts, responses = claim.batch.column("prompt_ids").to_pylist(), claim.batch.column("response_ids").to_pylist()
            if isinstance(self.model, GenerativeJudge):
                verdicts = self.model.verdicts(prompts, responses, claim.batch.column("ground_truth").to_pylist(),
                                               micro_batch=self.micro_batch)
                batch = [v.score for v in verdicts]
                unparsed += sum(not v.parsed for v in verdicts)
                verdict_tokens += sum(v.tokens for v in verdicts)
            else:
                batch = self.model.score(prompts, responses, micro_batch=self.micro_batch)
            bad = [s for s in batch if not math.isfinite(s)]
            if bad:
                raise ValueError(f"reward_model.model.path: the reward model scored {len(bad)} of {len(batch)} responses "
                                 f"{bad[0]}, not a finite number; check the checkpoint (and trainer.autocast_bf16)")
            dock.put(claim.rows, {"rm_model_score": batch}, ack=claim)
            scores += batch
        n = len(scores)
        mean = sum(scores) / n
        judge = {"reward_model/unparsed_frac": unparsed / n, "reward_model/verdict_tokens": verdict_tokens / n} \
            if isinstance(self.model, GenerativeJudge) else {}
        return judge | {
            "reward_model/score_mean": mean,
            "reward_model/score_std": (sum((s - mean) ** 2 for s in scores) / n) ** 0.5,
            "timing_s/reward_model": time.perf_counter() - start,
        }


def run_reward_model(cfg: Config, dock: Dock, ranks: ProcessRanks, weight_sync: str = "", first_wait_s: float | None = None) -> None:
    """The ``reward-model`` stage process: score every iteration's responses (``REWARD_MODEL``)."""
    tokenizer = load_tokenizer(resolve_model(cfg), cfg.model.trust_remote_code)
    worker = RewardModelWorker.from_config(reward_model(cfg, tokenizer, ranks), cfg)
    serve_iterations(dock, Report.REWARD_MODEL, lambda it: worker.run_iteration(dock), timeout_s=cfg.dock.timeout_s,
                     seed=cfg.trainer.seed, first_timeout_s=first_wait_s, hold=snapshot_after(cfg))
    dock.report(cfg.trainer.iterations, final_report("reward-model"), {})


def inprocess_parts(ctx: InProcessContext) -> InProcessParts:
    """The stage in-process: it scores with the rollout, before the reward stage that waits for it."""
    return InProcessParts(sample=[RewardModelWorker.from_config(reward_model(ctx.cfg, ctx.tokenizer, ctx.ranks), ctx.cfg)])


def reward_model(cfg: Config, policy_tokenizer: object, ranks: ProcessRanks) -> HFRewardModel | GenerativeJudge:
    """The run's reward model on this process's device: the classifier, or the judge (``reward_model.kind``)."""
    path = resolve_reward_model(cfg)
    if cfg.reward_model.kind == "generative":
        return build_judge(cfg, path, policy_tokenizer, ranks.device)
    return build_reward_model(cfg, path, policy_tokenizer, ranks)
