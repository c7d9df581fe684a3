"""Where the rows of an iteration live: the sizes rules of an iteration and the row mapping of the shards.

An iteration has ``num_rows`` rows in prompt groups of ``group_size`` (``check_sizes``); shard
``s`` owns a contiguous range of whole groups (``shard_ranges``, ``ShardLayout``), and its
controller checks its slice (``check_layout``). ``dockrl.dock.client.core`` documents the mapping.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import numpy as np

from dockrl.dock.errors import DockError


def check_sizes(iteration: int, num_rows: int, group_size: int) -> None:
    """The sizes rule of an iteration: ``num_rows`` a positive multiple of ``group_size``.

    Raises:
        DockError: naming both sizes.
    """
    if group_size < 1 or num_rows < 1 or num_rows % group_size:
        raise DockError(
            f"open_iteration({iteration}): num_rows={num_rows} must be a positive multiple of group_size={group_size}"
        )


def check_layout(iteration: int, num_rows: int, group_size: int, first_row: int, total_rows: int | None) -> int:
    """``check_sizes``, and a shard's slice ``[first_row, first_row + num_rows)`` of ``total_rows``
    (default: up to its end) starting at a group; returns ``total_rows``.

    Raises:
        DockError: naming the sizes.
    """
    check_sizes(iteration, num_rows, group_size)
    total = first_row + num_rows if total_rows is None else total_rows
    if first_row < 0 or first_row % group_size or total < first_row + num_rows:
        raise DockError(
            f"open_iteration({iteration}): first_row={first_row} must be a non-negative multiple of "
            f"group_size={group_size}, and with num_rows={num_rows} within total_rows={total}"
        )
    return total


def shard_ranges(num_rows: int, group_size: int, num_shards: int) -> list[tuple[int, int]]:
    """Global row range ``[start, stop)`` of each shard: contiguous runs of whole groups."""
    groups = num_rows // group_size
    return [(s * groups // num_shards * group_size, (s + 1) * groups // num_shards * group_size) for s in range(num_shards)]


@dataclass(frozen=True)
class ShardLayout:
    """Where the rows of one iteration live: shard ``s`` owns ``ranges[s]``.

    Raises:
        DockError: sizes that ``ShardController.open_iteration`` refuses.
    """

    iteration: int
    num_rows: int
    group_size: int
    num_shards: int

    def __post_init__(self) -> None:
        check_sizes(self.iteration, self.num_rows, self.group_size)

    @functools.cached_property  # a claim asks for it every time
    def ranges(self) -> list[tuple[int, int]]:
        return shard_ranges(self.num_rows, self.group_size, self.num_shards)

    @functools.cached_property
    def active(self) -> list[int]:
        """The shards that own rows of the iteration (with fewer groups than shards some own none)."""
        return [s for s, (start, stop) in enumerate(self.ranges) if stop > start]

    def shard_meta(self, s: int) -> dict[str, int]:
        """What shard ``s`` stores (and ``describe``s) for this iteration."""
        first, stop = self.ranges[s]
        return {"iteration": self.iteration, "num_rows": self.num_rows, "group_size": self.group_size,
                "first_row": first, "stop_row": stop, "shard": s, "num_shards": self.num_shards}

    def split(self, rows: np.ndarray) -> dict[int, np.ndarray]:
        """Positions in ``rows`` of the rows each shard owns (shards with none left out).

        A row out of range goes to the shard owning the nearest row, which refuses it: the
        shard's checks are the only ones.
        """
        if self.num_shards == 1:
            return {0: np.arange(len(rows))}
        stops = np.array([stop for _, stop in self.ranges])
        shard = np.searchsorted(stops, np.clip(rows, 0, self.num_rows - 1), side="right")
        return {int(s): np.flatnonzero(shard == s) for s in np.unique(shard)}
