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
