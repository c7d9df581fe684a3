"""Group-normalized advantages (GRPO)."""

from __future__ import annotations

import torch


def grpo_advantages(scores: torch.Tensor, group_size: int, *, eps: float = 1e-6, norm_by_std: bool = True) -> torch.Tensor:
    """Outcome advantage of each response relative to its prompt group.

    ``A_i = (r_i - mean(r_group)) / (std(r_group) + eps)`` — DeepSeekMath (Shao et al., 2024,
    arXiv 2402.03300), §4.1.2 "outcome supervision". ``std`` is the unbiased sample standard
    deviation (as in the paper's reference code and TRL). With ``norm_by_std=False`` only the
    mean is subtracted (Dr. GRPO, Liu et al., 2025, arXiv 2503.20783).

    A group whose rewards are all equal (``max == min``) gets exactly zero advantages, for
    every group size and reward value: in floating point ``r - mean(r)`` is not 0 when the
    mean is inexact (twelve rewards of 1.1 in fp32 gave -0.106 each after the division by
    ``std + eps``). The rest is computed in float64 and returned in float32.

    Args:
        scores: ``(B·n,)`` rewards; group ``i`` is ``scores[i·n:(i+1)·n]``.
        group_size: ``n`` ≥ 2.

    Returns:
        ``(B·n,)`` float32 advantages.

    Raises:
        ValueError: ``group_size < 2`` or ``len(scores)`` not a multiple of it.
    """
    if group_size < 2:
        raise ValueError(f"grpo_advantages: group_size={group_size}; need at least 2 samples per prompt")
    if scores.ndim != 1 or scores.numel() % group_size:
        raise ValueError(f"grpo_advantages: scores of shape {tuple(scores.shape)} is not a multiple of group_size={group_size}")
    groups = scores.double().view(-1, group_size)
    centered = groups - groups.mean(dim=1, keepdim=True)
    if norm_by_std:
        centered = centered / (groups.std(dim=1, keepdim=True) + eps)
    equal = groups.max(dim=1, keepdim=True).values == groups.min(dim=1, keepdim=True).values
    return centered.masked_fill(equal, 0.0).view(-1).float()
