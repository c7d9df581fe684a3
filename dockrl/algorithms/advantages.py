"""Advantage estimators: small pure tensor functions, one per estimator, and the dispatch on
``algorithm.adv_estimator`` (``compute_advantages``).

Shapes: ``B`` responses (``B = prompts·n``, group ``i`` is rows ``i·n … i·n+n-1``), ``T``
response tokens, right-padded; ``mask`` ``(B, T)`` is 1 on the response's tokens (EOS
included) and 0 on padding. Every estimator returns per-token ``(B, T)`` advantages, 0 on
padding; outcome estimators repeat the response's value over its tokens.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from dockrl.algorithms.dapo import mixed_groups
from dockrl.config import AlgorithmConfig
from dockrl.config.estimators import ESTIMATORS


def _groups(scores: torch.Tensor, group_size: int, who: str) -> torch.Tensor:
    if group_size < 2:
        raise ValueError(f"{who}: group_size={group_size}; need at least 2 samples per prompt")
    if scores.ndim != 1 or scores.numel() % group_size:
        raise ValueError(f"{who}: scores of shape {tuple(scores.shape)} is not a multiple of group_size={group_size}")
    return scores.double().view(-1, group_size)


def _equal(groups: torch.Tensor) -> torch.Tensor:
    """``(G, 1)`` True where all rewards of a group are equal: their advantage is exactly 0 (in
    floating point ``r - mean(r)`` is not 0 when the mean is inexact)."""
    return ~mixed_groups(groups.reshape(-1), groups.shape[1]).unsqueeze(1)


def grpo_advantages(scores: torch.Tensor, group_size: int, *, eps: float = 1e-6, norm_by_std: bool = True) -> torch.Tensor:
    """Outcome advantage of each response relative to its prompt group.

    ``A_i = (r_i - mean(r_group)) / (std(r_group) + eps)`` — DeepSeekMath (Shao et al., 2024,
    arXiv 2402.03300), §4.1.2 "outcome supervision". ``std`` is the unbiased sample standard
    deviation (as in the paper's reference code and TRL). With ``norm_by_std=False`` only the
    mean is subtracted: ``A_i = r_i - mean(r_group)``, Dr. GRPO (Liu et al., 2025, arXiv
    2503.20783, eq. 3, which also drops GRPO's ``1/|o_i|``: ``aggregate_loss``'s
    ``seq-mean-token-sum-norm``).

    A group whose rewards are all equal (``max == min``) gets exactly zero advantages, for
    every group size and reward value (twelve rewards of 1.1 in fp32 gave -0.106 each after the
    division by ``std + eps``). The rest is computed in float64 and returned in float32.

    Args:
        scores: ``(B,)`` rewards; group ``i`` is ``scores[i·n:(i+1)·n]``.
        group_size: ``n`` ≥ 2.

    Returns:
        ``(B,)`` float32 advantages.

    Raises:
        ValueError: ``group_size < 2`` or ``len(scores)`` not a multiple of it.
    """
    groups = _groups(scores, group_size, "grpo_advantages")
    centered = groups - groups.mean(dim=1, keepdim=True)
    if norm_by_std:
        centered = centered / (groups.std(dim=1, keepdim=True) + eps)
    return centered.masked_fill(_equal(groups), 0.0).view(-1).float()


def rloo_advantages(scores: torch.Tensor, group_size: int) -> torch.Tensor:
    """REINFORCE leave-one-out: each response's reward minus the mean reward of the other
    responses to its prompt.

    ``A_i = r_i - 1/(n-1) Σ_{j≠i} r_j = n/(n-1) · (r_i - mean(r_group))`` — RLOO (Ahmadian et al.,
    2024, arXiv 2402.14740, §3 "REINFORCE Leave-One-Out", after Kool et al., 2019). A group of
    equal rewards gets exactly 0. Computed in float64, returned in float32.

    Args:
        scores: ``(B,)`` rewards; group ``i`` is ``scores[i·n:(i+1)·n]``.
        group_size: ``n`` ≥ 2.

    Returns:
        ``(B,)`` float32 advantages.

    Raises:
        ValueError: ``group_size < 2`` or ``len(scores)`` not a multiple of it.
    """
    groups = _groups(scores, group_size, "rloo_advantages")
    others = (groups.sum(dim=1, keepdim=True) - groups) / (group_size - 1)
    return (groups - others).masked_fill(_equal(groups), 0.0).view(-1).float()


def token_rewards(scores: torch.Tensor, mask: torch.Tensor, kl: torch.Tensor | None = None, kl_coef: float = 0.0) -> torch.Tensor:
    """Per-token rewards: the outcome reward on the response's last token, minus ``β·KL_t`` on
    every token when ``kl`` is given (KL in the reward: Ouyang et al., 2022, arXiv 2203.02155,
    eq. 2; REINFORCE++, Hu, 2025, arXiv 2501.03262, eq. 1).

    Args:
        scores: ``(B,)`` outcome rewards.
        mask: ``(B, T)`` response mask (right-padded; a response has at least one token; 0 may
            also mark tokens inside it: the reward goes on its last token where the mask is 1).
        kl: ``(B, T)`` per-token KL estimates of the policy to the reference (nats), or None.
        kl_coef: β.

    Returns:
        ``(B, T)`` float32 rewards, 0 on padding.
    """
    mask = mask.float()
    # the last token where the mask is 1 (a multi-turn row's mask has holes at the observations): max_t t·m_t
    last = (mask * torch.arange(mask.shape[1], device=mask.device)).argmax(dim=1)
    rewards = torch.zeros_like(mask)
    rewards[torch.arange(len(scores)), last] = scores.float()
    if kl is not None and kl_coef:
        rewards = rewards - kl_coef * kl.float()
    return rewards * mask


def discounted_returns(rewards: torch.Tensor, mask: torch.Tensor, gamma: float) -> torch.Tensor:
    """``G_t = Σ_{s≥t} γ^{s-t} r_s`` over the response's tokens (padding skipped), ``(B, T)`` → ``(B, T)``, 0 on padding."""
    mask = mask.float()
    out, running = torch.zeros_like(rewards), torch.zeros_like(rewards[:, 0])
    for t in reversed(range(rewards.shape[1])):
        running = (rewards[:, t] + gamma * running) * mask[:, t] + running * (1 - mask[:, t])
        out[:, t] = running
    return out * mask


def masked_whiten(values: torch.Tensor, mask: torch.Tensor, eps: float = 1e-8) -> torch.Tensor:
    """``(x - mean) / sqrt(var + eps)`` with the mean and the unbiased variance over the tokens
    where ``mask`` is 1 (the whole batch); ``(B, T)`` → ``(B, T)``, 0 on padding. Computed in
    float64, returned in float32. One token only: centered, not scaled."""
    m, x = mask.double(), values.double()
    n = m.sum()
    mean = (x * m).sum() / n.clamp(min=1)
    var = (((x - mean) * m) ** 2).sum() / (n - 1).clamp(min=1)
    return ((x - mean) * torch.rsqrt(var + eps) * m).float()


def reinforce_plus_plus_advantages(
    rewards: torch.Tensor, mask: torch.Tensor, *, gamma: float, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """REINFORCE++ (Hu, 2025, arXiv 2501.03262, §3: eq. 1 token rewards, §3.2 "advantage
    normalization"): the discounted return of each token, whitened over all tokens of the batch.

    ``A_t = (G_t - mean_batch(G)) / sqrt(var_batch(G) + eps)``, ``G_t = Σ_{s≥t} γ^{s-t} r_s``.

    Args:
        rewards: ``(B, T)`` per-token rewards (``token_rewards``: outcome on the last token, the
            KL penalty on every token).
        mask: ``(B, T)`` response mask.

    Returns:
        ``(advantages, returns)``: ``(B, T)`` float32 advantages and the discounted returns ``G_t``,
        each 0 on padding.
    """
    returns = discounted_returns(rewards, mask, gamma)
    return masked_whiten(returns, mask, eps), returns


def gae(
    rewards: torch.Tensor, values: torch.Tensor, mask: torch.Tensor, gamma: float, lam: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """Generalized advantage estimation (Schulman et al., 2015, arXiv 1506.02438, eq. 16).

    ``δ_t = r_t + γ V_{t+1} - V_t``, ``A_t = Σ_{l≥0} (γλ)^l δ_{t+l}``, over the response's tokens
    (padding is skipped; the value after the last token is 0: the episode ends there);
    ``returns = A + V``, the critic's regression target. Not whitened (``compute_advantages``
    whitens for ``gae``).

    Args:
        rewards: ``(B, T)`` per-token rewards (``token_rewards``).
        values: ``(B, T)`` the critic's value of each response token's state.
        mask: ``(B, T)`` response mask.
        gamma, lam: γ and λ, each in [0, 1].

    Returns:
        ``(advantages, returns)``, each ``(B, T)`` float32, 0 on padding.
    """
    m, r, v = mask.float(), rewards.float(), values.float()
    adv = torch.zeros_like(r)
    next_value, running = torch.zeros_like(r[:, 0]), torch.zeros_like(r[:, 0])
    for t in reversed(range(r.shape[1])):
        delta = r[:, t] + gamma * next_value - v[:, t]
        running = (delta + gamma * lam * running) * m[:, t] + running * (1 - m[:, t])
        next_value = v[:, t] * m[:, t] + next_value * (1 - m[:, t])
        adv[:, t] = running
    return adv * m, (adv + v) * m


@dataclass(frozen=True)
class AdvantageInputs:
    """What an estimator (``dockrl.config.estimators.ESTIMATORS``) is given: one iteration's whole groups."""

    scores: torch.Tensor
    """``(B,)`` outcome rewards, whole groups of ``group_size``."""
    mask: torch.Tensor
    """``(B, T)`` float response mask."""
    group_size: int
    rewards: torch.Tensor | None = None
    """``(B, T)`` token rewards (``token_rewards`` estimators): the outcome at the last token minus the KL penalty."""
    values: torch.Tensor | None = None
    """``(B, T)`` critic values (``needs_values`` estimators)."""


def _outcome(per_seq: torch.Tensor, mask: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """An outcome estimator's per-sequence advantages on every response token; its returns are the advantages."""
    adv = per_seq.unsqueeze(1) * mask
    return adv, adv


def grpo_estimator(cfg: AlgorithmConfig, x: AdvantageInputs) -> tuple[torch.Tensor, torch.Tensor]:
    """GRPO: the group-normalized outcome (``grpo_advantages``; by the std unless ``norm_adv_by_std_in_grpo=false``)."""
    return _outcome(grpo_advantages(x.scores, x.group_size, eps=cfg.adv_eps, norm_by_std=cfg.norm_adv_by_std_in_grpo), x.mask)


def dr_grpo_estimator(cfg: AlgorithmConfig, x: AdvantageInputs) -> tuple[torch.Tensor, torch.Tensor]:
    """Dr. GRPO: the group's mean subtracted, no std division (``grpo_advantages(norm_by_std=False)``)."""
    return _outcome(grpo_advantages(x.scores, x.group_size, eps=cfg.adv_eps, norm_by_std=False), x.mask)


def rloo_estimator(cfg: AlgorithmConfig, x: AdvantageInputs) -> tuple[torch.Tensor, torch.Tensor]:
    """RLOO: the leave-one-out baseline of the group (``rloo_advantages``)."""
    return _outcome(rloo_advantages(x.scores, x.group_size), x.mask)


def reinforce_plus_plus_estimator(cfg: AlgorithmConfig, x: AdvantageInputs) -> tuple[torch.Tensor, torch.Tensor]:
    """REINFORCE++: whitened discounted returns of the token rewards (``reinforce_plus_plus_advantages``)."""
    assert x.rewards is not None  # a token_rewards estimator
    return reinforce_plus_plus_advantages(x.rewards, x.mask, gamma=cfg.gamma, eps=cfg.adv_eps)


def gae_estimator(cfg: AlgorithmConfig, x: AdvantageInputs) -> tuple[torch.Tensor, torch.Tensor]:
    """PPO's GAE over the token rewards and the critic's values, the advantages whitened (``gae``, ``masked_whiten``)."""
    assert x.rewards is not None and x.values is not None  # token_rewards, needs_values
    adv, returns = gae(x.rewards, x.values, x.mask, cfg.gamma, cfg.lam)
    return masked_whiten(adv, x.mask, cfg.adv_eps), returns


def compute_advantages(
    cfg: AlgorithmConfig,
    scores: torch.Tensor,
    mask: torch.Tensor,
    *,
    group_size: int,
    values: torch.Tensor | None = None,
    kl: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The advantages of ``cfg.adv_estimator`` (its entry of ``ESTIMATORS``) for one whole iteration's batch.

    Args:
        scores: ``(B,)`` outcome rewards, whole groups of ``group_size``.
        mask: ``(B, T)`` response mask.
        values: ``(B, T)`` critic values (``gae`` only).
        kl: ``(B, T)`` per-token KL of the policy to the reference (``kl_penalty``), subtracted
            from the token rewards times ``cfg.kl_in_reward_coef`` (``gae``, ``reinforce_plus_plus``).

    Returns:
        ``(advantages, returns)``, each ``(B, T)`` float32 and 0 on padding. ``returns`` is the
        critic's target for ``gae``, the discounted returns for ``reinforce_plus_plus`` and the
        advantages themselves for the outcome estimators.

    Raises:
        ValueError: an unknown estimator, ``gae`` without ``values``, bad group sizes.
    """
    est = ESTIMATORS.get(cfg.adv_estimator)
    if est is None:
        raise ValueError(f"algorithm.adv_estimator: got {cfg.adv_estimator!r}; expected one of {', '.join(map(repr, ESTIMATORS))}")
    if est.needs_values and values is None:
        raise ValueError(f"compute_advantages: algorithm.adv_estimator={cfg.adv_estimator!r} needs the critic's values")
    m = mask.float()
    rewards = token_rewards(scores, m, kl, cfg.kl_in_reward_coef) if est.token_rewards else None
    return est.load()(cfg, AdvantageInputs(scores, m, group_size, rewards, values))
