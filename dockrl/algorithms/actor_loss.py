"""The actor's loss of one micro-batch: the clipped policy term, the KL term and the entropy bonus,
reduced to the micro-batch's share of the mini-batch loss, with the sums its metrics are made of.

Shapes: ``B`` sequences, ``T`` response tokens (right-padded); ``mask`` is 1 on response tokens
that count (the EOS token included) and 0 on padding and on rows left out of the loss.
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from dockrl.algorithms.losses import aggregate_loss, kl_penalty, policy_loss, tis_weight
from dockrl.algorithms.rollout_correction import correction_weight
from dockrl.config import AlgorithmConfig


class ActorLoss(NamedTuple):
    """``actor_loss``'s result."""

    loss: torch.Tensor
    """0-d, differentiable: this micro-batch's share of the mini-batch loss (back-propagate it unchanged)."""
    sums: dict[str, torch.Tensor]
    """0-d detached tensors, keyed by the ``actor/*`` metric each becomes: ``loss`` and ``pg_loss``
    (shares of the aggregate, like ``loss``); ``kl``, ``entropy``, ``clip_ratio``, ``ratio_mean``,
    with dual-clip ``dual_clip_frac``, with TIS ``tis_weight_mean`` and ``tis_clip_frac``, with a
    masked correction ``rollout_weight_mean`` and ``rollout_masked_frac`` (tokens masked out): sums
    over the micro-batch's tokens, to divide by the mini-batch's token count."""
    ratio_max: torch.Tensor
    """0-d: the largest token ratio ``exp(logπ - logπ_old)`` over the micro-batch (masked tokens count as 0)."""


def actor_loss(
    log_prob: torch.Tensor,
    old_log_prob: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    entropy: torch.Tensor,
    *,
    algo: AlgorithmConfig,
    total_tokens: float,
    total_sequences: float,
    horizon: float = 0.0,
    ref_log_prob: torch.Tensor | None = None,
    rollout_log_prob: torch.Tensor | None = None,
) -> ActorLoss:
    """Per token ``l_t = w_t·L^clip_t + β·KL_t - α·H_t``, aggregated as ``algo.loss_agg_mode`` says.

    ``L^clip_t`` is ``policy_loss`` (PPO, Schulman et al., 2017, arXiv 1707.06347, eq. 7, with
    DAPO's decoupled clip, arXiv 2503.14476, eq. 10; dual-clip and GSPO's sequence ratio as
    ``algo`` says); ``w_t`` the truncated importance weight ``tis_weight`` when ``algo.tis_cap > 0``,
    the masked one of ``algo.rollout_correction`` (``correction_weight``: Token-/Seq-MIS, IcePop; 0
    on a masked token, which stays in the normalizer as in those papers' objectives), else 1;
    ``KL_t`` the ``kl_penalty`` estimator of KL(π‖π_ref) with ``β = algo.kl_loss_coef``
    (the GRPO loss's KL term, arXiv 2402.03300, eq. 3); ``H_t`` the entropy with
    ``α = algo.entropy_coeff`` (the entropy bonus of PPO's eq. 9). The mean is ``aggregate_loss``
    over the mini-batch totals, so summing the shares of its micro-batches gives the mini-batch loss.

    Args:
        log_prob: ``(B, T)`` the policy's log-probs (nats, differentiable).
        old_log_prob: ``(B, T)`` the log-probs before the update (no gradient; on-policy,
            ``log_prob.detach()``).
        advantages: ``(B,)`` per-sequence or ``(B, T)`` per-token advantages.
        mask: ``(B, T)`` response mask.
        entropy: ``(B, T)`` per-token entropy (nats; differentiable for an entropy bonus).
        total_tokens, total_sequences: the counts of the whole mini-batch (all data-parallel replicas).
        horizon: the constant of ``loss_agg_mode='seq-mean-token-sum-norm'`` (``rollout.max_response_length``).
        ref_log_prob: ``(B, T)`` the reference policy's log-probs; needed when ``algo.kl_loss_coef > 0``.
        rollout_log_prob: ``(B, T)`` the rollout engine's log-probs; needed when ``algo.tis_cap > 0``
            or ``algo.rollout_correction`` is not ``none``.

    Returns:
        ``ActorLoss``; no argument is changed.

    Raises:
        ValueError: ``ref_log_prob`` or ``rollout_log_prob`` missing where ``algo`` needs it, and
            the errors of ``policy_loss``, ``correction_weight``, ``kl_penalty`` and ``aggregate_loss``.
    """
    if algo.kl_loss_coef > 0 and ref_log_prob is None:
        raise ValueError("actor_loss: algorithm.kl_loss_coef > 0 needs ref_log_prob")
    if algo.corrects_rollout and rollout_log_prob is None:
        raise ValueError("actor_loss: algorithm.tis_cap > 0 or algorithm.rollout_correction needs rollout_log_prob")
    weight, kept = None, None
    if rollout_log_prob is not None and algo.tis_cap > 0:
        weight = tis_weight(old_log_prob, rollout_log_prob, algo.tis_cap)
    elif rollout_log_prob is not None and algo.rollout_correction != "none":
        weight, kept = correction_weight(old_log_prob, rollout_log_prob, mask, kind=algo.rollout_correction,
                                         low=algo.rollout_ratio_low, high=algo.rollout_ratio_high)
    pg, clip_hit, dual_hit = policy_loss(
        log_prob, old_log_prob, advantages, mask, clip_low=algo.clip_ratio_low, clip_high=algo.clip_ratio_high,
        clip_c=algo.clip_ratio_c, ratio_level=algo.ratio_level, weight=weight,
    )
    token_loss, kl = pg, torch.zeros((), device=log_prob.device)
    if ref_log_prob is not None and algo.kl_loss_coef > 0:
        kl = kl_penalty(log_prob, ref_log_prob, algo.kl_loss_type) * mask
        token_loss = pg + algo.kl_loss_coef * kl
    if algo.entropy_coeff > 0:  # the bonus: higher entropy, lower loss
        token_loss = token_loss - algo.entropy_coeff * entropy
    totals = dict(total_tokens=total_tokens, total_sequences=total_sequences, horizon=horizon)
    loss = aggregate_loss(token_loss, mask, algo.loss_agg_mode, **totals)
    with torch.no_grad():
        ratio = torch.exp(log_prob - old_log_prob) * mask
        sums = {
            "loss": loss.detach(), "pg_loss": aggregate_loss(pg.detach(), mask, algo.loss_agg_mode, **totals),
            "kl": kl.detach().sum(), "entropy": (entropy.detach() * mask).sum(), "clip_ratio": clip_hit.sum(), "ratio_mean": ratio.sum(),
        }
        if algo.clip_ratio_c > 1:
            sums["dual_clip_frac"] = dual_hit.sum()
        if weight is not None and kept is None:
            sums |= {"tis_weight_mean": (weight * mask).sum(), "tis_clip_frac": ((weight >= algo.tis_cap).float() * mask).sum()}
        elif weight is not None and kept is not None:
            sums |= {"rollout_weight_mean": (weight * mask).sum(), "rollout_masked_frac": ((1.0 - kept) * mask).sum()}
        return ActorLoss(loss, sums, ratio.max())
