"""The dock's per-token list cells as the right-padded ``(B, T)`` tensors the algorithms take."""

from __future__ import annotations

from typing import Sequence

import torch


def right_pad(rows: Sequence[Sequence[float]], T: int) -> torch.Tensor:
    """``B`` rows of per-token floats (each at most ``T`` long) → ``(B, T)`` float32, 0 after each row's end."""
    out = torch.zeros((len(rows), T), dtype=torch.float32)
    for i, r in enumerate(rows):
        out[i, : len(r)] = torch.tensor(r, dtype=torch.float32)
    return out


def response_mask(lengths: Sequence[int], T: int, loss_mask: Sequence[Sequence[int]] | None = None) -> torch.Tensor:
    """``(B, T)`` float32: 1 on the first ``lengths[i]`` tokens of row ``i``, 0 on padding; with
    ``loss_mask`` (a multi-turn rollout's column, ``(R_i,)`` each) only where it is 1 too, so the
    observation tokens between the model's turns count as padding does.

    Raises:
        ValueError: a ``loss_mask`` row whose length differs from its row's.
    """
    mask = (torch.arange(T).unsqueeze(0) < torch.tensor(list(lengths), dtype=torch.long).unsqueeze(1)).float()
    if loss_mask is None:
        return mask
    for i, (row, n) in enumerate(zip(loss_mask, lengths)):
        if len(row) != n:
            raise ValueError(f"response_mask: row {i} has {n} tokens but a loss_mask of {len(row)}")
    return mask * right_pad(loss_mask, T)
