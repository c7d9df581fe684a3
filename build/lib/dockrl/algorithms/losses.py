"""Clipped policy loss, k3 KL estimator, entropy and loss aggregation.

Shapes: ``B`` sequences, ``T`` response tokens (right-padded); ``mask`` is 1 on response
tokens that count (the EOS token included) and 0 on padding.
"""

from __future__ import annotations

from typing import Literal

import torch


def policy_loss(
    log_prob: torch.Tensor,
    old_log_prob: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    *,
    clip_low: float,
    clip_high: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-token clipped surrogate loss.

    ``L_t = -min(ρ_t A, clip(ρ_t, 1-ε_low, 1+ε_high) A)``, ``ρ_t = exp(logπ - logπ_old)``:
    PPO (Schulman et al., 2017, arXiv 1707.06347, eq. 7) with the decoupled clip range of DAPO
    (Yu et al., 2025, arXiv 2503.14476, eq. 10).

    Args:
        log_prob, old_log_prob: ``(B, T)`` per-token log-probs (nats).
        advantages: ``(B,)`` per-sequence or ``(B, T)`` per-token advantages.
        mask: ``(B, T)`` response mask.

    Returns:
        ``(B, T)`` per-token loss (0 where masked) and the ``(B, T)`` float indicator of tokens
        where the clipped term was selected (for the clip fraction metric).
    """
    if advantages.ndim == 1:
        advantages = advantages.unsqueeze(1)
    ratio = torch.exp(log_prob - old_log_prob)
    unclipped = ratio * advantages
    clipped = torch.clamp(ratio, 1.0 - clip_low, 1.0 + clip_high) * advantages
    loss = -torch.minimum(unclipped, clipped)
    clip_hit = (clipped < unclipped).float()
    return loss * mask, clip_hit * mask


def kl_k3(log_prob: torch.Tensor, ref_log_prob: torch.Tensor) -> torch.Tensor:
    """Low-variance, non-negative KL(π‖π_ref) estimator per token.

    ``k3 = exp(logπ_ref - logπ) - (logπ_ref - logπ) - 1`` (Schulman, "Approximating KL
    divergence", 2020; used by GRPO, arXiv 2402.03300 eq. 4). The log-ratio is clamped to
    [-20, 20] so one extreme token cannot overflow.

    Args:
        log_prob, ref_log_prob: ``(B, T)`` per-token log-probs (nats).

    Returns:
        ``(B, T)`` estimates (nats), ≥ 0.
    """
    log_ratio = torch.clamp(ref_log_prob - log_prob, -20.0, 20.0)
    return torch.exp(log_ratio) - log_ratio - 1.0


def entropy_from_logits(logits: torch.Tensor) -> torch.Tensor:
    """Per-token entropy ``H = logsumexp(z) - Σ softmax(z)·z`` of ``(B, T, V)`` logits → ``(B, T)`` nats."""
    probs = torch.softmax(logits, dim=-1)
    return torch.logsumexp(logits, dim=-1) - (probs * logits).sum(dim=-1)


def aggregate_loss(
    loss: torch.Tensor,
    mask: torch.Tensor,
    mode: Literal["token", "sequence"],
    *,
    total_tokens: float,
    total_sequences: float,
) -> torch.Tensor:
    """Reduce a ``(B, T)`` per-token loss of one micro-batch to its share of the mini-batch loss.

    ``token``: Σ loss / total response tokens in the mini-batch (token-mean, DAPO
    arXiv 2503.14476 eq. 12). ``sequence``: Σ_i (Σ_t loss_it / |o_i|) / sequences in the
    mini-batch (sequence-mean, GRPO arXiv 2402.03300 eq. 3). Normalizing by mini-batch totals,
    not micro-batch ones, makes the summed gradient independent of the micro-batch size.

    Raises:
        ValueError: unknown ``mode``.
    """
    if mode == "token":
        return (loss * mask).sum() / max(total_tokens, 1.0)
    elif mode == "sequence":
        per_seq = (loss * mask).sum(dim=1) / mask.sum(dim=1).clamp(min=1.0)
        return per_seq.sum() / max(total_sequences, 1.0)
    else:
        raise ValueError(f"algorithm.loss_agg: got {mode!r}; expected one of 'token', 'sequence'")
