"""Reward stage: claim responses, score them, check the rewards, put ``rm_score`` and ``correct``.

With ``reward_model.enable`` it claims the reward model's ``rm_model_score`` too and puts their
weighted sum (``RewardWorker``). As a process of its own (``run_reward``) it computes the group
advantages too (``AdvantageWorker``).
"""

from __future__ import annotations

import time
from collections import Counter

import torch

from dockrl.algorithms.dapo import overlong_penalty
from dockrl.config import AlgorithmConfig, Config, OverlongBufferConfig, RewardModelConfig, multi_turn
from dockrl.dock import Dock, StageDock
from dockrl.engines.hf.load import load_tokenizer
from dockrl.parallel.ranks import ProcessRanks
from dockrl.rewards.guard import Scorer, ScorerError, build_scorer, check_rewards
from dockrl.run.setup import resolve_model
from dockrl.stages.advantage import AdvantageWorker
from dockrl.stages.dynamic_sampling import SideBySide, divisor_at_most, groups_per_round
from dockrl.stages.inprocess import InProcessContext, InProcessParts
from dockrl.stages.loop import Report, final_report, serve_iterations, snapshot_after

BUILT_IN = "the built-in GSM8K verifier"


class RewardWorker:
    """Args: ``correct_reward`` — a score at or above it means a correct answer (the config
    requires ``correct_reward > format_reward``), so correctness needs no second, untimed
    verifier call. ``max_bad_frac`` — the iteration fails (``ScorerError`` naming
    ``scorer_name``) once more than this fraction of its rewards were bad: not a finite number
    or missing (``dockrl.rewards.guard.check_rewards``), timed out or failed (the scorer's counters).
    ``model_weight`` — None: ``rm_score`` is the rule reward; else the row's reward-model score
    (column ``rm_model_score``) is claimed too and ``rm_score = rule_weight · rule + model_weight · model``
    (``correct`` stays the rule's verdict). ``overlong`` with ``max_length``
    (``rollout.max_response_length``) — DAPO's soft overlong punishment added to every score
    (``dockrl.algorithms.dapo.overlong_penalty``). ``round_rows`` — with dynamic sampling, the rows
    of a round (``trainer.global_batch × rollout.n``): claims take a number of rows dividing it, so
    none waits for a round not yet released (``dockrl.stages.dynamic_sampling``); 0: no rounds.
    ``multi_turn`` — the rows are multi-turn trajectories: the verifier sees the text of the
    **last model turn** alone (the answer; earlier turns are tool calls, and observations are not
    the model's text), and the environment's rewards of every turn (``turn_rewards``) are added:
    ``rm_score = verifier(last turn) + Σ turn rewards`` (``correct`` stays the verifier's verdict).
    ``sessions`` — the rows are the gateway's sessions (``env.agent.command``): a row whose ``session_reward`` the rollout
    decided (the agent posted it, or the session failed) gets it as ``rm_score`` alone, unscored, ``correct`` when it
    reaches ``correct_reward``."""

    def __init__(self, scorer: Scorer, tokenizer, *, correct_reward: float, batch_size: int = 64,
                 max_bad_frac: float = 1.0, scorer_name: str = "", model_weight: float | None = None,
                 rule_weight: float = 1.0, overlong: OverlongBufferConfig | None = None, max_length: int = 0,
                 round_rows: int = 0, multi_turn: bool = False, sessions: bool = False) -> None:
        self.scorer, self.tokenizer, self.batch_size, self.multi_turn = scorer, tokenizer, batch_size, multi_turn or sessions
        self.sessions = sessions
        self.correct_reward, self.max_bad_frac, self.scorer_name = correct_reward, max_bad_frac, scorer_name
        self.model_weight, self.rule_weight = model_weight, rule_weight
        self.overlong = overlong if overlong is not None and overlong.enable else None
        self.max_length = max_length
        if round_rows:
            self.batch_size = divisor_at_most(round_rows, batch_size)

    @classmethod
    def from_config(cls, scorer: Scorer, tokenizer, a: AlgorithmConfig, rm: RewardModelConfig | None = None,
                    cfg: Config | None = None) -> RewardWorker:
        """``cfg``: the run's config, for DAPO's overlong shaping and dynamic sampling (``a`` is its ``algorithm``)."""
        weights = (rm.model_weight, rm.rule_weight) if rm is not None and rm.enable else (None, 1.0)
        return cls(scorer, tokenizer, correct_reward=a.correct_reward, max_bad_frac=a.max_bad_reward_frac, scorer_name=a.scorer,
                   model_weight=weights[0], rule_weight=weights[1], overlong=a.overlong_buffer,
                   max_length=cfg.rollout.max_response_length if cfg else 0,
                   round_rows=groups_per_round(cfg) * cfg.rollout.n if cfg else 0, multi_turn=multi_turn(cfg.env) if cfg else False,
                   sessions=bool(cfg.env.agent.command) if cfg else False)

    def run_iteration(self, dock: StageDock) -> dict[str, float]:
        """Score every row of the open iteration; returns ``reward/*`` metrics.

        Raises:
            ScorerError: more than ``max_bad_frac`` of the rewards were bad (the message counts them by reason).
        """
        start, scores, rules, correct, bad, penalties, env = time.perf_counter(), [], [], [], Counter[str](), 0.0, 0.0
        decided_total = 0
        before = self.scorer.counters()
        columns = (["response_ids", "ground_truth"] + ([] if self.model_weight is None else ["rm_model_score"])
                   + (["turn_starts", "turn_ends", "turn_rewards"] if self.multi_turn else [])
                   + (["session_reward"] if self.sessions else []))
        while claim := dock.claim("reward", columns, self.batch_size):
            responses = claim.batch.column("response_ids").to_pylist()
            decided = claim.batch.column("session_reward").to_pylist() if self.sessions else [None] * len(responses)
            scored = [k for k, d in enumerate(decided) if d is None]  # the rows the scorer scores
            answers = [responses[k] for k in scored]
            if self.multi_turn:  # the last model turn's tokens: the answer the verifier checks
                starts, ends = claim.batch.column("turn_starts").to_pylist(), claim.batch.column("turn_ends").to_pylist()
                answers = [responses[k][starts[k][-1]:ends[k][-1]] for k in scored]
            texts = self.tokenizer.batch_decode(answers, skip_special_tokens=True)
            truths = claim.batch.column("ground_truth").to_pylist()
            rules_scored, batch_bad = check_rewards(self.scorer.score(texts, [truths[k] for k in scored]), len(texts)) if scored else ([], Counter())
            bad += batch_bad
            batch_rules = list(decided)
            for k, score in zip(scored, rules_scored):
                batch_rules[k] = score
            decided_total += len(responses) - len(scored)
            batch_correct = [score >= self.correct_reward for score in batch_rules]
            batch_scores = list(batch_rules)
            if self.model_weight is not None:
                model = claim.batch.column("rm_model_score").to_pylist()
                batch_scores = [r if d is not None else self.rule_weight * r + self.model_weight * m
                                for r, m, d in zip(batch_rules, model, decided)]
            if self.overlong is not None:
                o = self.overlong
                penalty = overlong_penalty(torch.tensor([len(r) for r in responses]), max_length=self.max_length,
                                           buffer_length=o.len, penalty_factor=o.penalty_factor).tolist()
                penalty = [0.0 if d is not None else p for p, d in zip(penalty, decided)]
                batch_scores = [score + p for score, p in zip(batch_scores, penalty)]
                penalties += sum(penalty)
            if self.multi_turn:
                turn_rewards = [0.0 if d is not None else sum(r) for r, d in zip(claim.batch.column("turn_rewards").to_pylist(), decided)]
                batch_scores = [score + r for score, r in zip(batch_scores, turn_rewards)]
                env += sum(turn_rewards)
            dock.put(claim.rows, {"rm_score": batch_scores, "correct": batch_correct}, ack=claim)
            scores += batch_scores
            rules += batch_rules
            correct += batch_correct
        after = self.scorer.counters()
        n = len(scores)
        timeouts, errors = after["timeouts"] - before["timeouts"], after["errors"] - before["errors"]
        bad_total = sum(bad.values()) + timeouts + errors
        if bad_total > self.max_bad_frac * n:
            reasons = dict(bad) | ({"timed out": timeouts} if timeouts else {}) | ({"failed": errors} if errors else {})
            name = f"algorithm.scorer={self.scorer_name!r}" if self.scorer_name else f"algorithm.scorer ({BUILT_IN})"
            raise ScorerError(
                f"{name}: {bad_total} of {n} rewards of this iteration were bad ({', '.join(f'{k}: {v}' for k, v in reasons.items())}), "
                f"more than algorithm.max_bad_reward_frac={self.max_bad_frac:g}; a scorer must return one finite number per "
                "response within algorithm.reward_timeout_s each: fix the scorer (or raise the limit)"
            )
        mean = sum(scores) / n
        combined = {} if self.model_weight is None else {"reward/rule_mean": sum(rules) / n}
        return combined | {
            "reward/mean": mean,
            "reward/std": (sum((s - mean) ** 2 for s in scores) / n) ** 0.5,
            "reward/accuracy": sum(correct) / n,
            "reward/verifier_timeouts": timeouts,
            "reward/verifier_errors": errors,
            "reward/invalid": sum(bad.values()),
            **({"reward/overlong_penalty_mean": penalties / n} if self.overlong is not None else {}),
            **({"reward/env_mean": env / n, "reward/verifier_mean": sum(rules) / n} if self.multi_turn else {}),
            **({"reward/sessions_decided": decided_total} if self.sessions else {}),
            "timing_s/reward": time.perf_counter() - start,
        }


def run_reward(cfg: Config, dock: Dock, ranks: ProcessRanks, weight_sync: str = "", first_wait_s: float | None = None) -> None:
    """The ``reward`` stage process: score and compute the advantages of every iteration (``REWARD``)."""
    tokenizer = load_tokenizer(resolve_model(cfg), cfg.model.trust_remote_code)
    scorer = build_scorer(cfg.algorithm, cfg.env.sandbox.backend)
    reward = RewardWorker.from_config(scorer, tokenizer, cfg.algorithm, cfg.reward_model, cfg)
    advantage = AdvantageWorker(cfg.algorithm, multi_turn=multi_turn(cfg.env), teacher=cfg.teacher)
    side_by_side = None  # the advantage stage releases the rounds the reward scores: side by side, threads kept for the run
    if cfg.algorithm.filter_groups.enable:
        side_by_side = SideBySide([reward, advantage], timeout_s=cfg.dock.timeout_s)

    def step(_: int) -> dict[str, float]:
        if side_by_side is not None:
            return side_by_side.run_iteration(dock)
        return reward.run_iteration(dock) | advantage.run_iteration(dock)

    try:
        serve_iterations(dock, Report.REWARD, step, timeout_s=cfg.dock.timeout_s, seed=cfg.trainer.seed, first_timeout_s=first_wait_s,
                         hold=snapshot_after(cfg))
        dock.report(cfg.trainer.iterations, final_report("reward"), {})
    finally:
        if side_by_side is not None:
            side_by_side.close()
        scorer.close()


def inprocess_parts(ctx: InProcessContext) -> InProcessParts:
    """The stage in-process: it scores with the rollout, with the run's scorer (the one the evaluation uses)."""
    cfg = ctx.cfg
    return InProcessParts(sample=[RewardWorker.from_config(ctx.scorer, ctx.tokenizer, cfg.algorithm, cfg.reward_model, cfg)])
