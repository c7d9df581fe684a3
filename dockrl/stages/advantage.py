"""Advantage stage: claim the iteration's scored responses (whole groups), put per-token
``advantages`` of ``algorithm.adv_estimator`` (``dockrl.algorithms.compute_advantages``).

The claim asks for every row of the iteration, so REINFORCE++'s batch whitening spans the
whole batch. With ``algorithm.kl_in_reward_coef > 0`` the KL penalty per token is that of the
rollout's log-probs (the policy that sampled) to the reference's. With ``gae`` it reads the
critic's ``values`` and puts the ``returns`` the critic trains on (``dockrl/stages/critic.py``). With a
distillation teacher (``teacher.enable``) each token's advantage gets the teacher's reverse-KL term,
``log p_teacher - log p_student`` with the rollout's log-probs as the student's
(``dockrl.algorithms.distillation.distillation_advantages``).
With dynamic sampling (``algorithm.filter_groups.enable``) the stage claims round by round, keeps
the groups that carry signal and computes the advantages of the trained batch alone
(``dockrl.stages.dynamic_sampling.DynamicSampler``).
"""

from __future__ import annotations

import time

import pyarrow as pa
import torch

from dockrl.algorithms import compute_advantages, kl_penalty, mixed_groups, response_mask, right_pad
from dockrl.algorithms.distillation import distillation_advantages
from dockrl.config import AlgorithmConfig, TeacherConfig
from dockrl.config.estimators import ESTIMATORS
from dockrl.dock import Dock
from dockrl.stages.dynamic_sampling import DynamicSampler


class AdvantageWorker:
    """Args: ``multi_turn`` — the rows are multi-turn trajectories (``dockrl.config.multi_turn``): their
    ``loss_mask`` is the response mask, so the outcome reward sits on the last sampled token, GAE and the
    discounted returns pass over the observations, and those get advantage 0. ``teacher`` — the
    distillation section: with ``teacher.enable`` the rows' ``teacher_log_prob`` joins the advantages."""

    def __init__(self, cfg: AlgorithmConfig, *, multi_turn: bool = False, teacher: TeacherConfig | None = None) -> None:
        self.cfg, self.multi_turn = cfg, multi_turn
        self.teacher = teacher if teacher is not None and teacher.enable else None
        kl_in_reward, self.needs_values = cfg.kl_in_reward_coef > 0, ESTIMATORS[cfg.adv_estimator].needs_values
        self.columns = (["rm_score", "response_ids"] + (["rollout_log_prob", "ref_log_prob"] if kl_in_reward else [])
                        + (["values"] if self.needs_values else []) + (["loss_mask"] if multi_turn else []))
        if self.teacher:
            self.columns += [c for c in ("rollout_log_prob", "teacher_log_prob") if c not in self.columns]

    def run_iteration(self, dock: Dock) -> dict[str, float]:
        """Compute the advantages of every row; returns ``rollout/frac_zero_std_groups`` (groups of
        ``rollout.n >= 2``) and timing."""
        n = dock.group_size
        if self.cfg.filter_groups.enable:
            return DynamicSampler(self.cfg.filter_groups, self.columns, lambda batch: self.advantages(batch, n)).run_iteration(dock)
        start, groups, zero_std, kl_sum, kl_tokens = time.perf_counter(), 0, 0, 0.0, 0
        while claim := dock.claim("advantage", self.columns, dock.num_rows, whole_groups=True):
            dock.put(claim.rows, self.advantages(claim.batch, n), ack=claim)
            scores = torch.tensor(claim.batch.column("rm_score").to_pylist(), dtype=torch.float64)
            groups += len(scores) // n
            zero_std += int((~mixed_groups(scores, n)).sum())
            if self.teacher:
                kl, tokens = self.reverse_kl(claim.batch)
                kl_sum, kl_tokens = kl_sum + kl, kl_tokens + tokens
        spread = {"rollout/frac_zero_std_groups": zero_std / groups} if n > 1 else {}  # a group of one has no spread
        distill = {"distill/reverse_kl": kl_sum / max(kl_tokens, 1)} if self.teacher else {}
        return spread | distill | {"timing_s/advantage": time.perf_counter() - start}

    def mask(self, batch: pa.RecordBatch) -> tuple[torch.Tensor, list[int]]:
        """The ``(B, T)`` response mask of ``batch`` (a multi-turn row's ``loss_mask`` in it) and the responses' lengths."""
        lengths = [len(r) for r in batch.column("response_ids").to_pylist()]
        T = max(max(lengths, default=1), 1)
        return response_mask(lengths, T, batch.column("loss_mask").to_pylist() if self.multi_turn else None), lengths

    def reverse_kl(self, batch: pa.RecordBatch) -> tuple[float, int]:
        """``(Σ_t (log p_student - log p_teacher), tokens)`` over the batch's response tokens: the k1 estimate of
        ``KL(student ‖ teacher)`` summed, for ``distill/reverse_kl`` (nats per token)."""
        mask, _ = self.mask(batch)
        student, teacher = (right_pad(batch.column(c).to_pylist(), mask.shape[1]) for c in ("rollout_log_prob", "teacher_log_prob"))
        return float(((student - teacher) * mask).sum()), int(mask.sum())

    def advantages(self, batch: pa.RecordBatch, n: int) -> dict[str, list]:
        """The ``advantages`` and ``returns`` columns, per token, of whole groups of ``n`` rows;
        ``batch`` holds ``self.columns``. Both are this stage's outputs in the schema, so both are
        always written (a row counts as finished for the stage only then, which a lease that ends
        between the put and the ack relies on); ``returns`` is the critic's target with ``gae``,
        the discounted returns with ``reinforce_plus_plus`` and the advantages themselves with the
        outcome estimators, as verl."""
        scores = torch.tensor(batch.column("rm_score").to_pylist(), dtype=torch.float64)
        mask, lengths = self.mask(batch)
        T = mask.shape[1]
        kl = None
        if self.cfg.kl_in_reward_coef > 0:
            policy, ref = (right_pad(batch.column(c).to_pylist(), T) for c in ("rollout_log_prob", "ref_log_prob"))
            kl = kl_penalty(policy, ref, self.cfg.kl_penalty) * mask
        values = right_pad(batch.column("values").to_pylist(), T) if self.needs_values else None
        adv, returns = compute_advantages(self.cfg, scores, mask, group_size=n, values=values, kl=kl)
        if self.teacher:
            student, teacher = (right_pad(batch.column(c).to_pylist(), T) for c in ("rollout_log_prob", "teacher_log_prob"))
            adv = distillation_advantages(adv, teacher, student, mask, coef=self.teacher.coef, reward_weight=self.teacher.reward_weight)
        return {"advantages": [row[:k] for row, k in zip(adv.tolist(), lengths)],
                "returns": [row[:k] for row, k in zip(returns.tolist(), lengths)]}
