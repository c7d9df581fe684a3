"""The records of one iteration table in one dock shard (``dockrl.dock.shard.iteration.IterationTable``):
its leases (``Lease``), its views of the ready rows of each consumer (``ReadyView``), and what a
take returns (``Taken``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple, Protocol

import numpy as np
import pyarrow as pa


class Taken(NamedTuple):
    """What ``take`` did: rows taken (global indexes) and the consumer's rows left."""

    rows: list[int]
    pending: int
    """Rows the consumer has not taken yet (after this take)."""
    held: int
    """Rows of the consumer leased by other owners, not acked nor finished: they may come back."""
    lease: str
    """Lease id the rows were taken under."""
    batch: pa.RecordBatch | None = None
    """With ``take(..., read=True)``: the cells of ``columns`` of the rows taken, in their order."""


@dataclass(eq=False)
class Lease:
    """A lease: rows of one consumer taken by one owner until acked, released or expired (``dockrl.dock.shard.leases``)."""

    id: str
    num: int  # the lease id's number in this iteration (``lease_at`` and ``acked_by`` hold it)
    owner: str
    consumer: int
    term_s: float
    expiry: float  # time.monotonic()
    rows: np.ndarray  # local row indexes, ascending
    whole_groups: bool
    undone: int = 0  # rows that would go back to the pool if it ended now (``leases.lease_done``): counted as held


class TableBits(Protocol):
    """The bits of an iteration table that a ``ReadyView`` is built from (``IterationTable``'s)."""

    ready: np.ndarray
    consumed: np.ndarray
    gcons: np.ndarray


class ReadyView:
    """The rows of consumer ``ci`` ready in ``cols`` and not taken yet, in units of ``unit`` rows (1, or whole groups).

    Kept up to date by every write, take and return (``IterationTable.set_ready``/``set_consumed``),
    so a take costs what it takes, not the size of the iteration: ``avail`` marks the available
    units, ``navail`` counts them, and no unit below ``lo`` is available, so a take hands out
    the first ready rows by scanning forward from ``lo`` (vectorized, in growing windows).
    """

    def __init__(self, it: TableBits, ci: int, cols: tuple[int, ...], unit: int) -> None:
        self.ci, self.cols, self.unit = ci, cols, unit
        self.nready = it.ready[:, list(cols)].sum(axis=1, dtype=np.int16)  # columns of the view ready, per row
        full = self.nready == len(cols)
        if unit == 1:
            self.avail = full & ~it.consumed[:, ci]
        else:
            self.unit_ready = full.reshape(-1, unit).sum(axis=1, dtype=np.int32)  # rows of each group fully ready
            self.avail = (self.unit_ready == unit) & (it.gcons[:, ci] == 0)
        self.navail = int(np.count_nonzero(self.avail))
        self.lo = 0

    def add(self, units: np.ndarray) -> None:
        """Units that just became available (each unavailable before)."""
        if len(units):
            self.avail[units] = True
            self.navail += len(units)
            self.lo = min(self.lo, int(units.min()))

    def remove(self, units: np.ndarray | slice) -> None:
        """Units that are not available any more (whether they were or not)."""
        was = self.avail[units]
        self.navail -= int(np.count_nonzero(was))
        self.avail[units] = False

    def first(self, k: int) -> np.ndarray:
        """The ``k`` smallest available units (``k <= navail``), ascending (the caller consumes them)."""
        out: list[np.ndarray] = []
        got, start, n = 0, self.lo, len(self.avail)
        width = max(256, 4 * k)
        while got < k and start < n:
            found = np.flatnonzero(self.avail[start:start + width])
            if not out:
                self.lo = start + int(found[0]) if len(found) else start + width  # nothing available below
            if len(found):
                found = found[: k - got] + start
                out.append(found)
                got += len(found)
            start, width = start + width, width * 2
        units = out[0] if len(out) == 1 else np.concatenate(out) if out else np.zeros(0, dtype=np.int64)
        assert len(units) == k, f"dock view lost track of its available rows ({len(units)} of {k})"
        return units
