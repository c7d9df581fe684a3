"""Greedy accuracy on a test split: the number the demo reports before and after training."""

from __future__ import annotations

import logging
from typing import Sequence

from dockrl.config import Config
from dockrl.data import Prompt
from dockrl.engines.rollout_engine import RolloutEngine
from dockrl.rewards import extract_final_answer
from dockrl.rewards.guard import Scorer, check_rewards

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


def evaluate(engine: RolloutEngine, prompts: Sequence[Prompt], scorer: Scorer, cfg: Config, tag: str) -> dict[str, float]:
    """``greedy_accuracy`` as configured, as ``eval/accuracy_<tag>`` and ``eval/format_rate_<tag>``."""
    res = greedy_accuracy(
        engine, prompts, scorer, correct_reward=cfg.algorithm.correct_reward,
        max_new_tokens=cfg.rollout.max_response_length, batch_size=cfg.trainer.eval_batch_size,
    )
    logger.info("greedy test accuracy %s training: %.3f (format %.3f, %d prompts)", tag, res["accuracy"], res["format_rate"], res["count"])
    return {f"eval/accuracy_{tag}": res["accuracy"], f"eval/format_rate_{tag}": res["format_rate"]}
