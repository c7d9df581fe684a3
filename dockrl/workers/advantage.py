"""Advantage stage: claim the iteration's scored responses (whole groups), put per-token
``advantages`` of ``algorithm.adv_estimator`` (``dockrl.algorithms.compute_advantages``).

The claim asks for every row of the iteration, so REINFORCE++'s batch whitening spans the
whole batch. With ``algorithm.kl_in_reward_coef > 0`` the KL penalty per token is that of the
rollout's log-probs (the policy that sampled) to the reference's. With ``gae`` it reads the
critic's ``values`` and puts the ``returns`` the critic trains on (``dockrl/workers/critic.py``).
"""

from __future__ import annotations

import time

import torch

from dockrl.algorithms import compute_advantages, kl_penalty
from dockrl.config import AlgorithmConfig
from dockrl.dock import StageDock


def _padded(rows: list[list[float]], T: int) -> torch.Tensor:
    out = torch.zeros((len(rows), T), dtype=torch.float32)
    for i, r in enumerate(rows):
        out[i, : len(r)] = torch.tensor(r, dtype=torch.float32)
    return out


class AdvantageWorker:
    def __init__(self, cfg: AlgorithmConfig) -> None:
        self.cfg = cfg

    def run_iteration(self, dock: StageDock) -> dict[str, float]:
        """Compute the advantages of every row; returns ``rollout/frac_zero_std_groups`` and timing."""
        start, groups, zero_std = time.perf_counter(), 0, 0
        n, kl_in_reward, gae = dock.group_size, self.cfg.kl_in_reward_coef > 0, self.cfg.adv_estimator == "gae"
        columns = ["rm_score", "response_ids"] + (["rollout_log_prob", "ref_log_prob"] if kl_in_reward else []) + (["values"] if gae else [])
        while claim := dock.claim("advantage", columns, dock.num_rows, whole_groups=True):
            scores = torch.tensor(claim.batch.column("rm_score").to_pylist(), dtype=torch.float64)
            lengths = [len(r) for r in claim.batch.column("response_ids").to_pylist()]
            T = max(max(lengths, default=1), 1)
            mask = (torch.arange(T).unsqueeze(0) < torch.tensor(lengths).unsqueeze(1)).float()
            kl = None
            if kl_in_reward:
                policy, ref = (_padded(claim.batch.column(c).to_pylist(), T) for c in ("rollout_log_prob", "ref_log_prob"))
                kl = kl_penalty(policy, ref, self.cfg.kl_penalty) * mask
            values = _padded(claim.batch.column("values").to_pylist(), T) if gae else None
            adv, returns = compute_advantages(self.cfg, scores, mask, group_size=n, values=values, kl=kl)
            out = {"advantages": [row[:k] for row, k in zip(adv.tolist(), lengths)]}
            if gae:  # the critic's target, claimed by its update
                out["returns"] = [row[:k] for row, k in zip(returns.tolist(), lengths)]
            dock.put(claim.rows, out, ack=claim)
            per_group = scores.view(-1, n)
            groups += per_group.shape[0]
            zero_std += int((per_group.max(dim=1).values == per_group.min(dim=1).values).sum())
        return {"rollout/frac_zero_std_groups": zero_std / groups, "timing_s/advantage": time.perf_counter() - start}
