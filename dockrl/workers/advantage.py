"""Advantage stage: claim whole groups of scores, put group-normalized advantages (GRPO)."""

from __future__ import annotations

import time

import torch

from dockrl.algorithms import grpo_advantages
from dockrl.config import AlgorithmConfig
from dockrl.dock import StageDock


class AdvantageWorker:
    def __init__(self, cfg: AlgorithmConfig) -> None:
        self.cfg = cfg

    def run_iteration(self, dock: StageDock) -> dict[str, float]:
        """Compute advantages for every group; returns ``rollout/frac_zero_std_groups``."""
        start, groups, zero_std = time.perf_counter(), 0, 0
        n = dock.group_size
        while claim := dock.claim("advantage", ["rm_score"], dock.num_rows, whole_groups=True):
            scores = torch.tensor(claim.batch.column("rm_score").to_pylist(), dtype=torch.float64)
            adv = grpo_advantages(scores, n, eps=self.cfg.adv_eps, norm_by_std=self.cfg.norm_adv_by_std)
            dock.put(claim.rows, {"advantages": adv.tolist()}, ack=claim)
            per_group = scores.view(-1, n)
            groups += per_group.shape[0]
            zero_std += int((per_group.max(dim=1).values == per_group.min(dim=1).values).sum())
        return {"rollout/frac_zero_std_groups": zero_std / groups, "timing_s/advantage": time.perf_counter() - start}
