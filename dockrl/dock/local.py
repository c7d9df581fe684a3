"""The dock controller of one shard: readiness and consumption bits, leases, and the cells (Arrow chunks).

A ``ShardController`` is the state of one dock shard; ``dockrl.dock.shard.ShardService`` wraps
one and is its only caller (stages reach it through the sharded front end
``dockrl.dock.client.DockClient``, in either ``dock.mode``): ``open_iteration`` → ``put`` /
``take`` / ``get`` → ``close_iteration``, over its slice of rows (``open_iteration(...,
first_row=k, total_rows=N)``, so errors name global rows). ``take``, ``release``, ``missing``
and ``ack_rows`` are the metadata-only building blocks of a claim across shards; ``commit``
and ``locate`` those of a put and a read whose payload lives in a warehouse
(``dockrl.dock.warehouse``): the controller then holds object keys and offsets, never cells.
Waiting is event-driven, never a sleep-poll loop: a blocked take waits on a condition of its own,
woken only when it can proceed (``_wake_locked``).

**Cost.** A take costs what it takes: per consumer and set of input columns the controller keeps
the ready, untaken rows (``_View``, updated by every put, take, return and ack), leases are
integer arrays (``lease_at``: the lease number of each row), expiries a heap, and the rows other
owners hold are counted as leases change (``_Lease.undone``), never recounted per take.

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

import heapq
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


def one_run(rows: np.ndarray) -> tuple[int, int] | None:
    """``(start, stop)`` when the ascending, distinct ``rows`` are the consecutive rows ``[start, stop)``; else None.

    None too for no rows. The caller vouches that ``rows`` ascend and are distinct: only the
    ends and the length are read (O(1)).
    """
    n = len(rows)
    if n and int(rows[-1]) - int(rows[0]) + 1 == n:
        return int(rows[0]), int(rows[-1]) + 1
    return None

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
            values = values.chunk(0) if values.num_chunks == 1 else values.combine_chunks()
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
    if not len(breaks):  # one run (a contiguous claim): a zero-copy slice
        return chunks[chunk[0]].slice(offset[0], len(loc))
    starts, stops = np.concatenate([[0], breaks]), np.concatenate([breaks, [len(loc)]])
    return pa.concat_arrays([chunks[chunk[a]].slice(offset[a], b - a) for a, b in zip(starts, stops)])


def _distinct(a: np.ndarray) -> np.ndarray:
    """The distinct values of ``a`` ascending (cheap when ``a`` is ascending already, as rows mostly are)."""
    if len(a) < 2:
        return a
    if (a[1:] >= a[:-1]).all():
        return a[np.concatenate(([True], a[1:] != a[:-1]))]
    return np.unique(a)


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


@dataclass(eq=False)
class _Lease:
    id: str
    num: int  # the lease id's number in this iteration (``lease_at`` and ``acked_by`` hold it)
    owner: str
    consumer: int
    term_s: float
    expiry: float  # time.monotonic()
    rows: np.ndarray  # local row indexes, ascending
    whole_groups: bool
    undone: int = 0  # rows that would go back to the pool if it ended now (``_lease_done``): counted as held


class _View:
    """The rows of consumer ``ci`` ready in ``cols`` and not taken yet, in units of ``unit`` rows (1, or whole groups).

    Kept up to date by every write, take and return (``_Iteration.set_ready``/``set_consumed``),
    so a take costs what it takes, not the size of the iteration: ``avail`` marks the available
    units, ``navail`` counts them, and no unit below ``lo`` is available, so a take hands out
    the first ready rows by scanning forward from ``lo`` (vectorized, in growing windows).
    """

    def __init__(self, it: _Iteration, ci: int, cols: tuple[int, ...], unit: int) -> None:
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


class _Iteration:
    def __init__(self, schema: Schema, iteration: int, num_rows: int, group_size: int, first_row: int, total_rows: int) -> None:
        self.iteration, self.num_rows, self.group_size, self.first_row = iteration, num_rows, group_size, first_row
        self.total_rows = total_rows  # rows of the iteration over all shards
        self.col_index = {c.name: i for i, c in enumerate(schema.columns)}
        self.rewritable = {c.name for c in schema.columns if c.rewritable}  # a later put may overwrite their cells
        self.consumer_index = {c: i for i, c in enumerate(schema.consumers)}
        n_cons = len(schema.consumers)
        self.ready = np.zeros((num_rows, len(schema.columns)), dtype=bool)
        self.consumed = np.zeros((num_rows, n_cons), dtype=bool)
        self.acked = np.zeros((num_rows, n_cons), dtype=bool)  # implies consumed
        self.lease_at = np.full((num_rows, n_cons), -1, dtype=np.int32)  # lease number of a consumed, un-acked row
        # lease number a row was acked under: a repeated ack is accepted
        self.acked_by = np.full((num_rows, n_cons), -1, dtype=np.int32)
        self.lease_num: dict[str, int] = {}  # lease id → its number (kept after the lease ends)
        self.leases: dict[str, _Lease] = {}  # live leases by id
        self.live: dict[int, _Lease] = {}  # live leases by number
        self.by_owner: dict[str, set[str]] = {}  # owner → ids of its live leases
        self.expiries: list[tuple[float, int]] = []  # heap of (expiry, lease number); stale entries skipped
        self.undone = [0] * n_cons  # rows of live leases that would go back if they ended now, by consumer
        self.undone_by: list[dict[str, int]] = [{} for _ in range(n_cons)]  # the same by consumer and owner
        self.ended: dict[str, tuple[int, np.ndarray]] = {}  # lease id → (consumer, local rows) when it ended un-acked
        # output columns of each consumer: a row whose outputs are all written is finished
        self.outputs = [[self.col_index[c.name] for c in schema.columns if c.producer == name] for name in schema.consumers]
        self.output_of = [[ci for ci, outs in enumerate(self.outputs) if col in outs] for col in range(len(schema.columns))]
        self.fin = np.zeros((num_rows, n_cons), dtype=bool)  # every output of the consumer written (none: never)
        # warehouse: per column, Arrow chunks (or keys of committed warehouse objects) and, per row, (chunk, offset)
        self.chunks: dict[str, list[pa.Array | str]] = {c.name: [] for c in schema.columns}
        # per chunk: the local rows [start, stop) it holds in order (a put of one ascending run), else None;
        # and its bytes (a zero-copy read of part of it counts them pro rata)
        self.spans: dict[str, list[tuple[int, int] | None]] = {c.name: [] for c in schema.columns}
        self.chunk_bytes: dict[str, list[int]] = {c.name: [] for c in schema.columns}
        self.where = {c.name: np.full((num_rows, 2), -1, dtype=np.int64) for c in schema.columns}
        self.stored: set[str] = set()  # columns with a chunk that is a warehouse key (``commit``, ``restore``)
        self.col_types = {c.name: c.type for c in schema.columns}
        # a take's request, (consumer, columns, whole groups) → (consumer index, its view's columns): checked once
        self.requests: dict[tuple[str, tuple[str, ...], bool], tuple[int, tuple[int, ...]]] = {}
        self.views: dict[tuple[int, tuple[int, ...], int], _View] = {}
        self.views_of_ci: list[list[_View]] = [[] for _ in range(n_cons)]
        self.views_of_col: list[list[_View]] = [[] for _ in range(len(schema.columns))]
        self.derive()

    def derive(self) -> None:
        """Recompute the per-consumer counts from ``consumed`` (after it was loaded or changed wholesale)."""
        self.npending = (~self.consumed).sum(axis=0).tolist()  # rows not taken, by consumer
        for ci, outs in enumerate(self.outputs):
            self.fin[:, ci] = self.ready[:, outs].all(axis=1) if outs else False
        # rows of each group taken, by consumer: kept only for consumers with a whole-group view
        self.gcons = np.zeros((self.num_rows // self.group_size, self.consumed.shape[1]), dtype=np.int32)
        self.gcons_on = [False] * self.consumed.shape[1]
        self.views.clear()
        for views in (*self.views_of_ci, *self.views_of_col):
            views.clear()

    def view(self, ci: int, cols: tuple[int, ...], unit: int) -> _View:
        """The ready, untaken rows of consumer ``ci`` in columns ``cols`` (built on first use, then kept)."""
        key = (ci, cols, unit)
        view = self.views.get(key)
        if view is None:
            if unit > 1 and not self.gcons_on[ci]:
                self.gcons[:, ci] = self.consumed[:, ci].reshape(-1, self.group_size).sum(axis=1)
                self.gcons_on[ci] = True
            view = self.views[key] = _View(self, ci, cols, unit)
            self.views_of_ci[ci].append(view)
            for col in cols:
                self.views_of_col[col].append(view)
        return view

    def set_ready(self, col: int, rows: np.ndarray, run: tuple[int, int] | None = None) -> set[int]:
        """Mark column ``col`` written for ``rows`` (local, distinct, not written before; ``run``: they are
        the range ``[start, stop)``, ascending); return the consumers with new rows."""
        idx = rows if run is None else slice(*run)
        self.ready[idx, col] = True
        for ci in self.output_of[col]:
            outs = self.outputs[ci]
            self.fin[idx, ci] = self.ready[idx, outs[0]] if len(outs) == 1 else self.ready[idx][:, outs].all(axis=1)
        woken = set()
        for view in self.views_of_col[col]:
            view.nready[rows] += 1
            full = rows[view.nready[rows] == len(view.cols)]
            if not len(full):
                continue
            if view.unit == 1:
                new = full[~self.consumed[full, view.ci]]
            else:
                groups = full // view.unit
                np.add.at(view.unit_ready, groups, 1)
                groups = _distinct(groups)
                new = groups[(view.unit_ready[groups] == view.unit) & (self.gcons[groups, view.ci] == 0)]
            if len(new):
                view.add(new)
                woken.add(view.ci)
        return woken

    def set_consumed(self, ci: int, rows: np.ndarray, value: bool, run: tuple[int, int] | None = None) -> None:
        """Flip ``consumed`` of consumer ``ci`` to ``value`` for ``rows`` (local, distinct, each now ``not value``;
        ``run``: they are the range ``[start, stop)``, ascending)."""
        if not len(rows):
            return
        groups = rows // self.group_size if self.gcons_on[ci] else rows[:0]
        views = self.views_of_ci[ci]
        if value:
            if self.gcons_on[ci]:
                np.add.at(self.gcons[:, ci], groups, 1)
            idx = rows if run is None else slice(*run)
            self.consumed[idx, ci] = True
            self.npending[ci] -= len(rows)
            for view in views:
                view.remove(idx if view.unit == 1 else _distinct(groups))
        else:
            np.subtract.at(self.gcons[:, ci], groups, 1)
            self.consumed[rows, ci] = False
            self.npending[ci] += len(rows)
            for view in views:
                if view.unit == 1:
                    view.add(rows[view.nready[rows] == len(view.cols)])
                else:
                    ug = _distinct(groups)
                    view.add(ug[(view.unit_ready[ug] == view.unit) & (self.gcons[ug, ci] == 0)])

    def held(self, ci: int, owner: str) -> int:
        """Rows of consumer ``ci`` leased by owners other than ``owner``, not acked nor finished."""
        return self.undone[ci] - self.undone_by[ci].get(owner, 0)

    def finished(self, ci: int, rows: np.ndarray) -> np.ndarray:
        """Whether consumer ``ci`` has written every output column of each of ``rows`` (local)."""
        return self.fin[rows, ci]


@dataclass(eq=False)
class _Waiter:
    """A take blocked for consumer ``ci``: woken (``cond.notify``) only when it can proceed."""

    ci: int
    view: _View
    count: int
    at_least: int
    wait_held: bool
    owner: str
    cond: threading.Condition
    notified: bool = False


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
        self._lock = threading.RLock()
        self._cond = threading.Condition(self._lock)  # guards everything; blocked takes wait on conditions of their own
        self._waiters: dict[int, list[_Waiter]] = {}  # blocked takes by consumer, oldest first
        self._arrow_schemas: dict[tuple[str, ...], pa.Schema] = {}  # of the column lists read so far
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
            self._wake_all()

    def close_iteration(self) -> None:
        """Drop the current iteration's table; later puts and claims raise ``DockError``."""
        with self._cond:
            self._it = None
            self._wake_all()

    def _current(self, what: str, iteration: int | None = None) -> _Iteration:
        if self._it is None:
            raise DockError(f"{what}: no iteration is open (call open_iteration first, or it was closed)")
        if iteration is not None and iteration != self._it.iteration:
            raise DockError(f"{what}: iteration {iteration} is not open; the open iteration is {self._it.iteration}")
        return self._it

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
                self._check_request(it, [], ack[0], f"ack by {ack[0]!r}")
            rows_arr, ascending = self._local_rows(it, rows_arr, "put")
            # distinct rows: ascending and spanning as many rows as they are is one run, written through a slice
            n = len(rows_arr)
            run = one_run(rows_arr) if ascending else None
            index = rows_arr if run is None else slice(*run)
            self._refuse_written(it, rows_arr, arrays, index)
            for name, array in arrays.items():
                chunk_id = len(it.chunks[name])
                it.chunks[name].append(array)
                it.spans[name].append(run)
                nbytes = array.get_total_buffer_size() if own_buffers else array.nbytes
                it.chunk_bytes[name].append(nbytes)
                where = it.where[name]
                where[index, 0] = chunk_id
                where[index, 1] = np.arange(n)
                self.bytes_put += nbytes
            acking = None if ack is None else (it.consumer_index[ack[0]], it.lease_num.get(ack[1], -2))
            held_all = self._written_locked(it, rows_arr, arrays, acking, run)
            if ack is not None:
                self._ack_locked(it, ack[0], ack[1], rows_arr, held_all=held_all, run=run)

    @staticmethod
    def _refuse_written(
        it: _Iteration, rows: np.ndarray, names: Sequence[str] | Mapping[str, object], index: np.ndarray | slice | None = None,
    ) -> None:
        """Refuse cells of ``names`` already written for ``rows`` (local; ``index``: the same rows as an index, a slice)."""
        for name in names:
            if name in it.rewritable:
                continue
            written = it.ready[rows if index is None else index, it.col_index[name]]
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
                it.spans[name].append(None)
                it.chunk_bytes[name].append(0)
                it.stored.add(name)
            self._written_locked(it, rows_arr, refs)

    def _written_locked(
        self, it: _Iteration, rows: np.ndarray, names: Sequence[str] | Mapping[str, object], acking: tuple[int, int] | None = None,
        run: tuple[int, int] | None = None,
    ) -> bool:
        """Cells of ``names`` written for ``rows`` (local; ``run``: they are the range ``[start, stop)``, ascending):
        readiness, the leases whose rows finished, wake-ups.

        ``acking=(consumer, lease number)``: the caller acks ``rows`` under that lease next (no recount for
        it). Returns whether every row is held under that lease (False without ``acking``).
        """
        woken: set[int] = set()
        finishing: set[int] = set()
        held_all = False
        for name in names:
            col = it.col_index[name]
            if name in it.rewritable:  # once per cell
                woken |= it.set_ready(col, rows[~it.ready[rows, col]])
            else:
                woken |= it.set_ready(col, rows, run)
            finishing.update(it.output_of[col])
        for ci in finishing:  # rows a consumer's outputs finished no longer count as held by its lease
            nums = it.lease_at[rows if run is None else slice(*run), ci]
            if acking is not None and acking[0] == ci and (nums == acking[1]).all():
                held_all = True
                continue  # the ack that follows ends the lease's hold on them
            for num in np.unique(nums[nums >= 0]).tolist():
                self._recount_locked(it, it.live[num])
            woken.add(ci)
        for ci in woken:
            self._wake_locked(it, ci)
        return held_all

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

    @classmethod
    def _check_rows(cls, it: _Iteration, rows: np.ndarray, what: str) -> np.ndarray:
        """Check row numbers against the iteration's range; return them as local indexes."""
        return cls._local_rows(it, rows, what)[0]

    @staticmethod
    def _local_rows(it: _Iteration, rows: np.ndarray, what: str) -> tuple[np.ndarray, bool]:
        """``_check_rows``, and whether the rows are ascending."""
        stop = it.first_row + it.num_rows
        if len(rows) and rows[0] >= it.first_row and rows[-1] < stop and (len(rows) == 1 or (rows[1:] > rows[:-1]).all()):
            # ascending and in range (the usual request): nothing more to check
            return (rows - it.first_row if it.first_row else rows), True
        bad = rows[(rows < 0) | (rows >= it.total_rows)]
        if len(bad):
            raise DockError(f"{what}: rows {bad[:10].tolist()} out of range [0, {it.total_rows}) in iteration {it.iteration}")
        bad = rows[(rows < it.first_row) | (rows >= stop)]
        if len(bad):
            raise DockError(
                f"{what}: rows {bad[:10].tolist()} belong to another dock shard; this one holds [{it.first_row}, {stop}) "
                f"of iteration {it.iteration}"
            )
        if len(rows) > 1 and not (rows[1:] > rows[:-1]).all() and len(np.unique(rows)) != len(rows):
            raise DockError(f"{what}: repeated row indexes in {rows[:20].tolist()}")
        return rows - it.first_row, False

    # --- reads -----------------------------------------------------------------------------
    def _cells(self, it: _Iteration, name: str, rows: np.ndarray) -> pa.Array:
        """The written cells of column ``name`` at local ``rows``, in that order."""
        if name in it.stored:
            raise DockError(f"get: column {name!r} lives in a warehouse (committed objects); read it with locate")
        return _slice_cells(it.chunks[name], it.where[name][rows], it.col_types[name])

    def _gather(self, it: _Iteration, columns: Sequence[str], rows: np.ndarray, run: tuple[int, int] | None = None) -> pa.RecordBatch:
        """The cells of ``columns`` at local ``rows`` (``run``: they are the range ``[start, stop)``, ascending)."""
        arrays = []
        for name in columns:
            cells = None
            if run is not None and name not in it.rewritable and name not in it.stored:  # written once: where never changes
                start, stop = run
                c = int(it.where[name][start, 0])
                span = it.spans[name][c]
                if span is not None and span[0] <= start and stop <= span[1]:  # all in one chunk, in order: a zero-copy slice
                    chunk = it.chunks[name][c]
                    assert isinstance(chunk, pa.Array)
                    cells = chunk.slice(start - span[0], stop - start)
                    self.bytes_read += it.chunk_bytes[name][c] * (stop - start) // max(len(chunk), 1)  # pro rata
            if cells is None:
                cells = self._cells(it, name, rows)
                self.bytes_read += cells.nbytes
            arrays.append(cells)
        key = tuple(columns)
        schema = self._arrow_schemas.get(key)
        if schema is None:
            schema = self._arrow_schemas[key] = self.schema.arrow_schema(list(columns))
        return pa.RecordBatch.from_arrays(arrays, schema=schema)

    def _check_request(self, it: _Iteration, columns: Sequence[str], consumer: str | None, what: str) -> None:
        for name in columns:
            if name not in it.col_index:
                raise DockError(f"{what}: unknown column {name!r}; schema v{self.schema.version} has {list(it.col_index)}")
        if consumer is not None and consumer not in it.consumer_index:
            raise DockError(f"{what}: unknown consumer {consumer!r}; schema has {list(it.consumer_index)}")
        if consumer is not None and (rewritable := [name for name in columns if name in it.rewritable]):
            raise DockError(f"{what}: consumer {consumer!r} claims on rewritable columns {rewritable}: a rewrite after the "
                            "claim would not reach it; read them with get")

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
    ) -> tuple[_Iteration, np.ndarray, int, int, tuple[int, int] | None]:  # ..., one_run(rows)
        timeout = self.timeout_s if timeout_s is None else timeout_s
        term = self.lease_s if lease_s is None else lease_s
        start = time.monotonic()
        deadline = start + timeout
        what = f"claim by {consumer!r}"
        if not term > 0:
            raise DockError(f"{what}: lease_s={term!r} must be > 0 seconds")
        waiter: _Waiter | None = None
        try:
            while True:
                it = self._current(what, iteration)
                key = (consumer, tuple(columns), whole_groups)
                request = it.requests.get(key)
                if request is None:  # a request not seen in this iteration: check it once
                    self._check_request(it, columns, consumer, what)
                    request = it.requests[key] = (it.consumer_index[consumer], tuple(sorted({it.col_index[c] for c in columns})))
                ci, cols = request
                if count < 1 or (whole_groups and count % it.group_size):
                    raise DockError(
                        f"{what}: count={count} must be positive"
                        + (f" and a multiple of group_size={it.group_size}" if whole_groups else "")
                    )
                if at_least < 0:
                    raise DockError(f"{what}: at_least={at_least} must be >= 0")
                known = it.leases.get(lease_id)
                if known is not None and (known.owner != owner or known.consumer != ci):
                    raise DockError(
                        f"{what}: lease {lease_id!r} belongs to owner {known.owner!r} and consumer "
                        f"{self.schema.consumers[known.consumer]!r}, not owner {owner!r}"
                    )
                next_expiry = self._expire_locked(it)
                unit = it.group_size if whole_groups else 1
                view = it.view(ci, cols, unit)
                num_pending = it.npending[ci]
                held = it.held(ci, owner)
                if self._can_take(num_pending, held, view.navail * unit, at_least, wait_held):
                    units = view.first(min(count // unit, view.navail))
                    rows = units if unit == 1 else (units[:, None] * unit + np.arange(unit)).reshape(-1)
                    run = one_run(rows)  # ascending: one run when they span as many rows as they are
                    if len(rows):
                        it.set_consumed(ci, rows, True, run)
                        self._grant_locked(it, ci, rows, owner, lease_id, term, whole_groups, run)
                        self._wake_locked(it, ci)  # waiters of this consumer may need fewer rows now
                    self._forget_waiter(waiter)
                    waiter = None  # it took: no wake-up to hand on
                    self.wait_s += time.monotonic() - start
                    return it, rows, num_pending - len(rows), held, run
                now = time.monotonic()
                remaining = deadline - now
                if remaining <= 0:
                    held_note = (
                        f"; {held} rows are leased by other owners and not yet acked (they come back if their leases "
                        "expire or are released)" if held else ""
                    )
                    raise DockTimeoutError(
                        f"{what} timed out after {timeout:.1f}s in iteration {it.iteration}: "
                        f"wanted {min(at_least, num_pending)} rows ready in {list(columns)}, {view.navail * unit} ready; "
                        f"columns still missing (rows lacking): {self._missing_locked(it, ci, columns)}{held_note}"
                    )
                if waiter is None or waiter.ci != ci:
                    self._forget_waiter(waiter)
                    waiter = _Waiter(ci, view, count, at_least, wait_held, owner, threading.Condition(self._lock))
                    self._waiters.setdefault(ci, []).append(waiter)
                waiter.view, waiter.notified = view, False
                wait = max(min(remaining, next_expiry - now), 0.0)  # wake at the next lease expiry: rows may come back
                waiter.cond.wait(wait if math.isfinite(wait) else None)
        finally:
            if waiter is not None:
                self._forget_waiter(waiter)
                if waiter.notified and self._it is not None:  # woken for rows it did not take: hand the wake-up on
                    self._wake_locked(self._it, waiter.ci)

    @staticmethod
    def _can_take(num_pending: int, held: int, available: int, at_least: int, wait_held: bool) -> bool:
        """Whether a take proceeds now: enough rows available, or none left to wait for."""
        if num_pending == 0:  # done, unless rows other owners hold may come back
            return not (held > 0 and at_least > 0 and wait_held)
        want = min(at_least, num_pending)
        return available >= want and (want > 0 or at_least == 0)

    def _forget_waiter(self, waiter: _Waiter | None) -> None:
        if waiter is not None:
            waiters = self._waiters.get(waiter.ci, [])
            if waiter in waiters:
                waiters.remove(waiter)

    def _wake_locked(self, it: _Iteration, ci: int) -> None:
        """Wake the blocked takes of consumer ``ci`` that can proceed now, oldest first, no more than the rows allow."""
        waiters = self._waiters.get(ci)
        if not waiters:
            return
        budget: dict[int, int] = {}  # rows of each view not yet promised to a woken waiter
        for w in waiters:
            if w.notified:
                continue
            unit = w.view.unit
            available = budget.get(id(w.view), w.view.navail * unit)
            if self._can_take(it.npending[ci], it.held(ci, w.owner), available, w.at_least, w.wait_held):
                w.notified = True
                budget[id(w.view)] = available - min(available, w.count)
                w.cond.notify()

    def _wake_all(self) -> None:
        """Wake every blocked take (the open iteration changed): each re-checks."""
        for waiters in self._waiters.values():
            for w in waiters:
                w.notified = True
                w.cond.notify()

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
            self._check_request(it, [], consumer, what)
            local = self._check_rows(it, np.asarray(rows, dtype=np.int64), what)
            ci = it.consumer_index[consumer]
            if lease is not None:
                self._expire_locked(it)
                local = local[it.lease_at[local, ci] == it.lease_num.get(lease, -2)]  # -2: an id never seen matches no row
                if not len(local):
                    return
            not_taken = ~it.consumed[local, ci]
            if not_taken.any():
                raise DockError(f"{what}: rows {(local[not_taken] + it.first_row)[:10].tolist()} were not taken by it")
            acked = it.acked[local, ci]
            if acked.any():
                raise DockError(f"{what}: rows {(local[acked] + it.first_row)[:10].tolist()} are already acked")
            self._unlease_locked(it, ci, local)
            it.set_consumed(ci, local, False)
            self._wake_locked(it, ci)

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
            it.acked[local] |= untaken
            for ci in range(untaken.shape[1]):
                if untaken[:, ci].any():
                    it.set_consumed(ci, local[untaken[:, ci]], True)
                    self._wake_locked(it, ci)  # fewer rows to wait for: a claim may be done

    # --- leases ------------------------------------------------------------------------------
    def _grant_locked(
        self, it: _Iteration, ci: int, rows: np.ndarray, owner: str, lease_id: str, term: float, whole_groups: bool,
        run: tuple[int, int] | None = None,
    ) -> None:
        """Lease ``rows`` (local, ascending; ``run``: they are the range ``[start, stop)``) to ``owner`` under ``lease_id``."""
        idx = rows if run is None else slice(*run)
        lease = it.leases.get(lease_id)
        new = lease is None
        if lease is None:
            num = it.lease_num.setdefault(lease_id, len(it.lease_num))
            lease = it.leases[lease_id] = it.live[num] = _Lease(lease_id, num, owner, ci, term, 0.0, rows, whole_groups)
            it.by_owner.setdefault(owner, set()).add(lease_id)
        elif len(lease.rows) and rows[0] > lease.rows[-1]:  # rows are new to it (taken now): keep them ascending
            lease.rows = np.concatenate([lease.rows, rows])
        else:
            lease.rows = np.sort(np.concatenate([lease.rows, rows]))
        lease.whole_groups |= whole_groups
        lease.expiry = time.monotonic() + term
        heapq.heappush(it.expiries, (lease.expiry, lease.num))
        it.lease_at[idx, ci] = lease.num
        # a new lease of rows none of which is finished (the usual take) holds all of them: no recount
        self._recount_locked(it, lease, len(rows) if new and not it.fin[idx, ci].any() else None)

    def _recount_locked(self, it: _Iteration, lease: _Lease, undone: int | None = None) -> None:
        """Set ``lease.undone`` (default: count it now) and the held totals with it."""
        if undone is None:
            undone = len(lease.rows) - int(np.count_nonzero(self._lease_done(it, lease)[1]))
        delta, lease.undone = undone - lease.undone, undone
        if delta:
            it.undone[lease.consumer] += delta
            by = it.undone_by[lease.consumer]
            by[lease.owner] = by.get(lease.owner, 0) + delta

    def _drop_lease_locked(self, it: _Iteration, lease: _Lease) -> None:
        """Remove a lease from the live ones (its rows were detached or are being handled by the caller)."""
        self._recount_locked(it, lease, 0)
        del it.leases[lease.id], it.live[lease.num]
        ids = it.by_owner[lease.owner]
        ids.discard(lease.id)
        if not ids:
            del it.by_owner[lease.owner]

    def _unlease_locked(
        self, it: _Iteration, ci: int, local: np.ndarray, num: int | None = None, idx: np.ndarray | slice | None = None,
    ) -> None:
        """Detach rows from their leases (an ack or a release); drop leases left empty.

        ``num``: every row is held under that lease number (the caller checked); ``idx``: the rows as an index.
        """
        if num is not None and len(local):
            it.lease_at[local if idx is None else idx, ci] = -1
            lease = it.live[num]
            if len(local) == len(lease.rows):  # every row of the lease (its rows are distinct): it is over
                self._drop_lease_locked(it, lease)
            else:
                lease.rows = np.setdiff1d(lease.rows, local, assume_unique=True)
                self._recount_locked(it, lease)
            return
        nums = it.lease_at[local, ci]
        leased = nums >= 0
        local, nums = local[leased], nums[leased]
        if not len(local):
            return
        it.lease_at[local, ci] = -1
        same = bool((nums == nums[0]).all())  # the usual ack: the rows of one lease
        for num in ([int(nums[0])] if same else np.unique(nums).tolist()):
            lease = it.live[num]
            mine = local if same else local[nums == num]
            if len(mine) == len(lease.rows):  # every row of the lease (its rows are distinct): it is over
                self._drop_lease_locked(it, lease)
            else:
                lease.rows = np.setdiff1d(lease.rows, mine, assume_unique=True)
                self._recount_locked(it, lease)

    def _end_leases_locked(self, it: _Iteration, leases: list[_Lease], why: str) -> int:
        """End un-acked leases: finished rows count as acked, the others go back to the ready pool.

        Returns the number of rows returned to the pool.
        """
        returned = 0
        for lease in leases:
            rows, done = self._lease_done(it, lease)
            self._drop_lease_locked(it, lease)
            # an id can end more than once (a sharded claim takes rows under its id again after an
            # expiry): a late ack must still find the rows of every end
            ended_ci, ended = it.ended.get(lease.id, (lease.consumer, np.zeros(0, dtype=np.int64)))
            it.ended[lease.id] = (lease.consumer, np.union1d(ended, rows) if ended_ci == lease.consumer else rows)
            it.lease_at[rows, lease.consumer] = -1
            it.acked[rows[done], lease.consumer] = True
            it.acked_by[rows[done], lease.consumer] = lease.num
            it.set_consumed(lease.consumer, rows[~done], False)
            returned += int((~done).sum())
            logger.warning(
                "lease %s of owner %r (consumer %r, iteration %d) %s: %d rows back to the ready pool, %d finished",
                lease.id, lease.owner, self.schema.consumers[lease.consumer], it.iteration, why,
                int((~done).sum()), int(done.sum()),
            )
        self.rows_returned += returned
        for ci in {lease.consumer for lease in leases}:
            self._wake_locked(it, ci)
        return returned

    @staticmethod
    def _lease_done(it: _Iteration, lease: _Lease) -> tuple[np.ndarray, np.ndarray]:
        """The lease's rows (local, ascending) and which count as finished if it ended now.

        A whole-group lease finishes group by group (a group with any row unfinished goes
        back whole), so whole-group claims never meet a partial group.
        """
        rows = lease.rows
        done = it.fin[rows, lease.consumer]
        if lease.whole_groups and len(rows) and done.any() and not done.all():
            groups = rows // it.group_size
            unfinished = np.unique(groups[~done])
            done &= ~np.isin(groups, unfinished)
        return rows, done

    def _expire_locked(self, it: _Iteration) -> float:
        """End the leases past their expiry; return the next expiry (``time.monotonic``), inf if none."""
        now = time.monotonic()
        heap = it.expiries
        expired: dict[int, _Lease] = {}
        while heap:
            expiry, num = heap[0]
            lease = it.live.get(num)
            if lease is None or lease.expiry != expiry:  # ended, or renewed since: a stale entry
                heapq.heappop(heap)
            elif expiry <= now:
                heapq.heappop(heap)
                expired[num] = lease
            else:
                break
        if expired:
            leases = [expired[num] for num in sorted(expired)]
            self.leases_expired += len(leases)
            self._end_leases_locked(it, leases, f"expired (not renewed within its {leases[0].term_s:g}s term)")
            return self._expire_locked(it)
        return heap[0][0] if heap else math.inf

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
            self._ack_locked(it, consumer, lease, self._check_rows(it, np.asarray(rows, dtype=np.int64), what))

    def _ack_locked(
        self, it: _Iteration, consumer: str, lease: str, local: np.ndarray, held_all: bool = False, run: tuple[int, int] | None = None,
    ) -> None:
        """``ack_rows`` of checked local rows (``held_all``: the caller saw every row held under ``lease``;
        ``run``: the rows are the range ``[start, stop)``, ascending)."""
        what = f"ack by {consumer!r}"
        ci = it.consumer_index[consumer]
        expired = self.leases_expired
        self._expire_locked(it)
        num = it.lease_num.get(lease, -2)  # -2: an id never seen here matches no row
        if held_all and expired == self.leases_expired:  # nothing ended since the caller looked
            idx = local if run is None else slice(*run)
            self._unlease_locked(it, ci, local, num, idx)
            it.acked[idx, ci] = True
            it.acked_by[idx, ci] = num
            self._wake_locked(it, ci)
            return
        held = it.lease_at[local, ci] == num
        if held.all():  # the usual ack: every row still held under the lease
            self._unlease_locked(it, ci, local, num)
            it.acked[local, ci] = True
            it.acked_by[local, ci] = num
            self._wake_locked(it, ci)
            return
        done = it.acked_by[local, ci] == num  # acked before, or finished when the lease ended
        ended_ci, ended = it.ended.get(lease, (ci, None))
        was_leased = np.isin(local, ended) if ended is not None and ended_ci == ci else np.zeros(len(local), dtype=bool)
        late = was_leased & ~it.consumed[local, ci]  # back in the pool and not re-claimed: a late ack still counts
        bad = ~(held | done | late)
        self._unlease_locked(it, ci, local[held])
        ok = local[~bad]
        it.set_consumed(ci, ok[~it.consumed[ok, ci]], True)
        it.acked[ok, ci] = True
        it.acked_by[ok, ci] = num
        self._wake_locked(it, ci)
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
            it = self._it
            self._expire_locked(it)
            now, ids = time.monotonic(), it.by_owner.get(owner, ())
            for lease_id in ids:
                lease = it.leases[lease_id]
                lease.expiry = now + lease.term_s
                heapq.heappush(it.expiries, (lease.expiry, lease.num))
            return len(ids)

    def release_owner(self, owner: str) -> int:
        """End every lease of ``owner`` now, as if expired (the owner's process died).

        Returns the number of rows returned to the ready pool (finished rows count as acked).
        """
        with self._cond:
            if self._it is None:
                return 0
            it = self._it
            leases = sorted((it.leases[i] for i in it.by_owner.get(owner, ())), key=lambda lease: lease.num)
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
                it.derive()
            self._wake_all()
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
                it.spans[c.name] = [None] * len(it.chunks[c.name])
                it.chunk_bytes[c.name] = [0] * len(it.chunks[c.name])
                it.stored.add(c.name)
                chunk_of = {key: k for k, key in enumerate(it.chunks[c.name])}
                it.where[c.name][rows, 0] = [chunk_of[key] for key in keys]
                it.where[c.name][rows, 1] = payload.column("offset").to_numpy()
            else:
                cells = payload.column(c.name).combine_chunks()
                it.chunks[c.name].append(cells)
                it.spans[c.name].append(one_run(rows))
                it.chunk_bytes[c.name].append(cells.nbytes)
                it.where[c.name][rows, 0] = 0
                it.where[c.name][rows, 1] = np.arange(len(rows))
        for i, consumer in enumerate(self.schema.consumers):
            it.acked[:, i] = state.column(f"acked:{consumer}").to_numpy(zero_copy_only=False)
            it.consumed[:, i] = state.column(f"consumed:{consumer}").to_numpy(zero_copy_only=False)  # narrowed to acked on install
        if (it.acked & ~it.consumed).any():
            raise DockError(f"{what}: state table marks rows acked that are not consumed")
        return it

    def stats(self) -> dict[str, float]:
        """Counters for metrics: ``dock/bytes_put``, ``dock/bytes_read`` (a read served as a zero-copy
        slice of one put's cells counts that put's bytes pro rata), ``dock/wait_s``,
        ``dock/leases_expired`` and ``dock/rows_returned`` (rows back to the pool after a lease
        ended un-acked)."""
        with self._cond:
            return {"dock/bytes_put": self.bytes_put, "dock/bytes_read": self.bytes_read, "dock/wait_s": self.wait_s,
                    "dock/leases_expired": self.leases_expired, "dock/rows_returned": self.rows_returned}
