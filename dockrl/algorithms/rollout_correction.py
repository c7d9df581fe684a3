"""The rollout–trainer mismatch: its metrics, and the masked corrections beside TIS (``tis_weight``).

The rollout engine samples with ``π_rollout`` (its own kernels, precision, and with iterations in
flight older weights); the actor recomputes ``π_old`` of the same tokens. Their per-token ratio
``ρ_t = π_old(y_t) / π_rollout(y_t)`` measures the mismatch and weights the correction.

Shapes: ``B`` sequences, ``T`` response tokens (right-padded); ``mask`` is 1 on response tokens
that count and 0 on padding. Log-probs are in nats. No function here takes gradients: every
weight is a constant of the loss.
"""

from __future__ import annotations

import math
from typing import Literal, NamedTuple, Sequence

import torch

from dockrl.algorithms.losses import kl_k3

RolloutCorrection = Literal["none", "mis_token", "mis_sequence", "icepop"]
_LOG_RATIO_BOUND = 20.0
"""|log ρ| is clamped here in the metrics, so that one extreme token cannot overflow ``exp``."""


class Correction(NamedTuple):
    """A masked correction's result: ``(B, T)`` tensors, no gradient."""

    weight: torch.Tensor
    """The weight of each token's policy loss: the ratio where kept, 0 where masked."""
    kept: torch.Tensor
    """1 where the token (or its sequence) is inside the bounds, 0 where it is masked out."""


def _masked(log_ratio: torch.Tensor, inside: torch.Tensor) -> Correction:
    """``ρ·1[inside]`` without ``exp`` of a log-ratio outside (which may overflow, and inf·0 is nan)."""
    weight = torch.where(inside, torch.exp(torch.where(inside, log_ratio, torch.zeros_like(log_ratio))), torch.zeros_like(log_ratio))
    return Correction(weight.detach(), inside.float())


def mis_token_weight(old_log_prob: torch.Tensor, rollout_log_prob: torch.Tensor, high: float) -> Correction:
    """Token-level masked importance sampling (Token-MIS): ``w_t = ρ_t · 1[ρ_t ≤ C]`` with
    ``ρ_t = π_old(y_t) / π_rollout(y_t)``: a token whose ratio exceeds the threshold ``C`` leaves
    the loss instead of being truncated at ``C`` as TIS does (Liu, Li et al., 2025, "When Speed
    Kills Stability: Demystifying RL Collapse from the Training-Inference Mismatch",
    richardli.xyz/rl-collapse, §4). ``(B, T)`` log-probs → ``Correction`` of ``(B, T)``."""
    log_ratio = (old_log_prob - rollout_log_prob).detach()
    return _masked(log_ratio, log_ratio <= math.log(high))


def mis_sequence_weight(old_log_prob: torch.Tensor, rollout_log_prob: torch.Tensor, mask: torch.Tensor, high: float) -> Correction:
    """Sequence-level masked importance sampling (Seq-MIS): every token of sequence ``i`` gets
    ``w_i = ρ_i · 1[ρ_i ≤ C]`` with the sequence ratio ``ρ_i = Π_t ρ_{i,t} = exp(Σ_t m_{i,t}·(logπ_old -
    logπ_rollout))`` over its masked tokens: a sequence whose ratio exceeds ``C`` leaves the loss
    whole (Liu, Li et al., 2025, "When Speed Kills Stability", richardli.xyz/rl-collapse, §4, the
    estimator they found most stable). ``(B, T)`` log-probs and mask → ``Correction`` of ``(B, T)``
    (each row one value; padding keeps its row's value, the loss's mask removes it)."""
    seq = ((old_log_prob - rollout_log_prob).detach() * mask).sum(dim=1, keepdim=True).expand_as(old_log_prob)
    return _masked(seq, seq <= math.log(high))


def icepop_weight(old_log_prob: torch.Tensor, rollout_log_prob: torch.Tensor, low: float, high: float) -> Correction:
    """IcePop's two-sided token masking: ``w_t = M(ρ_t) = ρ_t`` if ``α ≤ ρ_t ≤ β``, else 0, with
    ``ρ_t = π_train(y_t; θ_old) / π_infer(y_t; θ_old)`` (Ling Team, 2025, "Every Step Evolves:
    Scaling Reinforcement Learning for Trillion-Scale Thinking Model", arXiv 2510.18855, §IcePop,
    the objective J_IcePop; α = 0.5, β = 5 there). ``(B, T)`` log-probs → ``Correction`` of ``(B, T)``."""
    log_ratio = (old_log_prob - rollout_log_prob).detach()
    return _masked(log_ratio, (log_ratio >= math.log(low)) & (log_ratio <= math.log(high)))


def correction_weight(
    old_log_prob: torch.Tensor, rollout_log_prob: torch.Tensor, mask: torch.Tensor, *, kind: RolloutCorrection, low: float, high: float
) -> Correction:
    """The masked correction ``kind`` (``algorithm.rollout_correction``) with the bounds
    ``algorithm.rollout_ratio_low`` / ``rollout_ratio_high``: ``mis_token_weight``,
    ``mis_sequence_weight`` or ``icepop_weight``. ``(B, T)`` → ``Correction`` of ``(B, T)``.

    Raises:
        ValueError: ``kind`` is ``none`` or unknown; ``high`` not above 0, ``low`` not in (0, high].
    """
    if not (0 < low <= high):
        raise ValueError(f"correction_weight: bounds low={low}, high={high}; expected 0 < low <= high "
                         "(algorithm.rollout_ratio_low, algorithm.rollout_ratio_high)")
    if kind == "mis_token":
        return mis_token_weight(old_log_prob, rollout_log_prob, high)
    elif kind == "mis_sequence":
        return mis_sequence_weight(old_log_prob, rollout_log_prob, mask, high)
    elif kind == "icepop":
        return icepop_weight(old_log_prob, rollout_log_prob, low, high)
    else:
        raise ValueError(f"algorithm.rollout_correction: got {kind!r}; expected one of 'mis_token', 'mis_sequence', 'icepop'")


def mismatch_metrics(old_log_prob: torch.Tensor, rollout_log_prob: torch.Tensor, mask: torch.Tensor, *, cap: float) -> dict[str, float]:
    """How far the rollout engine's policy lies from the trainer's on the sampled tokens, over
    the tokens where ``mask`` is 1 (all 0 when there is none), beside the mean and largest
    ``|logπ_old - logπ_rollout|`` (``dockrl.stages.actor.rollout_log_prob_diff``):

    - ``kl_k3``: the token mean of ``k3 = ρ - log ρ - 1``, an estimate of KL(π_rollout‖π_old) from
      the rollout's samples (Schulman, "Approximating KL divergence", 2020; ``kl_k3``);
    - ``ratio_max``: the largest ``ρ_t = π_old/π_rollout`` (``log ρ`` clamped to ±20);
    - ``frac_beyond_cap``: the fraction of tokens with ``ρ_t > cap``.

    ``(B, T)`` log-probs (nats) and mask → plain floats.
    """
    m = mask.bool()
    n = int(m.sum())
    if n == 0:
        return {"kl_k3": 0.0, "ratio_max": 0.0, "frac_beyond_cap": 0.0}
    old, rollout = old_log_prob.detach()[m].double(), rollout_log_prob.detach()[m].double()
    log_ratio = old - rollout
    return {
        "kl_k3": kl_k3(rollout, old).mean().item(),  # KL(π_rollout‖π_old): the tokens are π_rollout's samples
        "ratio_max": math.exp(log_ratio.clamp(-_LOG_RATIO_BOUND, _LOG_RATIO_BOUND).max().item()),
        "frac_beyond_cap": (log_ratio > math.log(cap)).double().mean().item(),
    }


def token_staleness(iteration: int, versions: Sequence[Sequence[int]], loss_mask: Sequence[Sequence[int]] | None = None) -> dict[str, float]:
    """How many actor updates each trained token lags behind: ``iteration - v_t`` for every
    token's weight version ``v_t`` (the ``weight_version`` column: the updates in the weights that
    sampled it), when update ``iteration`` trains on it; 0 on-policy. Returns ``staleness_mean``
    and ``staleness_max`` over all tokens, or those where ``loss_mask`` is 1 (the model's tokens of
    multi-turn rows); 0 when there is none.

    Raises:
        ValueError: a token's version is above ``iteration`` (sampled by weights the actor has not made yet).
    """
    masks = loss_mask if loss_mask is not None else [[1] * len(row) for row in versions]
    lags = [iteration - v for row, m in zip(versions, masks) for v, k in zip(row, m) if k]
    if any(lag < 0 for lag in lags):
        raise ValueError(f"token_staleness: a weight version above the training update {iteration} "
                         f"(the newest is {iteration - min(lags)}): the weight_version column is wrong")
    return {"staleness_mean": sum(lags) / len(lags) if lags else 0.0, "staleness_max": float(max(lags, default=0))}
