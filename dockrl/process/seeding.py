"""The seed of each iteration: every stage in every process reseeds Python's and torch's global
generators per iteration (``seed_iteration``), so a resumed run samples as the uninterrupted one
(docs/resume.md).
"""

from __future__ import annotations

import hashlib
import random

import torch


def iteration_seed(seed: int, iteration: int) -> int:
    """The seed of ``iteration``: a 63-bit integer from SHA-256 of ``(seed, iteration)``."""
    digest = hashlib.sha256(f"dockrl:{seed}:{iteration}".encode()).digest()
    return int.from_bytes(digest[:8], "little") >> 1


def seed_iteration(seed: int, iteration: int) -> None:
    """Reseed Python's and torch's global generators for ``iteration`` (every stage, every process)."""
    s = iteration_seed(seed, iteration)
    random.seed(s)
    torch.manual_seed(s)
