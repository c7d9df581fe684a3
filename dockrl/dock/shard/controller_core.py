"""What ``ShardController`` (``dockrl.dock.shard.controller``) builds on: its state and lock, the
lifecycle of its iteration, the leases of its takes (expiry, ``release``, ``drop``, ``ack_rows``,
``renew``, ``release_owner``), its snapshots and its counters.

The state of a lease lives in the iteration table and changes in ``dockrl.dock.shard.leases``; here the
controller takes its lock, reads the clock, counts, and wakes the blocked takes
(``dockrl.dock.shard.waiters``) a change may unblock. A lease that ends un-acked returns its unfinished
rows to the pool; blocked claims wake at the next expiry, never by polling.
"""

from __future__ import annotations

import math
import threading
import time
from typing import Any, Sequence

import numpy as np
import pyarrow as pa

from dockrl.dock.errors import DockError
from dockrl.dock.schema import Schema
from dockrl.dock.shard import leases
from dockrl.dock.shard.controller_snapshot import check_dock_snapshot, dock_snapshot, load_iteration
from dockrl.dock.shard.iteration import IterationTable
from dockrl.dock.shard.layout import check_layout
from dockrl.dock.shard.records import Lease
from dockrl.dock.shard.waiters import Waiters
from dockrl.dock.snapshot import read_meta, write_snapshot


class ControllerCore:
    """``ShardController``'s state, iteration lifecycle, leases, snapshots and counters (its arguments are documented there)."""

    def __init__(self, schema: Schema, *, timeout_s: float = 600.0, lease_s: float = 300.0) -> None:
        if not lease_s > 0:
            raise ValueError(f"ShardController: lease_s={lease_s!r}; expected a number of seconds > 0")
        self.schema = schema
        self.timeout_s = timeout_s
        self.lease_s = lease_s
        self.leases_expired = 0
        self.rows_returned = 0
        self._lock = threading.RLock()
        self._cond = threading.Condition(self._lock)  # guards everything; blocked takes wait on conditions of their own
        self._waiters = Waiters(self._lock)  # blocked takes by consumer, oldest first
        self._arrow_schemas: dict[tuple[str, ...], pa.Schema] = {}  # of the column lists read so far
        self._it: IterationTable | None = None
        self.bytes_put = 0
        self.bytes_read = 0
        self.wait_s = 0.0

    # --- iteration lifecycle -------------------------------------------------------------
    def open_iteration(
        self, iteration: int, num_rows: int, group_size: int, *, first_row: int = 0, total_rows: int | None = None,
    ) -> None:
        """Start an empty table of ``num_rows`` rows in groups of ``group_size``.

        Rows are numbered ``first_row .. first_row+num_rows-1`` (a shard's slice of the
        ``total_rows`` rows of the iteration, default all of them); ``first_row`` must be a
        multiple of ``group_size`` so groups stay whole.

        Raises:
            DockError: an iteration is still open, or the sizes are invalid.
        """
        total = check_layout(iteration, num_rows, group_size, first_row, total_rows)
        with self._cond:
            if self._it is not None:
                raise DockError(f"open_iteration({iteration}): iteration {self._it.iteration} is still open")
            self._it = IterationTable(self.schema, iteration, num_rows, group_size, first_row, total)
            self._waiters.wake_all()

    def close_iteration(self) -> IterationTable | None:
        """Drop the current iteration's table; later puts and claims raise ``DockError``. Returns the table
        (None if none was open), which nothing changes any more: a shard keeps its rows (``dockrl.dock.shard.kept_rollouts``)."""
        with self._cond:
            it, self._it = self._it, None
            self._waiters.wake_all()
        return it

    def _current(self, what: str, iteration: int | None = None) -> IterationTable:
        if self._it is None:
            raise DockError(f"{what}: no iteration is open (call open_iteration first, or it was closed)")
        if iteration is not None and iteration != self._it.iteration:
            raise DockError(f"{what}: iteration {iteration} is not open; the open iteration is {self._it.iteration}")
        return self._it

    # --- leases ------------------------------------------------------------------------------
    def release(
        self, consumer: str, rows: Sequence[int] | np.ndarray, *, iteration: int | None = None, lease: str | None = None,
    ) -> None:
        """Hand rows taken by ``consumer`` back, as if never taken (undo of a claim that failed midway).

        With ``lease``, only the rows still held under that lease go back; the others (their lease
        ended and they went to another claim, or they were acked) are left as they are: a late
        release never hands back rows another claim holds now.

        Raises:
            DockError: unknown consumer, row out of range or repeated, no open iteration, or
                another iteration open; without ``lease``, a row not taken by ``consumer`` or already acked.
        """
        what = f"release by {consumer!r}"
        with self._cond:
            it = self._current(what, iteration)
            it.check_request([], consumer, what)
            local = it.check_rows(np.asarray(rows, dtype=np.int64), what)
            if lease is not None:
                self._expire_locked(it)
            if leases.release(it, it.consumer_index[consumer], local, lease, what):
                self._waiters.wake(it, it.consumer_index[consumer])

    def drop(self, rows: Sequence[int], *, iteration: int | None = None) -> None:
        """Take ``rows`` (global indexes) out of the iteration for every consumer that has not taken
        them: they count as acked for those consumers, whose claims never return them and end (empty)
        once nothing else is left. Rows a consumer took or acked stay as they are for it. Idempotent.
        (Dynamic sampling: the advantage stage drops the groups it filters out and the rounds it
        does not need, docs/algorithms.md.)

        Raises:
            DockError: row out of range or repeated, no open iteration, or another iteration open.
        """
        with self._cond:
            it = self._current("drop", iteration)
            for ci in it.drop(it.check_rows(np.asarray(rows, dtype=np.int64), "drop")):
                self._waiters.wake(it, ci)  # fewer rows to wait for: a claim may be done

    def _end_leases_locked(self, it: IterationTable, ended: list[Lease], why: str) -> int:
        """End un-acked leases (``leases.end_lease``), wake the takes; returns the rows returned to the pool."""
        returned = sum(leases.end_lease(it, lease, why) for lease in ended)
        self.rows_returned += returned
        for ci in {lease.consumer for lease in ended}:
            self._waiters.wake(it, ci)
        return returned

    def _expire_locked(self, it: IterationTable) -> float:
        """End the leases past their expiry; return the next expiry (``time.monotonic``), inf if none."""
        while expired := leases.pop_expired(it, time.monotonic()):
            self.leases_expired += len(expired)
            self._end_leases_locked(it, expired, f"expired (not renewed within its {expired[0].term_s:g}s term)")
        return it.expiries[0][0] if it.expiries else math.inf

    def ack_rows(self, consumer: str, lease: str, rows: Sequence[int], *, iteration: int | None = None) -> None:
        """``consumer`` is done with ``rows`` (global indexes) it took under ``lease`` (after its put): end the lease for good.

        Idempotent. A lease that already ended (expired, or ``release_owner``) is still
        accepted for rows it finished or that nobody re-claimed since.

        Raises:
            DockError: ``iteration`` not open, unknown consumer, a row out of range or repeated,
                or rows of the lease ended before the ack and were re-delivered to another
                claim (the message names them; the other rows are acked).
        """
        what = f"ack by {consumer!r}"
        with self._cond:
            it = self._current(what, iteration)
            it.check_request([], consumer, what)
            self._ack_locked(it, consumer, lease, it.check_rows(np.asarray(rows, dtype=np.int64), what))

    def _ack_locked(
        self, it: IterationTable, consumer: str, lease: str, local: np.ndarray, held_all: bool = False, run: tuple[int, int] | None = None,
    ) -> None:
        """``ack_rows`` of checked local rows (``held_all``: the caller saw every row held under ``lease``;
        ``run``: the rows are the range ``[start, stop)``, ascending)."""
        expired = self.leases_expired
        self._expire_locked(it)
        refused = leases.ack(it, consumer, lease, local, held_all=held_all and expired == self.leases_expired, run=run)
        self._waiters.wake(it, it.consumer_index[consumer])
        if refused:
            raise DockError(f"ack by {consumer!r}: {refused}")

    def renew(self, owner: str) -> int:
        """Push the expiry of every lease of ``owner`` a full term ahead (a heartbeat).

        Returns the number of leases renewed (0 when no iteration is open).
        """
        with self._cond:
            if self._it is None:
                return 0
            it = self._it
            self._expire_locked(it)
            return leases.renew(it, owner, time.monotonic())

    def release_owner(self, owner: str) -> int:
        """End every lease of ``owner`` now, as if expired (the owner's process died).

        Returns the number of rows returned to the ready pool (finished rows count as acked).
        """
        with self._cond:
            if self._it is None:
                return 0
            it = self._it
            ended = sorted((it.leases[i] for i in it.by_owner.get(owner, ())), key=lambda lease: lease.num)
            return self._end_leases_locked(self._it, ended, f"released (owner {owner!r} is gone)")

    # --- snapshots ---------------------------------------------------------------------------
    def snapshot(self, uri: str, *, extra: dict[str, Any] | None = None) -> None:
        """Write the dock's state to ``uri`` (a directory: local path, ``file://`` or ``s3://``).

        Stores the open iteration (or none), its readiness, consumed and acked bits, and every
        written cell as Arrow IPC; ``extra`` is stored beside it (a shard stores its layout).
        Atomic: a snapshot cut short is never read as complete (``dockrl.dock.snapshot``).

        Raises:
            DockError: the filesystem refused a write.
        """
        with self._cond:
            if self._it is not None:
                self._expire_locked(self._it)
            meta, tables = dock_snapshot(self.schema, self._it, extra)
        write_snapshot(uri, meta, tables)

    def restore(self, uri: str, *, extra: dict[str, Any] | None = None) -> dict[str, Any] | None:
        """Load the snapshot at ``uri`` into this dock, which must have no open iteration.

        Un-acked leases of the snapshot end here (their holders belong to the old run): their
        rows return to the ready pool, or count as acked where the consumer's outputs are
        written. With ``extra`` the snapshot's stored ``extra`` must equal it (a shard checks
        its layout). Returns the stored ``extra``.

        Raises:
            DockError: no complete snapshot at ``uri``, another snapshot version, schema or
                ``extra``, an inconsistent snapshot, or an iteration is open here.
        """
        meta = read_meta(uri)
        what = f"restore from {uri!r}"
        check_dock_snapshot(self.schema, meta, what, extra)
        it, returned = (None, 0) if meta["iteration"] is None else load_iteration(self.schema, uri, meta, what)
        with self._cond:
            if self._it is not None:
                raise DockError(f"{what}: iteration {self._it.iteration} is open here; close it first")
            self._it = it
            self.rows_returned += returned
            self._waiters.wake_all()
        return meta["extra"]

    def stats(self) -> dict[str, float]:
        """Counters for metrics: ``dock/bytes_put``, ``dock/bytes_read`` (a read served as a zero-copy
        slice of one put's cells counts that put's bytes pro rata), ``dock/wait_s``,
        ``dock/leases_expired`` and ``dock/rows_returned`` (rows back to the pool after a lease
        ended un-acked)."""
        with self._cond:
            return {"dock/bytes_put": self.bytes_put, "dock/bytes_read": self.bytes_read, "dock/wait_s": self.wait_s,
                    "dock/leases_expired": self.leases_expired, "dock/rows_returned": self.rows_returned}
