"""Policy and value losses, KL estimators, entropy, importance weights, loss aggregation, and SFT's NLL.

Shapes: ``B`` sequences, ``T`` response tokens (right-padded); ``mask`` is 1 on response
tokens that count (the EOS token included) and 0 on padding.
"""

from __future__ import annotations

from typing import Literal, NamedTuple

import torch

LossAggMode = Literal["token-mean", "seq-mean-token-mean", "seq-mean-token-sum", "seq-mean-token-sum-norm"]
KlType = Literal["low_var_kl", "kl", "abs", "mse"]


class PolicyLoss(NamedTuple):
    """``policy_loss``'s result: ``(B, T)`` tensors, 0 where masked."""

    loss: torch.Tensor
    """Per-token loss."""
    clip_hit: torch.Tensor
    """1 where the clipped term (1 ± ε) was selected."""
    dual_clip_hit: torch.Tensor
    """1 where the dual-clip bound ``-c·A`` was selected (negative advantages, ``clip_c > 1``)."""


def sequence_ratio_log(log_prob: torch.Tensor, old_log_prob: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """GSPO's per-token log-ratio: the value is the length-normalized sequence log-ratio
    ``log s_i = 1/|o_i| Σ_t (logπ_t - logπ_old,t)``, the gradient that of ``logπ_t``:
    ``log s_{i,t} = sg[log s_i] + logπ_t - sg[logπ_t]`` (Zheng et al., 2025, arXiv 2507.18071,
    eq. 7 and GSPO-token eq. 13). ``(B, T)`` → ``(B, T)``."""
    m = mask.float()
    seq = ((log_prob - old_log_prob) * m).sum(dim=1, keepdim=True) / m.sum(dim=1, keepdim=True).clamp(min=1.0)
    return seq.detach() + log_prob - log_prob.detach()


def policy_loss(
    log_prob: torch.Tensor,
    old_log_prob: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    *,
    clip_low: float,
    clip_high: float,
    clip_c: float = 0.0,
    ratio_level: Literal["token", "sequence"] = "token",
    weight: torch.Tensor | None = None,
) -> PolicyLoss:
    """Per-token clipped surrogate loss.

    ``L_t = -min(ρ_t A_t, clip(ρ_t, 1-ε_low, 1+ε_high) A_t)``: PPO (Schulman et al., 2017, arXiv
    1707.06347, eq. 7) with the decoupled clip range of DAPO (Yu et al., 2025, arXiv 2503.14476,
    eq. 10). ``ρ_t = exp(logπ_t - logπ_old,t)`` (``ratio_level="token"``) or GSPO's sequence
    ratio ``s_i`` (``"sequence"``, ``sequence_ratio_log``). With ``clip_c > 1`` (0: off), dual-clip for
    ``A_t < 0``: ``L_t = min(L_t, -c·A_t)`` (Ye et al., 2020, arXiv 1912.09729, eq. 5), which bounds
    the loss of a token whose ratio grew far above 1. ``weight`` (e.g. ``tis_weight``) multiplies
    each token's loss.

    Args:
        log_prob, old_log_prob: ``(B, T)`` per-token log-probs (nats).
        advantages: ``(B,)`` per-sequence or ``(B, T)`` per-token advantages.
        mask: ``(B, T)`` response mask.
        weight: ``(B, T)`` per-token weights (no gradient), or None.

    Returns:
        ``PolicyLoss`` of ``(B, T)`` tensors, 0 where masked.

    Raises:
        ValueError: ``0 < clip_c <= 1`` (a bound at or below the clipped loss, ``algorithm.clip_ratio_c``).
    """
    if 0 < clip_c <= 1:
        raise ValueError(f"policy_loss: clip_c={clip_c}; expected 0 (no dual-clip) or a bound > 1")
    if advantages.ndim == 1:
        advantages = advantages.unsqueeze(1)
    log_ratio = log_prob - old_log_prob if ratio_level == "token" else sequence_ratio_log(log_prob, old_log_prob, mask)
    ratio = torch.exp(log_ratio)
    unclipped = ratio * advantages
    clipped = torch.clamp(ratio, 1.0 - clip_low, 1.0 + clip_high) * advantages
    loss = -torch.minimum(unclipped, clipped)
    clip_hit = (clipped < unclipped).float()
    dual_hit = torch.zeros_like(clip_hit)
    if clip_c > 1:
        bound = -clip_c * advantages
        dual = (advantages < 0) & (bound < loss)
        loss, dual_hit = torch.where(dual, bound.expand_as(loss), loss), dual.float()
    if weight is not None:
        loss = loss * weight
    return PolicyLoss(loss * mask, clip_hit * mask, dual_hit * mask)


def tis_weight(old_log_prob: torch.Tensor, rollout_log_prob: torch.Tensor, cap: float) -> torch.Tensor:
    """Truncated importance weight of each token for the rollout–trainer mismatch:
    ``w_t = min(π_old(y_t) / π_rollout(y_t), C)`` (no gradient), the rollout engine's sampling
    distribution corrected towards the trainer's (Yao et al., 2025, "Your efficient RL framework
    secretly brings you off-policy RL training", fengyao.notion.site; truncated IS after Ionides,
    2008). ``(B, T)`` log-probs (nats) → ``(B, T)`` weights in ``[0, C]``."""
    return torch.exp(old_log_prob - rollout_log_prob).clamp(max=cap).detach()


def value_loss(
    values: torch.Tensor, old_values: torch.Tensor, returns: torch.Tensor, mask: torch.Tensor, *, clip_range: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-token clipped value loss of PPO's critic.

    ``L_t = ½ · max((V_t - R_t)², (clip(V_t, V_old,t - c, V_old,t + c) - R_t)²)`` — the value
    clipping of the PPO reference implementation (Dhariwal et al., 2017, OpenAI Baselines
    ``ppo2``; discussed by Engstrom et al., 2020, arXiv 2005.12729, §3 "value function
    clipping"), as verl's ``cliprange_value``.

    Args:
        values: ``(B, T)`` the critic's current values (differentiable).
        old_values: ``(B, T)`` the values before the update (the ``values`` column).
        returns: ``(B, T)`` targets (``gae``'s returns).
        mask: ``(B, T)`` response mask.
        clip_range: c > 0.

    Returns:
        ``(B, T)`` per-token loss (0 where masked; aggregate with ``aggregate_loss``) and the
        ``(B, T)`` float indicator of tokens where the clipped term was the larger.
    """
    clipped = old_values + torch.clamp(values - old_values, -clip_range, clip_range)
    unclipped_loss, clipped_loss = (values - returns) ** 2, (clipped - returns) ** 2
    loss = 0.5 * torch.maximum(unclipped_loss, clipped_loss)
    return loss * mask, (clipped_loss > unclipped_loss).float() * mask


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


def kl_penalty(log_prob: torch.Tensor, ref_log_prob: torch.Tensor, kind: KlType) -> torch.Tensor:
    """Per-token estimate of KL(π‖π_ref) from samples of π (Schulman, "Approximating KL
    divergence", 2020): ``kl`` k1 = ``logπ - logπ_ref``; ``abs`` |k1|; ``mse`` k2 = ½·k1²;
    ``low_var_kl`` k3 (``kl_k3``). ``(B, T)`` log-probs (nats) → ``(B, T)`` nats.

    Raises:
        ValueError: unknown ``kind``.
    """
    if kind == "low_var_kl":
        return kl_k3(log_prob, ref_log_prob)
    k1 = log_prob - ref_log_prob
    if kind == "kl":
        return k1
    elif kind == "abs":
        return k1.abs()
    elif kind == "mse":
        return 0.5 * k1.square()
    else:
        raise ValueError(f"algorithm.kl_loss_type: got {kind!r}; expected one of 'low_var_kl', 'kl', 'abs', 'mse'")


def entropy_from_logits(logits: torch.Tensor) -> torch.Tensor:
    """Per-token entropy ``H = logsumexp(z) - Σ softmax(z)·z`` of ``(B, T, V)`` logits → ``(B, T)`` nats."""
    probs = torch.softmax(logits, dim=-1)
    return torch.logsumexp(logits, dim=-1) - (probs * logits).sum(dim=-1)


def aggregate_loss(
    loss: torch.Tensor,
    mask: torch.Tensor,
    mode: LossAggMode,
    *,
    total_tokens: float,
    total_sequences: float,
    horizon: float = 0.0,
) -> torch.Tensor:
    """Reduce a ``(B, T)`` per-token loss of one micro-batch to its share of the mini-batch loss.

    ``N`` sequences, ``|o_i|`` tokens each, in the mini-batch:

    - ``token-mean``: ``Σ_i Σ_t l_it / Σ_i |o_i|`` (DAPO, arXiv 2503.14476, eq. 12);
    - ``seq-mean-token-mean``: ``1/N Σ_i (1/|o_i|) Σ_t l_it`` (GRPO, arXiv 2402.03300, eq. 3);
    - ``seq-mean-token-sum``: ``1/N Σ_i Σ_t l_it``;
    - ``seq-mean-token-sum-norm``: ``1/N Σ_i Σ_t l_it / L`` with the constant ``L = horizon``
      (the generation budget): Dr. GRPO (Liu et al., 2025, arXiv 2503.20783, eq. 3 and §3.2,
      which drops GRPO's ``1/|o_i|`` length bias and divides by a constant instead).

    Normalizing by mini-batch totals (``total_tokens``, ``total_sequences``), not micro-batch
    ones, makes the summed gradient independent of the micro-batch size.

    Raises:
        ValueError: unknown ``mode``; ``seq-mean-token-sum-norm`` without ``horizon > 0``.
    """
    if mode == "token-mean":
        return (loss * mask).sum() / max(total_tokens, 1.0)
    elif mode == "seq-mean-token-mean":
        per_seq = (loss * mask).sum(dim=1) / mask.sum(dim=1).clamp(min=1.0)
        return per_seq.sum() / max(total_sequences, 1.0)
    elif mode == "seq-mean-token-sum":
        return (loss * mask).sum() / max(total_sequences, 1.0)
    elif mode == "seq-mean-token-sum-norm":
        if not horizon > 0:
            raise ValueError(f"aggregate_loss: 'seq-mean-token-sum-norm' needs the constant horizon > 0, got {horizon}")
        return (loss * mask).sum() / (max(total_sequences, 1.0) * horizon)
    else:
        raise ValueError(f"algorithm.loss_agg_mode: got {mode!r}; expected one of 'token-mean', 'seq-mean-token-mean', "
                         "'seq-mean-token-sum', 'seq-mean-token-sum-norm'")


def nll_loss(log_prob: torch.Tensor, mask: torch.Tensor, total_tokens: float) -> torch.Tensor:
    """Supervised fine-tuning's loss: the negative log-likelihood of the masked tokens, summed and
    divided by ``total_tokens``, the masked tokens of the whole mini-batch (not of this micro-batch),
    so that micro-batches' losses add up to the mini-batch's token mean whichever rows go together:
    ``L = -Σ_{b,t} mask_{b,t} · log π(y_{b,t} | y_{b,<t}) / N`` (transformers' ``Trainer`` with
    ``num_items_in_batch``, TRL's SFT default).

    Args:
        log_prob: ``(B, T)`` per-token log-probs (nats) of the target tokens.
        mask: ``(B, T)`` 1 on the tokens that count (the assistant's), 0 elsewhere and on padding.
        total_tokens: ``N``, the mini-batch's counted tokens (at least 1 is used).

    Returns:
        A scalar tensor (nats per token).
    """
    return -(log_prob * mask).sum() / max(total_tokens, 1.0)
