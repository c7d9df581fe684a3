"""Reward stage: claim responses, score them with the rule verifier, put ``rm_score`` and ``correct``."""

from __future__ import annotations

import time

from dockrl.dock import TransferDock
from dockrl.rewards import RewardScorer


class RewardWorker:
    """Args: ``correct_reward`` — a score at or above it means a correct answer (the config
    requires ``correct_reward > format_reward``), so correctness needs no second, untimed
    verifier call."""

    def __init__(self, scorer: RewardScorer, tokenizer, *, correct_reward: float, batch_size: int = 64) -> None:
        self.scorer, self.tokenizer, self.batch_size = scorer, tokenizer, batch_size
        self.correct_reward = correct_reward

    def run_iteration(self, dock: TransferDock) -> dict[str, float]:
        """Score every row of the open iteration; returns ``reward/*`` metrics."""
        start, scores, correct = time.perf_counter(), [], []
        before = self.scorer.counters()
        while claim := dock.claim("reward", ["response_ids", "ground_truth"], self.batch_size):
            texts = self.tokenizer.batch_decode(claim.batch.column("response_ids").to_pylist(), skip_special_tokens=True)
            truths = claim.batch.column("ground_truth").to_pylist()
            batch_scores = self.scorer.score(texts, truths)
            batch_correct = [score >= self.correct_reward for score in batch_scores]
            dock.put(claim.rows, {"rm_score": batch_scores, "correct": batch_correct}, ack=claim)
            scores += batch_scores
            correct += batch_correct
        after = self.scorer.counters()
        n = len(scores)
        mean = sum(scores) / n
        return {
            "reward/mean": mean,
            "reward/std": (sum((s - mean) ** 2 for s in scores) / n) ** 0.5,
            "reward/accuracy": sum(correct) / n,
            "reward/verifier_timeouts": after["timeouts"] - before["timeouts"],
            "reward/verifier_errors": after["errors"] - before["errors"],
            "timing_s/reward": time.perf_counter() - start,
        }
