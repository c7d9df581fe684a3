"""The dock controller of one shard: readiness and consumption bits, leases, and the cells (Arrow chunks).

A ``ShardController`` is the state of one dock shard; ``dockrl.dock.shard.ShardService`` wraps
one and is its only caller (stages reach it through the sharded front end
``dockrl.dock.client.DockClient``, in either ``dock.mode``): ``open_iteration`` → ``put`` /
``take`` / ``get`` → ``close_iteration``, over its slice of rows (``open_iteration(...,
first_row=k, total_rows=N)``, so errors name global rows). ``take``, ``release``, ``missing``
and ``ack_rows`` are the metadata-only building blocks of a claim across shards; ``commit``
and ``locate`` those of a put and a read whose payload lives in a warehouse
(``dockrl.dock.warehouse``): the controller then holds object keys and offsets, never cells.
Waiting is event-driven on a condition variable, never a sleep-poll loop.

**Leases.** A take is a lease: for each (row, consumer) it took, the controller records the
``lease`` id, its ``owner`` (the claiming client; ``DEFAULT_OWNER`` if none) and an expiry
``lease_s`` seconds ahead. The consumer acks (``ack_rows``) after its put, which ends the
lease for good. ``renew(owner)`` pushes the expiry of every lease of an owner ahead (the
networked client does it from a heartbeat thread); ``release_owner(owner)`` ends them at once
(a launcher that saw the owner's process die). A lease that ends without an ack (expiry,
``release_owner``, ``restore``) returns its rows to the ready pool, except rows whose output
columns for that consumer (schema columns whose producer is the consumer) are all written:
the put is the commit, so those rows count as acked and are not computed twice. Blocked
claims wake at the next expiry (the condition wait is bounded by it), never by polling.

**When a consumer is done.** A take of no rows with none pending means every row of the consumer is acked,
finished (outputs written), or leased by the claiming owner itself. While rows are leased by
another owner and not finished, a take with nothing to take blocks: they may come back.

**Snapshots.** ``snapshot(uri)`` writes the open iteration's metadata (layout, readiness,
consumed and acked bits) and payload as Arrow IPC files through ``pyarrow.fs``
(``dockrl.dock.snapshot``); ``restore(uri)`` loads it into a dock with no open iteration, and
un-acked leases end there (their holders belong to the old run).
"""

from __future__ import annotations

import logging
import math
import threading
import time
import uuid
from dataclasses import dataclass
from typing import Any, Mapping, NamedTuple, Sequence

import numpy as np
import pyarrow as pa

from dockrl.dock.errors import DockError, DockTimeoutError
from dockrl.dock.schema import Schema
from dockrl.dock.snapshot import read_meta, read_table, write_snapshot
from dockrl.dock.warehouse import Located

logger = logging.getLogger(__name__)

DEFAULT_OWNER = "local"
"""Lease owner of claims made without one (the stages of one process share it)."""


def arrow_columns(
    schema: Schema, columns: Mapping[str, Sequence | pa.Array] | pa.RecordBatch, num_rows: int, what: str = "put"
) -> dict[str, pa.Array]:
    """Check and convert the columns of a put to Arrow arrays of the schema's types.

    Raises:
        DockError: unknown column, wrong Arrow type, values that do not convert, or a column
            whose length is not ``num_rows``.
    """
    if isinstance(columns, pa.RecordBatch):
        columns = {name: columns.column(name) for name in columns.schema.names}
    arrays: dict[str, pa.Array] = {}
    for name, values in columns.items():
        try:
            col = schema.column(name)
        except KeyError as e:
            raise DockError(f"{what}: {e.args[0]}") from None
        if isinstance(values, pa.ChunkedArray):
            values = values.combine_chunks()
        if isinstance(values, pa.Array):
            if values.type != col.type:
                raise DockError(f"{what}: column {name!r} has Arrow type {values.type}; schema says {col.type}")
            array = values
        else:
            try:
                array = pa.array(list(values), type=col.type)
            except (pa.ArrowInvalid, pa.ArrowTypeError, TypeError, OverflowError) as e:
                raise DockError(f"{what}: column {name!r} values do not convert to {col.type}: {e}") from None
        if len(array) != num_rows:
            raise DockError(f"{what}: column {name!r} has {len(array)} values for {num_rows} rows")
        arrays[name] = array
    return arrays


def _slice_cells(chunks: list[pa.Array], loc: np.ndarray, type_: pa.DataType) -> pa.Array:
    """The cells at ``loc`` (``(k, 2)`` rows of chunk id, offset), in order, as one array.

    Runs of consecutive cells of one chunk are sliced (zero-copy) and the pieces concatenated
    once, so a read costs what it returns, not the size of every chunk put so far.
    """
    if not len(loc):
        return pa.array([], type=type_)
    chunk, offset = loc[:, 0], loc[:, 1]
    breaks = np.flatnonzero((chunk[1:] != chunk[:-1]) | (offset[1:] != offset[:-1] + 1)) + 1
    starts, stops = np.concatenate([[0], breaks]), np.concatenate([breaks, [len(loc)]])
    return pa.concat_arrays([chunks[chunk[a]].slice(offset[a], b - a) for a, b in zip(starts, stops)])


def check_sizes(iteration: int, num_rows: int, group_size: int) -> None:
    """The sizes rule of an iteration: ``num_rows`` a positive multiple of ``group_size``.

    Raises:
        DockError: naming both sizes.
    """
    if group_size < 1 or num_rows < 1 or num_rows % group_size:
        raise DockError(
            f"open_iteration({iteration}): num_rows={num_rows} must be a positive multiple of group_size={group_size}"
        )


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


@dataclass
class _Lease:
    id: str
    owner: str
    consumer: int
    term_s: float
    expiry: float  # time.monotonic()
    rows: set[int]  # local row indexes
    whole_groups: bool


class _Iteration:
    def __init__(self, schema: Schema, iteration: int, num_rows: int, group_size: int, first_row: int, total_rows: int) -> None:
        self.iteration, self.num_rows, self.group_size, self.first_row = iteration, num_rows, group_size, first_row
        self.total_rows = total_rows  # rows of the iteration over all shards
        self.col_index = {c.name: i for i, c in enumerate(schema.columns)}
        self.consumer_index = {c: i for i, c in enumerate(schema.consumers)}
        self.ready = np.zeros((num_rows, len(schema.columns)), dtype=bool)
        self.consumed = np.zeros((num_rows, len(schema.consumers)), dtype=bool)
        self.acked = np.zeros((num_rows, len(schema.consumers)), dtype=bool)  # implies consumed
        self.lease_at = np.full((num_rows, len(schema.consumers)), None, dtype=object)  # _Lease of a consumed, un-acked row
        self.leases: dict[str, _Lease] = {}
        # lease id a row was acked under: a repeated ack is accepted
        self.acked_by = np.full((num_rows, len(schema.consumers)), None, dtype=object)
        self.ended: dict[str, tuple[int, set[int]]] = {}  # lease id → (consumer, local rows) when it ended un-acked
        # output columns of each consumer: a row whose outputs are all written is finished
        self.outputs = [[self.col_index[c.name] for c in schema.columns if c.producer == name] for name in schema.consumers]
        # warehouse: per column, Arrow chunks (or keys of committed warehouse objects) and, per row, (chunk, offset)
        self.chunks: dict[str, list[pa.Array | str]] = {c.name: [] for c in schema.columns}
        self.where = {c.name: np.full((num_rows, 2), -1, dtype=np.int64) for c in schema.columns}

    def finished(self, ci: int, rows: np.ndarray) -> np.ndarray:
        """Whether consumer ``ci`` has written every output column of each of ``rows`` (local)."""
        if not self.outputs[ci]:
            return np.zeros(len(rows), dtype=bool)
        return np.asarray(self.ready[np.ix_(rows, np.asarray(self.outputs[ci], dtype=np.int64))].all(axis=1))


class ShardController:
    """The rows of one shard of the experience table, one iteration at a time.

    Args:
        schema: the column schema; every put is checked against it.
        timeout_s: default timeout of a blocking ``take``, seconds.
        lease_s: default lease term of a take, seconds (``math.inf``: leases never expire).

    Thread-safe: callers may block in ``take`` from many threads.

    Raises:
        ValueError: ``lease_s`` is not > 0.
    """

    def __init__(self, schema: Schema, *, timeout_s: float = 600.0, lease_s: float = 300.0) -> None:
        if not lease_s > 0:
            raise ValueError(f"ShardController: lease_s={lease_s!r}; expected a number of seconds > 0")
        self.schema = schema
        self.timeout_s = timeout_s
        self.lease_s = lease_s
        self.leases_expired = 0
        self.rows_returned = 0
        self._cond = threading.Condition()
        self._it: _Iteration | None = None
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
        check_sizes(iteration, num_rows, group_size)
        total = first_row + num_rows if total_rows is None else total_rows
        if first_row < 0 or first_row % group_size or total < first_row + num_rows:
            raise DockError(
                f"open_iteration({iteration}): first_row={first_row} must be a non-negative multiple of "
                f"group_size={group_size}, and with num_rows={num_rows} within total_rows={total}"
            )
        with self._cond:
            if self._it is not None:
                raise DockError(f"open_iteration({iteration}): iteration {self._it.iteration} is still open")
            self._it = _Iteration(self.schema, iteration, num_rows, group_size, first_row, total)
            self._cond.notify_all()

    def close_iteration(self) -> None:
        """Drop the current iteration's table; later puts and claims raise ``DockError``."""
        with self._cond:
            self._it = None
            self._cond.notify_all()

    def _current(self, what: str, iteration: int | None = None) -> _Iteration:
        if self._it is None:
            raise DockError(f"{what}: no iteration is open (call open_iteration first, or it was closed)")
        if iteration is not None and iteration != self._it.iteration:
            raise DockError(f"{what}: iteration {iteration} is not open; the open iteration is {self._it.iteration}")
        return self._it

    # --- writes ----------------------------------------------------------------------------
    def put(
        self, rows: Sequence[int], columns: Mapping[str, Sequence | pa.Array] | pa.RecordBatch, *, iteration: int | None = None,
    ) -> None:
        """Write cells: ``columns[name][k]`` is the cell of row ``rows[k]``.

        Atomic: either every cell is written or none. With ``iteration`` the put is refused
        unless that iteration is the open one.

        Raises:
            DockError: unknown column, wrong Arrow type or length, row out of range or repeated,
                a cell already written, no open iteration, or another iteration open.
        """
        rows_arr = np.asarray(rows, dtype=np.int64)
        arrays = arrow_columns(self.schema, columns, len(rows_arr))
        with self._cond:
            it = self._current("put", iteration)
            rows_arr = self._check_rows(it, rows_arr, "put")
            self._refuse_written(it, rows_arr, arrays)
            for name, array in arrays.items():
                chunk_id = len(it.chunks[name])
                it.chunks[name].append(array)
                it.where[name][rows_arr, 0] = chunk_id
                it.where[name][rows_arr, 1] = np.arange(len(rows_arr))
                it.ready[rows_arr, it.col_index[name]] = True
                self.bytes_put += array.nbytes
            self._cond.notify_all()

    @staticmethod
    def _refuse_written(it: _Iteration, rows: np.ndarray, names: Sequence[str] | Mapping[str, object]) -> None:
        for name in names:
            written = it.ready[rows, it.col_index[name]]
            if written.any():
                raise DockError(f"put: column {name!r} is already written for rows {(rows[written] + it.first_row)[:10].tolist()}")

    def commit(
        self, rows: Sequence[int], objects: Mapping[str, tuple[str, Sequence[int]]], *, iteration: int | None = None
    ) -> None:
        """Record cells written to a warehouse: the controller half of a put (metadata only).

        ``objects[name] = (key, offsets)``: the cell of column ``name`` for row ``rows[k]`` is
        row ``offsets[k]`` of the object ``key`` (``dockrl.dock.warehouse``). Atomic as ``put``,
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
            self._check_request(it, list(refs), None, "put")
            rows_arr = self._check_rows(it, rows_arr, "put")
            self._refuse_written(it, rows_arr, refs)
            for name, (key, offsets_arr) in refs.items():
                it.where[name][rows_arr, 0] = len(it.chunks[name])
                it.where[name][rows_arr, 1] = offsets_arr
                it.chunks[name].append(key)
                it.ready[rows_arr, it.col_index[name]] = True
            self._cond.notify_all()

    def locate(self, columns: Sequence[str], rows: Sequence[int], *, iteration: int | None = None) -> dict[str, Located]:
        """Where the cells of ``rows`` live in the warehouse, per column, in the order of ``rows``.

        Raises:
            DockError: as ``get``; also a cell that was ``put`` (held in memory), not committed.
        """
        rows_arr = np.asarray(rows, dtype=np.int64)
        with self._cond:
            it = self._current("get", iteration)
            self._check_request(it, columns, None, "get")
            rows_arr = self._check_rows(it, rows_arr, "get")
            out = {}
            for name in columns:
                missing = ~it.ready[rows_arr, it.col_index[name]]
                if missing.any():
                    raise DockError(
                        f"get: column {name!r} not yet written for rows {(rows_arr[missing] + it.first_row)[:10].tolist()}"
                    )
                loc = it.where[name][rows_arr]
                chunk_ids, index = np.unique(loc[:, 0], return_inverse=True)
                keys = [it.chunks[name][c] for c in chunk_ids]
                if not all(isinstance(k, str) for k in keys):
                    raise DockError(f"get: column {name!r} is held in the dock's memory, not in a warehouse; read it with get")
                out[name] = Located(tuple(str(k) for k in keys), index.astype(np.int64).reshape(-1), loc[:, 1].copy())
            return out

    @staticmethod
    def _check_rows(it: _Iteration, rows: np.ndarray, what: str) -> np.ndarray:
        """Check row numbers against the iteration's range; return them as local indexes."""
        stop = it.first_row + it.num_rows
        bad = rows[(rows < 0) | (rows >= it.total_rows)]
        if len(bad):
            raise DockError(f"{what}: rows {bad[:10].tolist()} out of range [0, {it.total_rows}) in iteration {it.iteration}")
        bad = rows[(rows < it.first_row) | (rows >= stop)]
        if len(bad):
            raise DockError(
                f"{what}: rows {bad[:10].tolist()} belong to another dock shard; this one holds [{it.first_row}, {stop}) "
                f"of iteration {it.iteration}"
            )
        if len(np.unique(rows)) != len(rows):
            raise DockError(f"{what}: repeated row indexes in {rows[:20].tolist()}")
        return rows - it.first_row

    # --- reads -----------------------------------------------------------------------------
    def _cells(self, it: _Iteration, name: str, rows: np.ndarray) -> pa.Array:
        """The written cells of column ``name`` at local ``rows``, in that order."""
        chunks = it.chunks[name]
        if any(isinstance(c, str) for c in chunks):
            raise DockError(f"get: column {name!r} lives in a warehouse (committed objects); read it with locate")
        return _slice_cells(chunks, it.where[name][rows], self.schema.column(name).type)

    def _gather(self, it: _Iteration, columns: Sequence[str], rows: np.ndarray) -> pa.RecordBatch:
        arrays = [self._cells(it, name, rows) for name in columns]
        batch = pa.RecordBatch.from_arrays(arrays, schema=self.schema.arrow_schema(list(columns)))
        self.bytes_read += batch.nbytes
        return batch

    def _check_request(self, it: _Iteration, columns: Sequence[str], consumer: str | None, what: str) -> None:
        for name in columns:
            if name not in it.col_index:
                raise DockError(f"{what}: unknown column {name!r}; schema v{self.schema.version} has {list(it.col_index)}")
        if consumer is not None and consumer not in it.consumer_index:
            raise DockError(f"{what}: unknown consumer {consumer!r}; schema has {list(it.consumer_index)}")

    def get(self, columns: Sequence[str], rows: Sequence[int], *, iteration: int | None = None) -> pa.RecordBatch:
        """Read cells without consuming them (driver, metrics, checkpoints).

        Raises:
            DockError: unknown column, row out of range, a cell not yet written, or (with
                ``iteration``) another iteration open.
        """
        rows_arr = np.asarray(rows, dtype=np.int64)
        with self._cond:
            it = self._current("get", iteration)
            self._check_request(it, columns, None, "get")
            rows_arr = self._check_rows(it, rows_arr, "get")
            for name in columns:
                missing = ~it.ready[rows_arr, it.col_index[name]]
                if missing.any():
                    raise DockError(
                        f"get: column {name!r} not yet written for rows {(rows_arr[missing] + it.first_row)[:10].tolist()}"
                    )
            return self._gather(it, columns, rows_arr)

    def take(
        self,
        consumer: str,
        columns: Sequence[str],
        count: int,
        *,
        whole_groups: bool = False,
        at_least: int | None = None,
        timeout_s: float | None = None,
        iteration: int | None = None,
        owner: str | None = None,
        lease: str | None = None,
        lease_s: float | None = None,
        wait_held: bool = True,
        read: bool = False,
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
        lease = lease or uuid.uuid4().hex
        with self._cond:
            it, rows, pending, held = self._take_locked(
                consumer, columns, count, whole_groups, count if at_least is None else at_least, timeout_s, iteration,
                owner or DEFAULT_OWNER, lease, lease_s, wait_held,
            )
            batch = self._gather(it, columns, rows) if read else None
            return Taken((rows + it.first_row).tolist(), pending, held, lease, batch)

    def _take_locked(  # caller holds self._cond; returns local row indexes
        self, consumer: str, columns: Sequence[str], count: int, whole_groups: bool, at_least: int,
        timeout_s: float | None, iteration: int | None, owner: str, lease_id: str, lease_s: float | None,
        wait_held: bool,
    ) -> tuple[_Iteration, np.ndarray, int, int]:
        timeout = self.timeout_s if timeout_s is None else timeout_s
        term = self.lease_s if lease_s is None else lease_s
        start = time.monotonic()
        deadline = start + timeout
        what = f"claim by {consumer!r}"
        if not term > 0:
            raise DockError(f"{what}: lease_s={term!r} must be > 0 seconds")
        while True:
            it = self._current(what, iteration)
            self._check_request(it, columns, consumer, what)
            if count < 1 or (whole_groups and count % it.group_size):
                raise DockError(
                    f"{what}: count={count} must be positive"
                    + (f" and a multiple of group_size={it.group_size}" if whole_groups else "")
                )
            if at_least < 0:
                raise DockError(f"{what}: at_least={at_least} must be >= 0")
            ci = it.consumer_index[consumer]
            known = it.leases.get(lease_id)
            if known is not None and (known.owner != owner or known.consumer != ci):
                raise DockError(
                    f"{what}: lease {lease_id!r} belongs to owner {known.owner!r} and consumer "
                    f"{self.schema.consumers[known.consumer]!r}, not owner {owner!r}"
                )
            next_expiry = self._expire_locked(it)
            pending = ~it.consumed[:, ci]
            num_pending = int(pending.sum())
            held = self._held_locked(it, ci, owner)
            want = min(at_least, num_pending)
            ok = pending & it.ready[:, [it.col_index[c] for c in columns]].all(axis=1)
            if whole_groups:
                ok = np.repeat(ok.reshape(-1, it.group_size).all(axis=1), it.group_size)
            candidates = np.flatnonzero(ok)
            wait_for_held = num_pending == 0 and held > 0 and at_least > 0 and wait_held
            if not wait_for_held and (num_pending == 0 or (len(candidates) >= want and (want > 0 or at_least == 0))):
                rows = candidates[:count]
                if len(rows):  # waiters for this consumer re-check how many rows they can still get
                    it.consumed[rows, ci] = True
                    self._grant_locked(it, ci, rows, owner, lease_id, term, whole_groups)
                    self._cond.notify_all()
                self.wait_s += time.monotonic() - start
                return it, rows, num_pending - len(rows), held
            now = time.monotonic()
            remaining = deadline - now
            if remaining <= 0:
                held_note = (
                    f"; {held} rows are leased by other owners and not yet acked (they come back if their leases "
                    "expire or are released)" if held else ""
                )
                raise DockTimeoutError(
                    f"{what} timed out after {timeout:.1f}s in iteration {it.iteration}: "
                    f"wanted {want} rows ready in {list(columns)}, {len(candidates)} ready; "
                    f"columns still missing (rows lacking): {self._missing_locked(it, ci, columns)}{held_note}"
                )
            wait = max(min(remaining, next_expiry - now), 0.0)  # wake at the next lease expiry: rows may come back
            self._cond.wait(wait if math.isfinite(wait) else None)

    def _missing_locked(self, it: _Iteration, ci: int, columns: Sequence[str]) -> dict[str, int]:
        pending = ~it.consumed[:, ci]
        lacking = {c: int((pending & ~it.ready[:, it.col_index[c]]).sum()) for c in columns}
        return {c: n for c, n in lacking.items() if n}

    def missing(self, consumer: str, columns: Sequence[str], *, iteration: int | None = None) -> dict[str, int]:
        """For each of ``columns``, how many rows not yet taken by ``consumer`` lack it (zeros left out).

        Raises:
            DockError: unknown column or consumer, no open iteration, or another iteration open.
        """
        with self._cond:
            it = self._current(f"missing for {consumer!r}", iteration)
            self._check_request(it, columns, consumer, f"missing for {consumer!r}")
            return self._missing_locked(it, it.consumer_index[consumer], columns)

    def release(self, consumer: str, rows: Sequence[int], *, iteration: int | None = None) -> None:
        """Hand rows taken by ``consumer`` back, as if never taken (undo of a claim that failed midway).

        Raises:
            DockError: unknown consumer, row out of range or repeated, a row not taken by
                ``consumer`` or already acked, no open iteration, or another iteration open.
        """
        what = f"release by {consumer!r}"
        with self._cond:
            it = self._current(what, iteration)
            self._check_request(it, [], consumer, what)
            local = self._check_rows(it, np.asarray(rows, dtype=np.int64), what)
            ci = it.consumer_index[consumer]
            not_taken = ~it.consumed[local, ci]
            if not_taken.any():
                raise DockError(f"{what}: rows {(local[not_taken] + it.first_row)[:10].tolist()} were not taken by it")
            acked = it.acked[local, ci]
            if acked.any():
                raise DockError(f"{what}: rows {(local[acked] + it.first_row)[:10].tolist()} are already acked")
            self._unlease_locked(it, ci, local)
            it.consumed[local, ci] = False
            self._cond.notify_all()

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
            local = self._check_rows(it, np.asarray(rows, dtype=np.int64), "drop")
            untaken = ~it.consumed[local]  # (rows, consumers)
            it.consumed[local] |= untaken
            it.acked[local] |= untaken
            self._cond.notify_all()

    # --- leases ------------------------------------------------------------------------------
    def _grant_locked(
        self, it: _Iteration, ci: int, rows: np.ndarray, owner: str, lease_id: str, term: float, whole_groups: bool
    ) -> None:
        lease = it.leases.get(lease_id)
        if lease is None:
            lease = it.leases[lease_id] = _Lease(lease_id, owner, ci, term, 0.0, set(), whole_groups)
        lease.whole_groups |= whole_groups
        lease.rows.update(rows.tolist())
        lease.expiry = time.monotonic() + term
        it.lease_at[rows, ci] = lease

    def _unlease_locked(self, it: _Iteration, ci: int, local: np.ndarray) -> None:
        """Detach rows from their leases (an ack or a release); drop leases left empty."""
        for r in local.tolist():
            lease = it.lease_at[r, ci]
            if lease is not None:
                lease.rows.discard(r)
                if not lease.rows:
                    it.leases.pop(lease.id, None)
        it.lease_at[local, ci] = None

    def _end_leases_locked(self, it: _Iteration, leases: list[_Lease], why: str) -> int:
        """End un-acked leases: finished rows count as acked, the others go back to the ready pool.

        Returns the number of rows returned to the pool.
        """
        returned = 0
        for lease in leases:
            del it.leases[lease.id]
            rows, done = self._lease_done(it, lease)
            # an id can end more than once (a sharded claim takes rows under its id again after an
            # expiry): a late ack must still find the rows of every end
            ended_ci, ended = it.ended.get(lease.id, (lease.consumer, set()))
            it.ended[lease.id] = (lease.consumer, (ended if ended_ci == lease.consumer else set()) | set(rows.tolist()))
            it.lease_at[rows, lease.consumer] = None
            it.acked[rows[done], lease.consumer] = True
            it.acked_by[rows[done], lease.consumer] = lease.id
            it.consumed[rows[~done], lease.consumer] = False
            returned += int((~done).sum())
            logger.warning(
                "lease %s of owner %r (consumer %r, iteration %d) %s: %d rows back to the ready pool, %d finished",
                lease.id, lease.owner, self.schema.consumers[lease.consumer], it.iteration, why,
                int((~done).sum()), int(done.sum()),
            )
        self.rows_returned += returned
        if leases:
            self._cond.notify_all()
        return returned

    @staticmethod
    def _lease_done(it: _Iteration, lease: _Lease) -> tuple[np.ndarray, np.ndarray]:
        """The lease's rows (local, ascending) and which count as finished if it ended now.

        A whole-group lease finishes group by group (a group with any row unfinished goes
        back whole), so whole-group claims never meet a partial group.
        """
        rows = np.fromiter(sorted(lease.rows), dtype=np.int64, count=len(lease.rows))
        done = it.finished(lease.consumer, rows)
        if lease.whole_groups and len(rows):
            groups = rows // it.group_size
            unfinished = np.unique(groups[~done])
            done &= ~np.isin(groups, unfinished)
        return rows, done

    def _expire_locked(self, it: _Iteration) -> float:
        """End the leases past their expiry; return the next expiry (``time.monotonic``), inf if none."""
        now = time.monotonic()
        expired = [lease for lease in it.leases.values() if lease.expiry <= now]
        if expired:
            self.leases_expired += len(expired)
            self._end_leases_locked(it, expired, f"expired (not renewed within its {expired[0].term_s:g}s term)")
        return min((lease.expiry for lease in it.leases.values()), default=math.inf)

    def _held_locked(self, it: _Iteration, ci: int, owner: str) -> int:
        held = 0
        for lease in it.leases.values():
            if lease.consumer == ci and lease.owner != owner:
                held += int((~self._lease_done(it, lease)[1]).sum())
        return held

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
            self._check_request(it, [], consumer, what)
            local = self._check_rows(it, np.asarray(rows, dtype=np.int64), what)
            ci = it.consumer_index[consumer]
            self._expire_locked(it)
            held = np.array([getattr(it.lease_at[r, ci], "id", None) == lease for r in local.tolist()], dtype=bool)
            done = it.acked_by[local, ci] == lease  # acked before, or finished when the lease ended
            ended_ci, ended = it.ended.get(lease, (ci, set()))
            ended = ended if ended_ci == ci else set()
            was_leased = np.array([r in ended for r in local.tolist()], dtype=bool)
            late = was_leased & ~it.consumed[local, ci]  # back in the pool and not re-claimed: a late ack still counts
            bad = ~(held | done | late)
            self._unlease_locked(it, ci, local[held])
            ok = local[~bad]
            it.consumed[ok, ci] = True
            it.acked[ok, ci] = True
            it.acked_by[ok, ci] = lease
            self._cond.notify_all()
            errors = []
            if (bad & was_leased).any():
                errors.append(
                    f"lease {lease!r} ended before this ack (it expired or its owner was released) and rows "
                    f"{(local[bad & was_leased] + it.first_row)[:10].tolist()} were re-delivered to another claim of "
                    f"{consumer!r}; keep workers renewing their leases (DockClient does, while its process lives) "
                    "or raise lease_s"
                )
            if (bad & ~was_leased).any():
                errors.append(
                    f"rows {(local[bad & ~was_leased] + it.first_row)[:10].tolist()} are not leased to {consumer!r} under "
                    f"lease {lease!r} in iteration {it.iteration} (never granted here, or granted before a restore, which "
                    "returned its rows to the pool to be re-delivered)"
                )
            if errors:
                raise DockError(f"{what}: " + "; ".join(errors))

    def renew(self, owner: str) -> int:
        """Push the expiry of every lease of ``owner`` a full term ahead (a heartbeat).

        Returns the number of leases renewed (0 when no iteration is open).
        """
        with self._cond:
            if self._it is None:
                return 0
            self._expire_locked(self._it)
            now, renewed = time.monotonic(), 0
            for lease in self._it.leases.values():
                if lease.owner == owner:
                    lease.expiry, renewed = now + lease.term_s, renewed + 1
            return renewed

    def release_owner(self, owner: str) -> int:
        """End every lease of ``owner`` now, as if expired (the owner's process died).

        Returns the number of rows returned to the ready pool (finished rows count as acked).
        """
        with self._cond:
            if self._it is None:
                return 0
            leases = [lease for lease in self._it.leases.values() if lease.owner == owner]
            return self._end_leases_locked(self._it, leases, f"released (owner {owner!r} is gone)")

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
            meta: dict[str, Any] = {
                "kind": "transfer_dock", "schema_version": self.schema.version,
                "columns": [[c.name, str(c.type)] for c in self.schema.columns],
                "consumers": list(self.schema.consumers), "extra": extra, "iteration": None,
            }
            tables: dict[str, pa.Table] = {}
            it = self._it
            if it is not None:
                self._expire_locked(it)
                meta |= {"iteration": it.iteration, "num_rows": it.num_rows, "group_size": it.group_size,
                         "first_row": it.first_row, "total_rows": it.total_rows, "leases": len(it.leases)}
                acked = it.acked.copy()  # un-acked leases end at restore: store what they finished as acked
                for lease in it.leases.values():
                    rows, done = self._lease_done(it, lease)
                    acked[rows[done], lease.consumer] = True
                state = {f"ready:{c.name}": it.ready[:, i] for i, c in enumerate(self.schema.columns)}
                state |= {f"consumed:{c}": it.consumed[:, i] for i, c in enumerate(self.schema.consumers)}
                state |= {f"acked:{c}": acked[:, i] for i, c in enumerate(self.schema.consumers)}
                tables["state"] = pa.table({k: pa.array(v) for k, v in state.items()})
                meta["objects"] = []
                for i, c in enumerate(self.schema.columns):
                    rows = np.flatnonzero(it.ready[:, i])
                    if not len(rows):  # a column with no cell written has no file
                        continue
                    chunks = it.chunks[c.name]
                    if any(isinstance(ch, str) for ch in chunks):
                        # payload in a warehouse: store where the cells are; the objects stay in the store
                        loc = it.where[c.name][rows]
                        tables[f"objects.{c.name}"] = pa.table({
                            "row": pa.array(rows + it.first_row), "key": pa.array([chunks[k] for k in loc[:, 0]]),
                            "offset": pa.array(loc[:, 1]),
                        })
                        meta["objects"].append(c.name)
                    else:
                        values = self._cells(it, c.name, rows)
                        tables[f"payload.{c.name}"] = pa.table({"row": pa.array(rows + it.first_row), c.name: values})
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
        columns = [[c.name, str(c.type)] for c in self.schema.columns]
        if meta.get("kind") != "transfer_dock":
            raise DockError(f"{what}: the snapshot there is a {meta.get('kind')!r}, not a transfer_dock snapshot")
        ours = (self.schema.version, columns, list(self.schema.consumers))
        if (meta["schema_version"], meta["columns"], meta["consumers"]) != ours:
            raise DockError(
                f"{what}: snapshot has schema v{meta['schema_version']} columns {meta['columns']} consumers {meta['consumers']}; "
                f"this dock has v{self.schema.version} columns {columns} consumers {list(self.schema.consumers)}"
            )
        if extra is not None and meta["extra"] != extra:
            raise DockError(f"{what}: snapshot was taken with {meta['extra']}; expected {extra}")
        it = None if meta["iteration"] is None else self._load_iteration(uri, meta, what)
        with self._cond:
            if self._it is not None:
                raise DockError(f"{what}: iteration {self._it.iteration} is open here; close it first")
            self._it = it
            if it is not None:
                self.rows_returned += int((it.consumed & ~it.acked).sum())
                it.consumed &= it.acked
            self._cond.notify_all()
        return meta["extra"]

    def _load_iteration(self, uri: str, meta: dict[str, Any], what: str) -> _Iteration:
        it = _Iteration(self.schema, meta["iteration"], meta["num_rows"], meta["group_size"], meta["first_row"],
                        meta.get("total_rows", meta["first_row"] + meta["num_rows"]))
        state = read_table(uri, meta, "state")
        if state.num_rows != it.num_rows:
            raise DockError(f"{what}: state table has {state.num_rows} rows; the iteration has {it.num_rows}")
        for i, c in enumerate(self.schema.columns):
            it.ready[:, i] = state.column(f"ready:{c.name}").to_numpy(zero_copy_only=False)
            if not it.ready[:, i].any():
                continue
            in_store = c.name in meta.get("objects", [])
            payload = read_table(uri, meta, f"{'objects' if in_store else 'payload'}.{c.name}")
            rows = payload.column("row").to_numpy() - it.first_row
            if not np.array_equal(rows, np.flatnonzero(it.ready[:, i])):
                raise DockError(f"{what}: payload of column {c.name!r} does not hold exactly the rows marked written")
            if not len(rows):
                continue
            if in_store:  # keys of warehouse objects, one chunk per key
                keys = payload.column("key").to_pylist()
                it.chunks[c.name] = list(dict.fromkeys(keys))
                chunk_of = {key: k for k, key in enumerate(it.chunks[c.name])}
                it.where[c.name][rows, 0] = [chunk_of[key] for key in keys]
                it.where[c.name][rows, 1] = payload.column("offset").to_numpy()
            else:
                it.chunks[c.name].append(payload.column(c.name).combine_chunks())
                it.where[c.name][rows, 0] = 0
                it.where[c.name][rows, 1] = np.arange(len(rows))
        for i, consumer in enumerate(self.schema.consumers):
            it.acked[:, i] = state.column(f"acked:{consumer}").to_numpy(zero_copy_only=False)
            it.consumed[:, i] = state.column(f"consumed:{consumer}").to_numpy(zero_copy_only=False)  # narrowed to acked on install
        if (it.acked & ~it.consumed).any():
            raise DockError(f"{what}: state table marks rows acked that are not consumed")
        return it

    def stats(self) -> dict[str, float]:
        """Counters for metrics: ``dock/bytes_put``, ``dock/bytes_read``, ``dock/wait_s``,
        ``dock/leases_expired`` and ``dock/rows_returned`` (rows back to the pool after a lease
        ended un-acked)."""
        with self._cond:
            return {"dock/bytes_put": self.bytes_put, "dock/bytes_read": self.bytes_read, "dock/wait_s": self.wait_s,
                    "dock/leases_expired": self.leases_expired, "dock/rows_returned": self.rows_returned}
