"""Rollout stage: claim prompts, sample one response per row, put responses and log-probs.

Rows of a group carry the same prompt, so a whole-group claim yields the n samples of GRPO.
"""

from __future__ import annotations

import time
from typing import Sequence

from dockrl.config import RolloutConfig
from dockrl.dock import TransferDock
from dockrl.engines.protocols import RolloutEngine


def rollout_metrics(lengths: Sequence[int], truncated: int, seconds: float) -> dict[str, float]:
    """``rollout/*`` metrics of responses of ``lengths`` tokens, ``truncated`` of them cut at the
    length limit, generated in ``seconds`` (of wall clock).

    Raises:
        ValueError: no response.
    """
    if not lengths:
        raise ValueError("rollout metrics: no response was generated")
    return {
        "rollout/response_length_mean": sum(lengths) / len(lengths),
        "rollout/response_length_max": max(lengths),
        "rollout/truncated_ratio": truncated / len(lengths),
        "perf/rollout_tokens_per_s": sum(lengths) / seconds,
        "timing_s/rollout": seconds,
    }


class RolloutWorker:
    """Generates for the rows of an iteration, ``rollout.batch_size`` rows (whole groups) per claim.

    Args:
        shares: rollout replicas claiming from the same iteration; each claim takes at most
            ``1/shares`` of the iteration's groups, so that every replica gets work (the hybrid
            actor's ranks, each with a full inference copy, generate side by side).
    """

    def __init__(self, engine: RolloutEngine, cfg: RolloutConfig, *, shares: int = 1) -> None:
        self.engine, self.cfg, self.shares = engine, cfg, shares

    def generate_iteration(self, dock: TransferDock) -> tuple[list[int], int, float]:
        """Generate for rows of the open iteration until none is left to claim.

        Returns:
            response lengths (tokens), how many were truncated, seconds taken.
        """
        start, lengths, truncated = time.perf_counter(), [], 0
        groups = max(self.cfg.batch_size // dock.group_size, 1)
        if self.shares > 1:
            groups = min(groups, -(-dock.num_rows // (dock.group_size * self.shares)))
        while claim := dock.claim("rollout", ["prompt_ids"], groups * dock.group_size, whole_groups=True):
            prompts = claim.batch.column("prompt_ids").to_pylist()
            samples = self.engine.generate(
                prompts,
                max_new_tokens=self.cfg.max_response_length,
                temperature=self.cfg.temperature,
                top_p=self.cfg.top_p,
                batch_size=self.cfg.batch_size,
            )
            dock.put(
                claim.rows,
                {
                    "response_ids": [s.response_ids for s in samples],
                    "rollout_log_prob": [s.log_probs for s in samples],
                    "truncated": [s.truncated for s in samples],
                },
                ack=claim,  # acked with the put: a worker that dies before it leaves its rows to another
            )
            lengths += [len(s.response_ids) for s in samples]
            truncated += sum(s.truncated for s in samples)
        return lengths, truncated, time.perf_counter() - start

    def run_iteration(self, dock: TransferDock) -> dict[str, float]:
        """Generate for every row of the open iteration; returns ``rollout/*`` metrics (``rollout_metrics``)."""
        return rollout_metrics(*self.generate_iteration(dock))
