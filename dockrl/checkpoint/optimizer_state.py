"""The actor's and the critic's optimizer state in a checkpoint (``optimizer.pt``, one file per actor
rank): ``save_optimizer`` writes it, ``load_optimizer`` restores it into an engine built over the
checkpoint's weights, keeping the engine's kernel choice (docs/resume.md).
"""

from __future__ import annotations

import contextlib
from pathlib import Path
from typing import Any

import torch

OPTIMIZER_FILE = "optimizer.pt"


def optimizer_file(rank: int = 0) -> str:
    """Name of the optimizer state of actor rank ``rank`` in a checkpoint: ``optimizer.pt`` for
    rank 0 (the only one of a single-process actor), ``optimizer.rank<r>.pt`` for the other
    ranks of a multi-rank hybrid actor, each holding its own TP/PP shard's AdamW state."""
    return OPTIMIZER_FILE if rank == 0 else f"optimizer.rank{rank}.pt"


def save_optimizer(engine: Any, checkpoint: Path, rank: int = 0) -> Path:
    """Write ``engine.optimizer.state_dict()`` to ``CHECKPOINT/optimizer_file(rank)``.

    Raises:
        ValueError: the engine has no optimizer (a frozen engine).
    """
    optimizer = getattr(engine, "optimizer", None)
    if optimizer is None:
        raise ValueError(f"save_optimizer: {type(engine).__name__} has no optimizer to checkpoint (trainable=False?)")
    path = Path(checkpoint) / optimizer_file(rank)
    tmp = path.with_suffix(".pt.tmp")
    try:
        torch.save(optimizer.state_dict(), tmp)
    except BaseException:  # SIGTERM or Ctrl-C mid-write, a full disk: no half-written file of the optimizer's size left behind
        with contextlib.suppress(OSError):
            tmp.unlink(missing_ok=True)
        raise
    tmp.replace(path)
    return path


KERNEL_CHOICES = ("fused", "foreach")
"""AdamW param-group keys that pick an implementation for the device, not a hyperparameter:
``load_optimizer`` keeps the engine's."""


def load_optimizer(engine: Any, checkpoint: Path, rank: int = 0) -> None:
    """Load ``CHECKPOINT/optimizer_file(rank)`` into ``engine.optimizer`` (built over the checkpoint's weights).

    The moments, steps and hyperparameters come from the file, but each param group's kernel
    choice (``fused``, ``foreach``) stays the one the engine made for its device
    (``dockrl.engines.micro_batching.adamw``): a checkpoint written before fused AdamW (``fused: None``) does
    not turn it off, and one written on a device with a fused kernel does not carry ``fused: True``
    to a device without it. The steps are placed as that choice needs (a fused or capturable
    AdamW keeps them on the parameters' device).

    Raises:
        ValueError: the engine has no optimizer, or the file is missing.
    """
    optimizer = getattr(engine, "optimizer", None)
    path = Path(checkpoint) / optimizer_file(rank)
    if optimizer is None:
        raise ValueError(f"load_optimizer: {type(engine).__name__} has no optimizer to restore into")
    if not path.is_file():
        raise ValueError(f"run.resume: checkpoint {checkpoint} has no {path.name} (written by an older version, "
                         "or by an actor with another parallel layout?)")
    state = torch.load(path, map_location="cpu", weights_only=True)
    for saved, group in zip(state.get("param_groups", ()), getattr(optimizer, "param_groups", ())):
        saved.update({k: group[k] for k in KERNEL_CHOICES if k in group})  # before loading: it places the steps by them
    optimizer.load_state_dict(state)
