"""In-process transfer dock: controller (readiness and consumption bits) and warehouse (Arrow chunks).

The API is the one every stage uses and that the networked, sharded dock serves unchanged:
``open_iteration`` → ``put`` / ``claim`` / ``get`` → ``close_iteration``. Rows are indexed
``0 .. num_rows-1`` within an iteration; prompt ``i`` owns rows ``[i·n, (i+1)·n)`` (n = group
size). Waiting is event-driven on a condition variable, never a sleep-poll loop.

A shard of the networked dock (``dockrl.dock.flight``) wraps one ``TransferDock`` over its
slice of rows (``open_iteration(..., first_row=k)``, so errors name global rows); ``take``,
``release`` and ``missing`` are the metadata-only building blocks of a claim across shards.

The control channel of a run whose stages are separate processes (``wait_iteration``,
``report``, ``wait_reports``, ``finish``) is ``dockrl.dock.control``; each dock owns one.
"""

from __future__ import annotations

import math
import threading
import time
from dataclasses import dataclass
from typing import Mapping, Sequence

import numpy as np
import pyarrow as pa

from dockrl.dock.control import RunControl
from dockrl.dock.errors import DockError, DockTimeoutError
from dockrl.dock.schema import Schema


@dataclass(frozen=True)
class Claim:
    """Rows handed to one consumer: their indexes and the requested columns.

    ``batch`` has one record per row, in the order of ``rows``. An empty claim (no rows) means
    the consumer has taken every row of the iteration.
    """

    iteration: int
    rows: list[int]
    batch: pa.RecordBatch

    def __len__(self) -> int:
        return len(self.rows)


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


class _Iteration:
    def __init__(self, schema: Schema, iteration: int, num_rows: int, group_size: int, first_row: int) -> None:
        self.iteration, self.num_rows, self.group_size, self.first_row = iteration, num_rows, group_size, first_row
        self.col_index = {c.name: i for i, c in enumerate(schema.columns)}
        self.consumer_index = {c: i for i, c in enumerate(schema.consumers)}
        self.ready = np.zeros((num_rows, len(schema.columns)), dtype=bool)
        self.consumed = np.zeros((num_rows, len(schema.consumers)), dtype=bool)
        # warehouse: per column, Arrow chunks and, per row, (chunk, offset)
        self.chunks: dict[str, list[pa.Array]] = {c.name: [] for c in schema.columns}
        self.where = {c.name: np.full((num_rows, 2), -1, dtype=np.int64) for c in schema.columns}


class TransferDock:
    """The experience table of one iteration at a time, shared by the stages of one process.

    Args:
        schema: the column schema; every put is checked against it.
        timeout_s: default claim timeout in seconds.

    Thread-safe: stages may run as threads and block in ``claim``.
    """

    def __init__(self, schema: Schema, *, timeout_s: float = 600.0) -> None:
        self.schema = schema
        self.timeout_s = timeout_s
        self._cond = threading.Condition()
        self._it: _Iteration | None = None
        self.bytes_put = 0
        self.bytes_read = 0
        self.wait_s = 0.0
        self.control = RunControl(timeout_s=timeout_s)

    # --- iteration lifecycle -------------------------------------------------------------
    def open_iteration(self, iteration: int, num_rows: int, group_size: int, *, first_row: int = 0) -> None:
        """Start an empty table of ``num_rows`` rows in groups of ``group_size``.

        Rows are numbered ``first_row .. first_row+num_rows-1`` (a shard's slice of the
        iteration); ``first_row`` must be a multiple of ``group_size`` so groups stay whole.

        Raises:
            DockError: an iteration is still open, or the sizes are invalid.
        """
        if group_size < 1 or num_rows < 1 or num_rows % group_size:
            raise DockError(f"open_iteration: num_rows={num_rows} must be a positive multiple of group_size={group_size}")
        if first_row < 0 or first_row % group_size:
            raise DockError(f"open_iteration: first_row={first_row} must be a non-negative multiple of group_size={group_size}")
        with self._cond:
            if self._it is not None:
                raise DockError(f"open_iteration({iteration}): iteration {self._it.iteration} is still open")
            self._it = _Iteration(self.schema, iteration, num_rows, group_size, first_row)
            self.control.set_open(iteration)
            self._cond.notify_all()

    def close_iteration(self) -> None:
        """Drop the current iteration's table; later puts and claims raise ``DockError``."""
        with self._cond:
            self._it = None
            self.control.set_open(None)
            self._cond.notify_all()

    def _current(self, what: str, iteration: int | None = None) -> _Iteration:
        if self._it is None:
            raise DockError(f"{what}: no iteration is open (call open_iteration first, or it was closed)")
        if iteration is not None and iteration != self._it.iteration:
            raise DockError(f"{what}: iteration {iteration} is not open; the open iteration is {self._it.iteration}")
        return self._it

    @property
    def num_rows(self) -> int:
        with self._cond:
            return self._current("num_rows").num_rows

    @property
    def group_size(self) -> int:
        with self._cond:
            return self._current("group_size").group_size

    # --- writes ----------------------------------------------------------------------------
    def put(
        self, rows: Sequence[int], columns: Mapping[str, Sequence | pa.Array] | pa.RecordBatch, *, iteration: int | None = None
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
            for name in arrays:
                written = it.ready[rows_arr, it.col_index[name]]
                if written.any():
                    raise DockError(
                        f"put: column {name!r} is already written for rows {(rows_arr[written] + it.first_row)[:10].tolist()}"
                    )
            for name, array in arrays.items():
                chunk_id = len(it.chunks[name])
                it.chunks[name].append(array)
                it.where[name][rows_arr, 0] = chunk_id
                it.where[name][rows_arr, 1] = np.arange(len(rows_arr))
                it.ready[rows_arr, it.col_index[name]] = True
                self.bytes_put += array.nbytes
            self._cond.notify_all()

    @staticmethod
    def _check_rows(it: _Iteration, rows: np.ndarray, what: str) -> np.ndarray:
        """Check row numbers against the iteration's range; return them as local indexes."""
        stop = it.first_row + it.num_rows
        bad = rows[(rows < it.first_row) | (rows >= stop)]
        if len(bad):
            raise DockError(f"{what}: rows {bad[:10].tolist()} out of range [{it.first_row}, {stop}) in iteration {it.iteration}")
        if len(np.unique(rows)) != len(rows):
            raise DockError(f"{what}: repeated row indexes in {rows[:20].tolist()}")
        return rows - it.first_row

    # --- reads -----------------------------------------------------------------------------
    def _gather(self, it: _Iteration, columns: Sequence[str], rows: np.ndarray) -> pa.RecordBatch:
        arrays = []
        for name in columns:
            loc = it.where[name][rows]
            chunks = it.chunks[name]
            offsets = np.cumsum([0] + [len(c) for c in chunks])
            flat = pa.chunked_array(chunks, type=self.schema.column(name).type)
            arrays.append(flat.take(pa.array(offsets[loc[:, 0]] + loc[:, 1])).combine_chunks())
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

    def claim(
        self,
        consumer: str,
        columns: Sequence[str],
        count: int,
        *,
        whole_groups: bool = False,
        timeout_s: float | None = None,
    ) -> Claim:
        """Atomically take up to ``count`` rows ready in all ``columns`` and not yet taken by ``consumer``.

        Blocks until ``min(count, rows this consumer has not taken yet)`` rows are ready, so
        each call returns a full batch except the last of an iteration; returns an empty claim
        once the consumer has taken every row. With ``whole_groups`` only complete prompt
        groups are taken and ``count`` must be a multiple of the group size.

        Raises:
            DockError: unknown column or consumer, bad count, or no open iteration.
            DockTimeoutError: not enough rows became ready within the timeout; names the
                columns still missing and how many rows lack each.
        """
        with self._cond:
            it, rows, _ = self._take_locked(consumer, columns, count, whole_groups, count, timeout_s, None)
            if not len(rows):
                return Claim(it.iteration, [], pa.RecordBatch.from_pylist([], schema=self.schema.arrow_schema(list(columns))))
            return Claim(it.iteration, (rows + it.first_row).tolist(), self._gather(it, columns, rows))

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
    ) -> tuple[list[int], int]:
        """Claim rows without reading their cells: the controller half of ``claim``.

        Takes up to ``count`` ready rows once ``min(at_least, rows pending)`` are ready
        (``at_least=None`` means ``count``, as in ``claim``; ``0`` never blocks). Returns the
        rows taken and how many rows the consumer still has pending (not taken) afterwards.

        Raises:
            DockError: as ``claim``; also a negative ``at_least`` or another iteration open.
            DockTimeoutError: as ``claim``.
        """
        with self._cond:
            it, rows, left = self._take_locked(
                consumer, columns, count, whole_groups, count if at_least is None else at_least, timeout_s, iteration
            )
            return (rows + it.first_row).tolist(), left

    def _take_locked(  # caller holds self._cond; returns local row indexes
        self, consumer: str, columns: Sequence[str], count: int, whole_groups: bool, at_least: int,
        timeout_s: float | None, iteration: int | None,
    ) -> tuple[_Iteration, np.ndarray, int]:
        timeout = self.timeout_s if timeout_s is None else timeout_s
        start = time.monotonic()
        deadline = start + timeout
        what = f"claim by {consumer!r}"
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
            pending = ~it.consumed[:, ci]
            num_pending = int(pending.sum())
            want = min(at_least, num_pending)
            ok = pending & it.ready[:, [it.col_index[c] for c in columns]].all(axis=1)
            if whole_groups:
                ok = np.repeat(ok.reshape(-1, it.group_size).all(axis=1), it.group_size)
            candidates = np.flatnonzero(ok)
            if num_pending == 0 or (len(candidates) >= want and (want > 0 or at_least == 0)):
                rows = candidates[:count]
                it.consumed[rows, ci] = True
                if len(rows):  # waiters for this consumer re-check how many rows they can still get
                    self._cond.notify_all()
                self.wait_s += time.monotonic() - start
                return it, rows, num_pending - len(rows)
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise DockTimeoutError(
                    f"{what} timed out after {timeout:.1f}s in iteration {it.iteration}: "
                    f"wanted {want} rows ready in {list(columns)}, {len(candidates)} ready; "
                    f"columns still missing (rows lacking): {self._missing_locked(it, ci, columns)}"
                )
            self._cond.wait(remaining if math.isfinite(remaining) else None)

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
                ``consumer``, no open iteration, or another iteration open.
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
            it.consumed[local, ci] = False
            self._cond.notify_all()

    def stats(self) -> dict[str, float]:
        """Counters for metrics: ``dock/bytes_put``, ``dock/bytes_read``, ``dock/wait_s``."""
        with self._cond:
            return {"dock/bytes_put": self.bytes_put, "dock/bytes_read": self.bytes_read, "dock/wait_s": self.wait_s}

    # --- control channel (dockrl.dock.control) ------------------------------------------------
    def wait_iteration(self, after: int, timeout_s: float | None = None) -> int | None:
        """Block until an iteration newer than ``after`` is open and return it; ``None`` after ``finish()``.

        Raises:
            DockTimeoutError: nothing happened within ``timeout_s`` (default: the dock's).
        """
        return self.control.wait_iteration(after, timeout_s)

    def report(self, iteration: int, stage: str, metrics: Mapping[str, float]) -> None:
        """Record ``stage``'s metrics of ``iteration`` (``RunControl.report``).

        Raises:
            DockError: bad metrics, or the stage already reported this iteration.
        """
        self.control.report(iteration, stage, metrics)

    def wait_reports(self, iteration: int, stages: Sequence[str], timeout_s: float | None = None) -> dict[str, dict[str, float]]:
        """Block until each of ``stages`` reported ``iteration``; return ``{stage: metrics}``.

        Raises:
            DockTimeoutError: stages missing at the timeout (default: the dock's); names them.
        """
        return self.control.wait_reports(iteration, stages, timeout_s)

    def finish(self) -> None:
        """No further iteration will open: idle ``wait_iteration`` calls return ``None``."""
        self.control.finish()
