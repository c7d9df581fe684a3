"""DAPO's data-side pieces (Yu et al. 2025, arXiv 2503.14476): which groups dynamic sampling keeps,
and the soft overlong punishment of the reward. (Clip-higher and the token-level loss live with the
loss; overlong filtering is a mask in the actor.)"""

from __future__ import annotations

import torch


def mixed_groups(values: torch.Tensor, group_size: int) -> torch.Tensor:
    """Which groups dynamic sampling keeps: those whose values are not all equal (DAPO §3.2, eq. 11:
    ``0 < |{o_i : is_equivalent(a, o_i)}| < G``). A group whose rewards are all equal has zero
    group-relative advantage, so it adds no policy gradient.

    Args:
        values: ``(G·n,)`` one value per response (a reward, or 0/1 correctness), groups contiguous.
        group_size: n, responses per group.

    Returns:
        ``(G,)`` bool: group ``g`` (rows ``[g·n, (g+1)·n)``) has at least two different values.

    Raises:
        ValueError: ``values`` is not 1-D with a length that is a multiple of ``group_size``.
    """
    if values.dim() != 1 or group_size < 1 or values.numel() % group_size:
        raise ValueError(f"mixed_groups: got values of shape {tuple(values.shape)} for group_size={group_size}; "
                         "expected (G·n,) with n >= 1")
    groups = values.view(-1, group_size)
    return groups.max(dim=1).values != groups.min(dim=1).values


def overlong_penalty(lengths: torch.Tensor, *, max_length: int, buffer_length: int, penalty_factor: float) -> torch.Tensor:
    """The soft overlong punishment added to each response's reward (DAPO §3.4, eq. 13; verl's
    ``overlong_buffer``)::

        R_length(y) = 0                                     if |y| <= L_max - L_cache
                    = (L_max - L_cache - |y|) / L_cache · f  if L_max - L_cache < |y| <= L_max
                    = -f                                    if |y| > L_max

    with ``L_max = max_length``, ``L_cache = buffer_length`` and ``f = penalty_factor`` (eq. 13 has
    f = 1). The penalty falls linearly from 0 to ``-f`` over the last ``buffer_length`` tokens.

    Args:
        lengths: ``(B,)`` response lengths in tokens (any integer or float dtype).
        max_length: L_max, the longest response the rollout generates (``rollout.max_response_length``).
        buffer_length: L_cache, tokens before ``max_length`` where the penalty grows, ``1 <= L_cache <= L_max``.
        penalty_factor: f >= 0, the penalty at ``max_length``.

    Returns:
        ``(B,)`` float32 penalties, each in ``[-f, 0]``.

    Raises:
        ValueError: a buffer outside ``[1, max_length]`` or a negative ``penalty_factor``.
    """
    if not 1 <= buffer_length <= max_length:
        raise ValueError(f"overlong_penalty: buffer_length={buffer_length} must be from 1 to max_length={max_length}")
    if not penalty_factor >= 0:
        raise ValueError(f"overlong_penalty: penalty_factor={penalty_factor} must be >= 0")
    exceed = lengths.to(torch.float32) - (max_length - buffer_length)
    return (-exceed / buffer_length * penalty_factor).clamp(min=-penalty_factor, max=0.0)
