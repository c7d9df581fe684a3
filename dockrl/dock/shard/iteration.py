"""The table of one iteration in one dock shard: its readiness, consumption and ack bits, the
leases' records, the per-consumer views of ready rows (``Lease``, ``ReadyView``: ``dockrl.dock.shard.records``),
and where each written cell lives.

``IterationTable`` is plain state; ``dockrl.dock.shard.controller.ShardController`` holds the
open one under its lock and is the only writer (``dockrl.dock.shard.leases`` changes its leases,
``dockrl.dock.shard.controller_snapshot`` stores and loads it). Rows here are local (``0 .. num_rows-1``);
``first_row`` maps them to the iteration's global rows.
"""

from __future__ import annotations

from typing import Mapping, Sequence

import numpy as np
import pyarrow as pa

from dockrl.dock.cells import slice_cells
from dockrl.dock.errors import DockError
from dockrl.dock.rows import distinct
from dockrl.dock.schema import Schema
from dockrl.dock.shard.records import Lease, ReadyView
from dockrl.dock.warehouse.base import Located


class IterationTable:
    """The state of one iteration's rows in one shard; the caller holds the controller's lock."""

    def __init__(self, schema: Schema, iteration: int, num_rows: int, group_size: int, first_row: int, total_rows: int) -> None:
        self.schema_version, self.consumers = schema.version, tuple(schema.consumers)
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
        self.leases: dict[str, Lease] = {}  # live leases by id
        self.live: dict[int, Lease] = {}  # live leases by number
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
        self.views: dict[tuple[int, tuple[int, ...], int], ReadyView] = {}
        self.views_of_ci: list[list[ReadyView]] = [[] for _ in range(n_cons)]
        self.views_of_col: list[list[ReadyView]] = [[] for _ in range(len(schema.columns))]
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

    def view(self, ci: int, cols: tuple[int, ...], unit: int) -> ReadyView:
        """The ready, untaken rows of consumer ``ci`` in columns ``cols`` (built on first use, then kept)."""
        key = (ci, cols, unit)
        view = self.views.get(key)
        if view is None:
            if unit > 1 and not self.gcons_on[ci]:
                self.gcons[:, ci] = self.consumed[:, ci].reshape(-1, self.group_size).sum(axis=1)
                self.gcons_on[ci] = True
            view = self.views[key] = ReadyView(self, ci, cols, unit)
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
                groups = distinct(groups)
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
                view.remove(idx if view.unit == 1 else distinct(groups))
        else:
            np.subtract.at(self.gcons[:, ci], groups, 1)
            self.consumed[rows, ci] = False
            self.npending[ci] += len(rows)
            for view in views:
                if view.unit == 1:
                    view.add(rows[view.nready[rows] == len(view.cols)])
                else:
                    ug = distinct(groups)
                    view.add(ug[(view.unit_ready[ug] == view.unit) & (self.gcons[ug, ci] == 0)])

    def held(self, ci: int, owner: str) -> int:
        """Rows of consumer ``ci`` leased by owners other than ``owner``, not acked nor finished."""
        return self.undone[ci] - self.undone_by[ci].get(owner, 0)

    def finished(self, ci: int, rows: np.ndarray) -> np.ndarray:
        """Whether consumer ``ci`` has written every output column of each of ``rows`` (local)."""
        return self.fin[rows, ci]

    def check_rows(self, rows: np.ndarray, what: str) -> np.ndarray:
        """Check row numbers against the iteration's range; return them as local indexes.

        Raises:
            DockError: a row out of range, of another shard, or repeated.
        """
        return self.local_rows(rows, what)[0]

    def local_rows(self, rows: np.ndarray, what: str) -> tuple[np.ndarray, bool]:
        """``check_rows``, and whether the rows are ascending."""
        stop = self.first_row + self.num_rows
        if len(rows) and rows[0] >= self.first_row and rows[-1] < stop and (len(rows) == 1 or (rows[1:] > rows[:-1]).all()):
            # ascending and in range (the usual request): nothing more to check
            return (rows - self.first_row if self.first_row else rows), True
        bad = rows[(rows < 0) | (rows >= self.total_rows)]
        if len(bad):
            raise DockError(f"{what}: rows {bad[:10].tolist()} out of range [0, {self.total_rows}) in iteration {self.iteration}")
        bad = rows[(rows < self.first_row) | (rows >= stop)]
        if len(bad):
            raise DockError(
                f"{what}: rows {bad[:10].tolist()} belong to another dock shard; this one holds [{self.first_row}, {stop}) "
                f"of iteration {self.iteration}"
            )
        if len(rows) > 1 and not (rows[1:] > rows[:-1]).all() and len(np.unique(rows)) != len(rows):
            raise DockError(f"{what}: repeated row indexes in {rows[:20].tolist()}")
        return rows - self.first_row, False

    def check_request(self, columns: Sequence[str], consumer: str | None, what: str) -> None:
        """Refuse unknown columns or consumer, and a consumer's claim on rewritable columns (``DockError``)."""
        for name in columns:
            if name not in self.col_index:
                raise DockError(f"{what}: unknown column {name!r}; schema v{self.schema_version} has {list(self.col_index)}")
        if consumer is not None and consumer not in self.consumer_index:
            raise DockError(f"{what}: unknown consumer {consumer!r}; schema has {list(self.consumer_index)}")
        if consumer is not None and (rewritable := [name for name in columns if name in self.rewritable]):
            raise DockError(f"{what}: consumer {consumer!r} claims on rewritable columns {rewritable}: a rewrite after the "
                            "claim would not reach it; read them with get")

    def claim_request(
        self, consumer: str, columns: Sequence[str], count: int, whole_groups: bool, at_least: int, owner: str, lease_id: str, what: str,
    ) -> tuple[int, tuple[int, ...]]:
        """Check a take's request; return the consumer's index and its view's columns (a request is checked once).

        Raises:
            DockError: unknown column or consumer, a count not positive (or not a multiple of the
                group size with ``whole_groups``), a negative ``at_least``, or a ``lease_id`` of
                another owner or consumer.
        """
        key = (consumer, tuple(columns), whole_groups)
        request = self.requests.get(key)
        if request is None:  # a request not seen in this iteration: check it once
            self.check_request(columns, consumer, what)
            request = self.requests[key] = (self.consumer_index[consumer], tuple(sorted({self.col_index[c] for c in columns})))
        ci = request[0]
        if count < 1 or (whole_groups and count % self.group_size):
            raise DockError(
                f"{what}: count={count} must be positive" + (f" and a multiple of group_size={self.group_size}" if whole_groups else "")
            )
        if at_least < 0:
            raise DockError(f"{what}: at_least={at_least} must be >= 0")
        known = self.leases.get(lease_id)
        if known is not None and (known.owner != owner or known.consumer != ci):
            raise DockError(
                f"{what}: lease {lease_id!r} belongs to owner {known.owner!r} and consumer "
                f"{self.consumers[known.consumer]!r}, not owner {owner!r}"
            )
        return request

    def drop(self, rows: np.ndarray) -> list[int]:
        """Mark local ``rows`` taken and acked for every consumer that has not taken them; returns those consumers."""
        untaken = ~self.consumed[rows]  # (rows, consumers)
        self.acked[rows] |= untaken
        dropped = []
        for ci in range(untaken.shape[1]):
            if untaken[:, ci].any():
                self.set_consumed(ci, rows[untaken[:, ci]], True)
                dropped.append(ci)
        return dropped

    def refuse_written(self, rows: np.ndarray, names: Sequence[str] | Mapping[str, object], index: np.ndarray | slice | None = None) -> None:
        """Refuse cells of ``names`` already written for ``rows`` (local; ``index``: the same rows as an index, a slice)."""
        for name in names:
            if name in self.rewritable:
                continue
            written = self.ready[rows if index is None else index, self.col_index[name]]
            if written.any():
                raise DockError(f"put: column {name!r} is already written for rows {(rows[written] + self.first_row)[:10].tolist()}")

    def refuse_unwritten(self, columns: Sequence[str], rows: np.ndarray) -> None:
        """Refuse a read of cells of ``columns`` not yet written for ``rows`` (local)."""
        for name in columns:
            self._refuse_unwritten(name, rows)

    def _refuse_unwritten(self, name: str, rows: np.ndarray) -> None:
        missing = ~self.ready[rows, self.col_index[name]]
        if missing.any():
            raise DockError(f"get: column {name!r} not yet written for rows {(rows[missing] + self.first_row)[:10].tolist()}")

    def add_chunk(
        self, name: str, chunk: pa.Array | str, index: np.ndarray | slice, offsets: np.ndarray, span: tuple[int, int] | None, nbytes: int,
    ) -> None:
        """Store a chunk of column ``name`` (Arrow cells, or the key of a warehouse object) holding the
        cells of the local rows ``index`` at ``offsets``; ``span``: it holds the rows ``[start, stop)`` in order."""
        self.where[name][index, 0] = len(self.chunks[name])
        self.where[name][index, 1] = offsets
        self.chunks[name].append(chunk)
        self.spans[name].append(span)
        self.chunk_bytes[name].append(nbytes)
        if isinstance(chunk, str):
            self.stored.add(name)

    def gather(self, columns: Sequence[str], rows: np.ndarray, run: tuple[int, int] | None = None) -> tuple[list[pa.Array], int]:
        """The cells of ``columns`` at local ``rows`` (``run``: they are the range ``[start, stop)``, ascending),
        and the bytes read (a zero-copy slice of one put's cells counts that put's bytes pro rata)."""
        arrays, nbytes = [], 0
        for name in columns:
            cells = None
            if run is not None and name not in self.rewritable and name not in self.stored:  # written once: where never changes
                start, stop = run
                c = int(self.where[name][start, 0])
                span = self.spans[name][c]
                if span is not None and span[0] <= start and stop <= span[1]:  # all in one chunk, in order: a zero-copy slice
                    chunk = self.chunks[name][c]
                    assert isinstance(chunk, pa.Array)
                    cells = chunk.slice(start - span[0], stop - start)
                    nbytes += self.chunk_bytes[name][c] * (stop - start) // max(len(chunk), 1)  # pro rata
            if cells is None:
                cells = self.cells(name, rows)
                nbytes += cells.nbytes
            arrays.append(cells)
        return arrays, nbytes

    def locate(self, columns: Sequence[str], rows: np.ndarray) -> dict[str, Located]:
        """Where the cells of local ``rows`` live in the warehouse, per column, in the order of ``rows``.

        Raises:
            DockError: a cell not yet written, or one that was ``put`` (held in memory), not committed.
        """
        out = {}
        for name in columns:
            self._refuse_unwritten(name, rows)
            loc = self.where[name][rows]
            chunk_ids, index = np.unique(loc[:, 0], return_inverse=True)
            keys = [self.chunks[name][c] for c in chunk_ids]
            if not all(isinstance(k, str) for k in keys):
                raise DockError(f"get: column {name!r} is held in the dock's memory, not in a warehouse; read it with get")
            out[name] = Located(tuple(str(k) for k in keys), index.astype(np.int64).reshape(-1), loc[:, 1].copy())
        return out

    def cells(self, name: str, rows: np.ndarray) -> pa.Array:
        """The written cells of column ``name`` at local ``rows``, in that order."""
        if name in self.stored:
            raise DockError(f"get: column {name!r} lives in a warehouse (committed objects); read it with locate")
        return slice_cells(self.chunks[name], self.where[name][rows], self.col_types[name])

    def missing(self, ci: int, columns: Sequence[str]) -> dict[str, int]:
        """For each of ``columns``, how many rows not yet taken by consumer ``ci`` lack it (zeros left out)."""
        pending = ~self.consumed[:, ci]
        lacking = {c: int((pending & ~self.ready[:, self.col_index[c]]).sum()) for c in columns}
        return {c: n for c, n in lacking.items() if n}
