"""The dock API every stage, ``ReplicaDock`` and the driver are written against (docs/design.md §2).

``Dock`` is the one protocol; ``dockrl.dock.client.dock_client.open_dock`` builds the in-process dock of
a run from its ``dock`` config. Rows are indexed ``0 .. num_rows-1`` within an iteration; prompt ``i`` owns
rows ``[i·n, (i+1)·n)`` (n = group size). A stage loops ``claim`` → compute → ``put(...,
ack=claim)``; the driver ``open_iteration`` → fills the inputs → waits → ``close_iteration``.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol, TypeAlias

import numpy as np
import pyarrow as pa

if TYPE_CHECKING:
    from dockrl.dock.shard.kept_rollouts import KeepSpec

Columns: TypeAlias = Mapping[str, Sequence[Any] | pa.Array] | pa.RecordBatch
"""The cells of a put: per column name, one value (or Arrow array element) per row."""


@dataclass(frozen=True)
class Claim:
    """Rows handed to one consumer: their indexes and the requested columns.

    ``batch`` has one record per row, in the order of ``rows``. An empty claim (no rows) means
    the consumer is done with the iteration: every row is acked, finished, or leased by the
    claiming owner itself.
    """

    iteration: int
    rows: list[int]
    batch: pa.RecordBatch
    lease: str = ""
    """Id of the lease on ``rows`` (empty for an empty claim): ``ack`` the claim after the put."""
    consumer: str = ""
    """The consumer that claimed the rows."""
    row_array: np.ndarray | None = field(default=None, repr=False, compare=False)
    """``rows`` as an int64 array, when the dock that made the claim kept one (``put(claim.rows, ..., ack=claim)``
    then converts nothing). A copy made at claim time: ``put`` trusts it whenever it is passed ``claim.rows`` itself
    and the lengths agree, so do not change ``rows`` in place (pass a new list to write other rows)."""
    shape: tuple[tuple[str, ...], int, bool] | None = field(default=None, repr=False, compare=False)
    """(columns, count, whole_groups) of the ``claim`` call that made it, when the dock carries the next claim
    of the same shape on the put that acks this one (``DockClient``); None: the next claim is its own call."""

    def __len__(self) -> int:
        return len(self.rows)


class StageDock(Protocol):
    """The part of the dock a stage loop uses (``run_iteration``): the open iteration's sizes,
    claim, put, ack. ``Dock`` has all of it; ``ReplicaDock`` (the ranks of one model replica
    sharing claims) offers only this.

    Raises: as ``Dock``.
    """

    @property
    def num_rows(self) -> int:
        """Rows of the open iteration."""

    @property
    def group_size(self) -> int:
        """Rows per prompt group of the open iteration."""

    def put(self, rows: Sequence[int], columns: Columns, *, iteration: int | None = None, ack: Claim | None = None) -> None:
        """Write ``columns[name][k]`` as the cell of row ``rows[k]``; refused unless ``iteration``
        (when given) is the open one; with ``ack`` the claim is acked once the put succeeded (and a
        dock may take the consumer's next claim of the same shape with it: ``Claim.shape``)."""

    def claim(
        self, consumer: str, columns: Sequence[str], count: int, *, whole_groups: bool = False, timeout_s: float | None = None,
    ) -> Claim:
        """Take up to ``count`` rows ready in all ``columns`` and not yet taken by ``consumer``,
        leased to this dock's owner; blocks until ``min(count, rows left)`` are ready. An empty
        claim means the consumer is done with the iteration."""

    def ack(self, claim: Claim) -> None:
        """The claim's consumer is done with its rows (after its put): end the lease for good."""


class Dock(StageDock, Protocol):
    """The transfer dock as a stage or the driver sees it, in either ``dock.mode``.

    Every method raises ``DockError`` (``dockrl.dock.errors``) for bad use: unknown column or
    consumer, a row out of range, a cell written twice (but one of a ``Column.rewritable`` column), no open iteration; the waits raise
    ``DockTimeoutError`` naming what they waited for.
    """

    # --- iteration lifecycle (driver) ---------------------------------------------------------
    def open_iteration(self, iteration: int, num_rows: int, group_size: int, *, announce: bool = True) -> None:
        """Open an empty table of ``num_rows`` rows in groups of ``group_size``; with
        ``announce=False`` stages see it only after ``announce(iteration)``. Up to
        ``dock.max_inflight`` iterations are open at once, in order; calls that name no
        iteration go to the one this handle opened or waited for (``wait_iteration``) last."""

    def announce(self, iteration: int) -> None:
        """Let the stages' ``wait_iteration`` return ``iteration``, which must be open."""

    def close_iteration(self, iteration: int | None = None, *, keep: KeepSpec | None = None) -> None:
        """Drop ``iteration`` (default: every open one); claims blocked on it fail with ``DockError``. With ``keep``
        (``run.keep_rollouts``) the shards write their rows of it as Parquet in the background (``dockrl.dock.shard.kept_rollouts``)."""

    def flush_rollouts(self, timeout_s: float | None = None) -> dict[str, float]:
        """Block until the shards wrote every iteration closed with ``keep``; the ``rollouts/*`` counters (docs/rollouts.md)."""

    # --- data (stages): as StageDock, and reads without consuming ---------------------------------
    def get(self, columns: Sequence[str], rows: Sequence[int], *, iteration: int | None = None) -> pa.RecordBatch:
        """Read written cells without consuming them, in the order of ``rows``."""

    def drop(self, rows: Sequence[int], *, iteration: int | None = None) -> None:
        """Take ``rows`` out of the iteration for every consumer that has not taken them yet: they
        count as acked for it, so its claims skip them and end once nothing else is left (rows a
        consumer took stay its own). Dynamic sampling drops filtered groups and unneeded rounds."""

    # --- leases -------------------------------------------------------------------------------
    def renew(self, owner: str) -> int:
        """Push every lease of ``owner`` a full term ahead; returns the leases renewed."""

    def release_owner(self, owner: str) -> int:
        """End every lease of ``owner`` now (its process died); returns the rows back in the pool."""

    # --- checkpoints and metrics ------------------------------------------------------------------
    def snapshot(self, uri: str) -> None:
        """Write the dock's state (open iteration, bits, payload) to the directory ``uri``."""

    def restore(self, uri: str) -> None:
        """Load the snapshot at ``uri`` into this dock, which must have no open iteration."""

    def stats(self) -> dict[str, float]:
        """Counters for metrics: ``dock/bytes_put``, ``dock/bytes_read``, ``dock/wait_s``, ``dock/shards``, …"""

    # --- control channel ------------------------------------------------------------------------
    def wait_iteration(self, after: int, timeout_s: float | None = None) -> int | None:
        """Block until an iteration newer than ``after`` is announced (the oldest such); ``None`` after ``finish()``."""

    def report(self, iteration: int, stage: str, metrics: Mapping[str, float]) -> None:
        """Record ``stage``'s flat metrics of ``iteration``."""

    def wait_reports(self, iteration: int, stages: Sequence[str], timeout_s: float | None = None) -> dict[str, dict[str, float]]:
        """Block until each of ``stages`` reported ``iteration``; return ``{stage: metrics}``."""

    def finish(self) -> None:
        """No further iteration will open: idle ``wait_iteration`` calls return ``None``."""

    def close(self) -> None:
        """Release what this handle holds (lease heartbeat, connections, in-process shards)."""

