"""The dock controller of one shard: readiness and consumption bits, leases, and the cells (Arrow chunks).

A ``ShardController`` is the state of one dock shard; ``dockrl.dock.shard.service.ShardService`` wraps
one and is its only caller (stages reach it through the sharded front end
``dockrl.dock.client.dock_client.DockClient``, in either ``dock.mode``): ``open_iteration`` → ``put`` /
``take`` / ``get`` → ``close_iteration``, over its slice of rows (``open_iteration(...,
first_row=k, total_rows=N)``, so errors name global rows). ``take``, ``release``, ``missing``
and ``ack_rows`` are the metadata-only building blocks of a claim across shards; ``commit``
and ``locate`` those of a put and a read whose payload lives in a warehouse
(``dockrl.dock.warehouse.base``): the controller then holds object keys and offsets, never cells.

The controller holds the lock, the clock, the counters and the log (its state, lifecycle, leases
and snapshots in ``dockrl.dock.shard.controller_core``; its writes, reads and takes here); the state
lives in its parts: the open iteration's table (``dockrl.dock.shard.iteration``), the leases of a take and how
they end (``dockrl.dock.shard.leases``: a lease that ends un-acked returns its unfinished rows to the
pool; blocked claims wake at the next expiry, never by polling), the blocked takes
(``dockrl.dock.shard.waiters``: event-driven, each woken only when it can proceed), and snapshots
(``dockrl.dock.shard.controller_snapshot``: ``restore`` ends the old run's un-acked leases).

**Cost.** A take costs what it takes: per consumer and set of input columns the controller keeps
the ready, untaken rows (``ReadyView``, updated by every put, take, return and ack), leases are
integer arrays (``lease_at``: the lease number of each row), expiries a heap, and the rows other
owners hold are counted as leases change (``Lease.undone``), never recounted per take.
"""

from __future__ import annotations

import math
import time
import uuid
from typing import Mapping, Sequence

import numpy as np
import pyarrow as pa

from dockrl.dock.cells import arrow_columns
from dockrl.dock.errors import DockError
from dockrl.dock.rows import one_run
from dockrl.dock.shard import leases
from dockrl.dock.shard.controller_core import ControllerCore
from dockrl.dock.shard.iteration import IterationTable
from dockrl.dock.shard.records import Taken
from dockrl.dock.shard.waiters import Waiter, can_take, timeout_error
from dockrl.dock.warehouse.base import Located

DEFAULT_OWNER = "local"
"""Lease owner of claims made without one (the stages of one process share it)."""


class ShardController(ControllerCore):
    """The rows of one shard of the experience table, one iteration at a time.

    Args:
        schema: the column schema; every put is checked against it.
        timeout_s: default timeout of a blocking ``take``, seconds.
        lease_s: default lease term of a take, seconds (``math.inf``: leases never expire).

    Thread-safe: callers may block in ``take`` from many threads.

    Raises:
        ValueError: ``lease_s`` is not > 0.
    """

    # --- writes ----------------------------------------------------------------------------
    def put(
        self, rows: Sequence[int], columns: Mapping[str, Sequence | pa.Array] | pa.RecordBatch, *, iteration: int | None = None,
        ack: tuple[str, str] | None = None, own_buffers: bool = False,
    ) -> None:
        """Write cells: ``columns[name][k]`` is the cell of row ``rows[k]``.

        Atomic: either every cell is written or none. With ``iteration`` the put is refused
        unless that iteration is the open one. With ``ack=(consumer, lease)`` the rows are then
        acked as by ``ack_rows`` (under the same lock: one call for a stage's put and ack).
        ``own_buffers``: the arrays hold exactly their own buffers (read from an IPC stream), so
        ``dock/bytes_put`` counts their buffer sizes instead of summing the ranges they reference.

        Raises:
            DockError: unknown column, wrong Arrow type or length, row out of range or repeated,
                a cell already written, no open iteration, or another iteration open; with
                ``ack``, as ``ack_rows`` (the cells stay written).
        """
        rows_arr = np.asarray(rows, dtype=np.int64)
        arrays = arrow_columns(self.schema, columns, len(rows_arr))
        with self._cond:
            it = self._current("put", iteration)
            if ack is not None:
                it.check_request([], ack[0], f"ack by {ack[0]!r}")
            rows_arr, ascending = it.local_rows(rows_arr, "put")
            # distinct rows: ascending and spanning as many rows as they are is one run, written through a slice
            n = len(rows_arr)
            run = one_run(rows_arr) if ascending else None
            index = rows_arr if run is None else slice(*run)
            it.refuse_written(rows_arr, arrays, index)
            for name, array in arrays.items():
                nbytes = array.get_total_buffer_size() if own_buffers else array.nbytes
                it.add_chunk(name, array, index, np.arange(n), run, nbytes)
                self.bytes_put += nbytes
            acking = None if ack is None else (it.consumer_index[ack[0]], it.lease_num.get(ack[1], -2))
            held_all = self._written_locked(it, rows_arr, arrays, acking, run)
            if ack is not None:
                self._ack_locked(it, ack[0], ack[1], rows_arr, held_all=held_all, run=run)

    def commit(
        self, rows: Sequence[int], objects: Mapping[str, tuple[str, Sequence[int]]], *, iteration: int | None = None
    ) -> None:
        """Record cells written to a warehouse: the controller half of a put (metadata only).

        ``objects[name] = (key, offsets)``: the cell of column ``name`` for row ``rows[k]`` is
        row ``offsets[k]`` of the object ``key`` (``dockrl.dock.warehouse.base``). Atomic as ``put``,
        with the same errors and messages.

        Raises:
            DockError: unknown column, bad key or offsets, row out of range or repeated, a cell
                already written, no open iteration, or another iteration open.
        """
        rows_arr = np.asarray(rows, dtype=np.int64)
        refs: dict[str, tuple[str, np.ndarray]] = {}
        for name, (key, offsets) in objects.items():
            try:
                offsets_arr = np.asarray(offsets, dtype=np.int64)
            except (ValueError, TypeError, OverflowError):
                raise DockError(f"put: column {name!r} has offsets {str(offsets)[:80]}; expected integers") from None
            if not isinstance(key, str) or not key:
                raise DockError(f"put: column {name!r} has object key {key!r}; expected a non-empty string")
            if offsets_arr.shape != rows_arr.shape or (offsets_arr < 0).any():
                raise DockError(f"put: column {name!r} has {len(offsets_arr)} offsets for {len(rows_arr)} rows (or a negative one)")
            refs[name] = (key, offsets_arr)
        with self._cond:
            it = self._current("put", iteration)
            it.check_request(list(refs), None, "put")
            rows_arr = it.check_rows(rows_arr, "put")
            it.refuse_written(rows_arr, refs)
            for name, (key, offsets_arr) in refs.items():
                it.add_chunk(name, key, rows_arr, offsets_arr, None, 0)
            self._written_locked(it, rows_arr, refs)

    def _written_locked(
        self, it: IterationTable, rows: np.ndarray, names: Sequence[str] | Mapping[str, object], acking: tuple[int, int] | None = None,
        run: tuple[int, int] | None = None,
    ) -> bool:
        """``leases.mark_written``, then wake the takes it may unblock; returns its ``held_all``."""
        woken, held_all = leases.mark_written(it, rows, names, acking, run)
        for ci in woken:
            self._waiters.wake(it, ci)
        return held_all

    def locate(self, columns: Sequence[str], rows: Sequence[int], *, iteration: int | None = None) -> dict[str, Located]:
        """Where the cells of ``rows`` live in the warehouse, per column, in the order of ``rows``.

        Raises:
            DockError: as ``get``; also a cell that was ``put`` (held in memory), not committed.
        """
        rows_arr = np.asarray(rows, dtype=np.int64)
        with self._cond:
            it = self._current("get", iteration)
            it.check_request(columns, None, "get")
            return it.locate(columns, it.check_rows(rows_arr, "get"))

    # --- reads -----------------------------------------------------------------------------
    def _gather(self, it: IterationTable, columns: Sequence[str], rows: np.ndarray, run: tuple[int, int] | None = None) -> pa.RecordBatch:
        """The cells of ``columns`` at local ``rows`` (``run``: they are the range ``[start, stop)``, ascending)."""
        arrays, nbytes = it.gather(columns, rows, run)
        self.bytes_read += nbytes
        key = tuple(columns)
        schema = self._arrow_schemas.get(key)
        if schema is None:
            schema = self._arrow_schemas[key] = self.schema.arrow_schema(list(columns))
        return pa.RecordBatch.from_arrays(arrays, schema=schema)

    def get(self, columns: Sequence[str], rows: Sequence[int], *, iteration: int | None = None) -> pa.RecordBatch:
        """Read cells without consuming them (driver, metrics, checkpoints).

        Raises:
            DockError: unknown column, row out of range, a cell not yet written, or (with
                ``iteration``) another iteration open.
        """
        rows_arr = np.asarray(rows, dtype=np.int64)
        with self._cond:
            it = self._current("get", iteration)
            it.check_request(columns, None, "get")
            rows_arr = it.check_rows(rows_arr, "get")
            it.refuse_unwritten(columns, rows_arr)
            return self._gather(it, columns, rows_arr)

    def take(
        self, consumer: str, columns: Sequence[str], count: int, *, whole_groups: bool = False, at_least: int | None = None,
        timeout_s: float | None = None, iteration: int | None = None, owner: str | None = None, lease: str | None = None,
        lease_s: float | None = None, wait_held: bool = True, read: bool = False,
    ) -> Taken:
        """Claim rows, and with ``read`` their cells of ``columns``: the building block of a claim across shards.

        Takes up to ``count`` ready rows (in ``columns``, not yet taken by ``consumer``) once
        ``min(at_least, rows pending)`` are ready (``at_least=None`` means ``count``; ``0`` never
        blocks), under lease ``lease`` of ``owner`` for ``lease_s`` seconds (defaults: a fresh
        lease id, ``DEFAULT_OWNER``, the controller's term; taking again under an existing id
        adds rows to it and renews it). With ``whole_groups`` only complete prompt groups are
        taken. With no row pending, ``at_least > 0`` and ``wait_held``, it blocks while other
        owners hold un-finished rows of the consumer (they come back if their lease ends).

        Raises:
            DockError: unknown column or consumer, a count not positive (or not a multiple of
                the group size with ``whole_groups``), a bad lease term, a negative
                ``at_least``, no open iteration or another one open, or a ``lease`` id of
                another owner or consumer.
            DockTimeoutError: not enough rows became ready within the timeout; names the
                columns still missing and how many rows lack each, and the rows other owners hold.
        """
        rows, pending, held, lease, batch = self.take_rows(
            consumer, columns, count, whole_groups=whole_groups, at_least=at_least, timeout_s=timeout_s, iteration=iteration,
            owner=owner, lease=lease, lease_s=lease_s, wait_held=wait_held, read=read,
        )
        return Taken(rows.tolist(), pending, held, lease, batch)

    def take_rows(
        self, consumer: str, columns: Sequence[str], count: int, *, whole_groups: bool = False, at_least: int | None = None,
        timeout_s: float | None = None, iteration: int | None = None, owner: str | None = None, lease: str | None = None,
        lease_s: float | None = None, wait_held: bool = True, read: bool = False,
    ) -> tuple[np.ndarray, int, int, str, pa.RecordBatch | None]:
        """``take`` with the rows as an int64 array of global indexes (ascending): (rows, pending, held, lease, batch).

        Raises: as ``take``.
        """
        lease = lease or uuid.uuid4().hex
        with self._cond:
            it, rows, pending, held, run = self._take_locked(
                consumer, columns, count, whole_groups, count if at_least is None else at_least, timeout_s, iteration,
                owner or DEFAULT_OWNER, lease, lease_s, wait_held,
            )
            batch = self._gather(it, columns, rows, run) if read else None
            return rows + it.first_row, pending, held, lease, batch

    def _take_locked(  # caller holds self._cond; returns local row indexes
        self, consumer: str, columns: Sequence[str], count: int, whole_groups: bool, at_least: int,
        timeout_s: float | None, iteration: int | None, owner: str, lease_id: str, lease_s: float | None,
        wait_held: bool,
    ) -> tuple[IterationTable, np.ndarray, int, int, tuple[int, int] | None]:  # ..., one_run(rows)
        timeout = self.timeout_s if timeout_s is None else timeout_s
        term = self.lease_s if lease_s is None else lease_s
        start = time.monotonic()
        deadline = start + timeout
        what = f"claim by {consumer!r}"
        if not term > 0:
            raise DockError(f"{what}: lease_s={term!r} must be > 0 seconds")
        waiter: Waiter | None = None
        try:
            while True:
                it = self._current(what, iteration)
                ci, cols = it.claim_request(consumer, columns, count, whole_groups, at_least, owner, lease_id, what)
                next_expiry = self._expire_locked(it)
                unit = it.group_size if whole_groups else 1
                view = it.view(ci, cols, unit)
                num_pending = it.npending[ci]
                held = it.held(ci, owner)
                if can_take(num_pending, held, view.navail * unit, at_least, wait_held):
                    units = view.first(min(count // unit, view.navail))
                    rows = units if unit == 1 else (units[:, None] * unit + np.arange(unit)).reshape(-1)
                    run = one_run(rows)  # ascending: one run when they span as many rows as they are
                    if len(rows):
                        it.set_consumed(ci, rows, True, run)
                        leases.grant(it, ci, rows, owner, lease_id, term, whole_groups, time.monotonic(), run)
                        self._waiters.wake(it, ci)  # waiters of this consumer may need fewer rows now
                    self._waiters.forget(waiter)
                    waiter = None  # it took: no wake-up to hand on
                    self.wait_s += time.monotonic() - start
                    return it, rows, num_pending - len(rows), held, run
                now = time.monotonic()
                remaining = deadline - now
                if remaining <= 0:
                    raise timeout_error(what, timeout, it, ci, columns, min(at_least, num_pending), view.navail * unit, held)
                if waiter is None or waiter.ci != ci:
                    self._waiters.forget(waiter)
                    waiter = self._waiters.add(ci, view, count, at_least, wait_held, owner)
                waiter.view, waiter.notified = view, False
                wait = max(min(remaining, next_expiry - now), 0.0)  # wake at the next lease expiry: rows may come back
                waiter.cond.wait(wait if math.isfinite(wait) else None)
        finally:
            if waiter is not None:
                self._waiters.forget(waiter)
                if waiter.notified and self._it is not None:  # woken for rows it did not take: hand the wake-up on
                    self._waiters.wake(self._it, waiter.ci)

    def missing(self, consumer: str, columns: Sequence[str], *, iteration: int | None = None) -> dict[str, int]:
        """For each of ``columns``, how many rows not yet taken by ``consumer`` lack it (zeros left out).

        Raises:
            DockError: unknown column or consumer, no open iteration, or another iteration open.
        """
        with self._cond:
            it = self._current(f"missing for {consumer!r}", iteration)
            it.check_request(columns, consumer, f"missing for {consumer!r}")
            return it.missing(it.consumer_index[consumer], columns)
