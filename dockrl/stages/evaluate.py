"""Greedy accuracy on a test split: the number the demo reports before and after training; with
an environment, of greedy multi-turn trajectories (the rollout's loop, ``dockrl.stages.multi_turn``).
"""

from __future__ import annotations

import logging
from typing import Sequence

from dockrl.config import Config
from dockrl.engines.rollout_engine import RolloutEngine
from dockrl.envs.base import Environment
from dockrl.rewards import extract_final_answer
from dockrl.rewards.guard import Scorer, check_rewards
from dockrl.run.data import Prompt
from dockrl.stages.multi_turn import ObservationTokens, TurnLimits, roll_out

logger = logging.getLogger(__name__)


def greedy_accuracy(
    engine: RolloutEngine,
    prompts: Sequence[Prompt],
    scorer: Scorer,
    *,
    correct_reward: float,
    max_new_tokens: int,
    batch_size: int,
) -> dict[str, float]:
    """Greedy-decode every prompt and score it with the strict GSM8K verifier.

    Scoring goes through ``scorer`` (per-sample timeout); a score ≥ ``correct_reward`` is a
    correct answer.

    Returns:
        ``accuracy`` (fraction correct) and ``format_rate`` (fraction with a '#### <number>'
        final answer), both in [0, 1], and ``count``.
    """
    if not prompts:
        raise ValueError("greedy_accuracy: no test prompts")
    samples = engine.generate([p.prompt_ids for p in prompts], max_new_tokens=max_new_tokens, greedy=True, batch_size=batch_size)
    texts = engine.tokenizer.batch_decode([s.response_ids for s in samples], skip_special_tokens=True)
    scores, _ = check_rewards(scorer.score(texts, [p.ground_truth for p in prompts]), len(prompts))  # a bad value: not correct
    correct = sum(score >= correct_reward for score in scores)
    formatted = sum(extract_final_answer(t) is not None for t in texts)
    return {"accuracy": correct / len(prompts), "format_rate": formatted / len(prompts), "count": len(prompts)}


def multi_turn_accuracy(
    engine: RolloutEngine,
    prompts: Sequence[Prompt],
    scorer: Scorer,
    environment: Environment,
    limits: TurnLimits,
    *,
    correct_reward: float,
    batch_size: int,
) -> dict[str, float]:
    """Greedy multi-turn trajectories of every prompt in ``environment`` (``roll_out``, as the rollout
    generates them), the last model turn of each scored with the verifier, as the reward stage does.

    Returns:
        ``accuracy`` and ``format_rate`` (as ``greedy_accuracy``), ``count``, and per trajectory
        ``turns_mean`` (model turns), ``tool_calls_mean``, ``tool_errors_mean`` and ``tool_calls_right_mean`` (calls
        that returned the reference answer).

    Raises:
        ValueError: no prompts.
        EnvironmentFailure: the environment broke.
    """
    if not prompts:
        raise ValueError("multi-turn evaluation: no test prompts")
    episodes = []
    try:
        episodes = [environment.open(p.ground_truth) for p in prompts]
        trajectories = roll_out(engine, [p.prompt_ids for p in prompts], episodes, ObservationTokens(engine.tokenizer, tools=environment.tools),
                                limits, greedy=True, batch_size=batch_size)
    finally:
        for episode in episodes:
            episode.close()
    answers = [t.response_ids[t.turn_starts[-1]:t.turn_ends[-1]] for t in trajectories]
    texts = engine.tokenizer.batch_decode(answers, skip_special_tokens=True)
    scores, _ = check_rewards(scorer.score(texts, [p.ground_truth for p in prompts]), len(prompts))
    n = len(prompts)
    return {"accuracy": sum(score >= correct_reward for score in scores) / n,
            "format_rate": sum(extract_final_answer(t) is not None for t in texts) / n, "count": n,
            "turns_mean": sum(t.turns for t in trajectories) / n, "tool_calls_mean": sum(t.tool_calls for t in trajectories) / n,
            "tool_errors_mean": sum(t.tool_errors for t in trajectories) / n,
            "tool_calls_right_mean": sum(t.tool_calls_right for t in trajectories) / n}


def evaluate(engine: RolloutEngine, prompts: Sequence[Prompt], scorer: Scorer, cfg: Config, tag: str,
             environment: Environment | None = None) -> dict[str, float]:
    """``greedy_accuracy`` as configured, as ``eval/accuracy_<tag>`` and ``eval/format_rate_<tag>``;
    with the run's ``environment``, ``multi_turn_accuracy`` under the rollout's turn limits, with
    ``eval/turns_mean_<tag>``, ``eval/tool_calls_mean_<tag>``, ``eval/tool_errors_mean_<tag>`` and
    ``eval/tool_calls_right_mean_<tag>`` besides."""
    r = cfg.rollout
    if environment is None:
        res = greedy_accuracy(engine, prompts, scorer, correct_reward=cfg.algorithm.correct_reward,
                              max_new_tokens=r.max_response_length, batch_size=cfg.trainer.eval_batch_size)
    else:
        limits = TurnLimits(max_turns=r.max_turns, max_turn_tokens=r.max_response_length, max_total_tokens=r.max_total_tokens)
        res = multi_turn_accuracy(engine, prompts, scorer, environment, limits, correct_reward=cfg.algorithm.correct_reward,
                                  batch_size=cfg.trainer.eval_batch_size)
    logger.info("greedy test accuracy %s training: %.3f (format %.3f, %d prompts)", tag, res["accuracy"], res["format_rate"], res["count"])
    return {f"eval/{name}_{tag}": float(value) for name, value in res.items() if name != "count"}
