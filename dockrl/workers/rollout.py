"""Rollout stage: claim prompts, sample one response per row, put responses and log-probs.

Rows of a group carry the same prompt, so a whole-group claim yields the n samples of GRPO.
"""

from __future__ import annotations

import time

from dockrl.config import RolloutConfig
from dockrl.dock import TransferDock
from dockrl.engines.protocols import RolloutEngine


class RolloutWorker:
    def __init__(self, engine: RolloutEngine, cfg: RolloutConfig) -> None:
        self.engine, self.cfg = engine, cfg

    def run_iteration(self, dock: TransferDock) -> dict[str, float]:
        """Generate for every row of the open iteration; returns ``rollout/*`` metrics."""
        start, lengths, truncated = time.perf_counter(), [], 0
        count = max(self.cfg.batch_size // dock.group_size, 1) * dock.group_size
        while claim := dock.claim("rollout", ["prompt_ids"], count, whole_groups=True):
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
        seconds = time.perf_counter() - start
        return {
            "rollout/response_length_mean": sum(lengths) / len(lengths),
            "rollout/response_length_max": max(lengths),
            "rollout/truncated_ratio": truncated / len(lengths),
            "perf/rollout_tokens_per_s": sum(lengths) / seconds,
            "timing_s/rollout": seconds,
        }
