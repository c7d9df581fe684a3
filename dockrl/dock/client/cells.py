"""How ``DockClient`` (``dockrl.dock.client.dock_client``) moves cells: the record batches of a put, the objects of
a put through a warehouse, and the reads (``get``, and the cells a claim brings or locates).

Puts and gets go straight to the shards owning the rows (a row out of range goes to the shard
nearest to it, which refuses it). A put's values are converted to the schema's Arrow types
first (``arrow_columns``), then it is atomic per shard but not across shards (one shard may
refuse an already written cell after another accepted its part).

**Warehouse.** With ``warehouse=`` (a ``dockrl.dock.warehouse.base`` store; shards started with
``payload="store"``) no payload passes through the shards: a put writes one object per
(column, owning shard) straight to the store, all of them before any shard hears of it, then
sends each shard a ``commit`` (keys and offsets); a shard that refuses its commit (a cell
already written) or a store failure leaves no object of the refused part behind and no
readiness bit set. A get or claim ``locate``s the cells on the shards and reads each object it
needs once. ``close_iteration`` deletes the iteration's objects.
"""

from __future__ import annotations

from typing import Any, Sequence

import numpy as np
import pyarrow as pa

from dockrl.dock.client.core import ClientCore
from dockrl.dock.errors import DockError
from dockrl.dock.shard.layout import ShardLayout
from dockrl.dock.shard.requests import ROW
from dockrl.dock.warehouse.base import Located, Warehouse, delete_quietly, new_key, read_cells, write_arrays


def part(array: pa.Array, pos: np.ndarray) -> pa.Array:
    """``array[pos]`` (``pos`` ascending, distinct): the array itself or a zero-copy slice when ``pos`` is
    one contiguous run (the usual put), else a take."""
    if len(pos) == len(array):
        return array
    if len(pos) and pos[-1] - pos[0] + 1 == len(pos) and (np.diff(pos) == 1).all():
        return array.slice(int(pos[0]), len(pos))
    return array.take(pa.array(pos))


def _one_chunk(column: pa.ChunkedArray | pa.Array) -> pa.Array:
    """The cells of ``column`` as one array (zero-copy when it has one chunk)."""
    if isinstance(column, pa.Array):
        return column
    return column.chunk(0) if column.num_chunks == 1 else column.combine_chunks()


class Cells:
    """``DockClient``'s cells: put batches and objects, gathers and reads (``get``), over ``core``."""

    def __init__(self, core: ClientCore) -> None:
        self.core = core

    def put_schema(self, names: tuple[str, ...]) -> pa.Schema:
        """The schema of a put batch of ``names`` (checked columns): the int64 row column, then theirs (one
        object per column list: a stream of a schema seen before costs less)."""
        schema = self.core.put_schemas.get(names)
        if schema is None:
            schema = self.core.put_schemas[names] = pa.schema(
                [pa.field(ROW, pa.int64()), *(pa.field(n, self.core.schema.column(n).type) for n in names)])
        return schema

    def put_objects(
        self, warehouse: Warehouse, layout: ShardLayout, rows: np.ndarray, arrays: dict[str, pa.Array], extra: dict[str, Any],
    ) -> None:
        """A put through the warehouse: every object first, then one ``commit`` per owning shard (with ``extra``)."""
        parts = layout.split(rows)
        keys = {(s, name): new_key(layout.iteration, name, int(rows[pos].min())) for s, pos in parts.items() for name in arrays}
        objects = [(keys[s, name], name, part(array, pos)) for s, pos in parts.items() for name, array in arrays.items()]
        nbytes = write_arrays(warehouse, objects)  # all or none
        with self.core.lock:
            self.core.store["dock/store_bytes_written"] += nbytes
            self.core.store["dock/store_objects_written"] += len(objects)
        committed: list[int] = []
        unknown = None
        try:
            for s, pos in parts.items():
                refs = {name: {"key": keys[s, name], "offsets": list(range(len(pos)))} for name in arrays}
                try:
                    self.core.action(s, "commit", {"iteration": layout.iteration, "rows": rows[pos].tolist(), "objects": refs} | extra)
                except DockError:
                    raise  # refused: the shard recorded nothing of this part
                except BaseException:
                    unknown = s  # the commit may have landed: keep its objects (close_iteration deletes them)
                    raise
                committed.append(s)
        finally:  # objects of the parts no shard recorded are referenced by nobody
            delete_quietly(warehouse, [keys[s, name] for s in parts if s not in committed and s != unknown for name in arrays])

    def gather(self, layout: ShardLayout, columns: list[str], parts: dict[int, list[int]]) -> list[pa.Table]:
        """The cells of ``parts`` (shard → rows), one table per shard in memory mode, one in all with a warehouse."""
        parts = {s: rows for s, rows in parts.items() if rows}
        if self.core.warehouse is None:
            return [self.read(layout, s, columns, rows) for s, rows in parts.items()]
        located = [
            self.core.action(s, "locate", {"iteration": layout.iteration, "columns": columns, "rows": rows}) for s, rows in parts.items()
        ]
        merged = {name: Located.concat([Located.from_json(loc[name]) for loc in located]) for name in columns}
        batch, objects, nbytes = read_cells(self.core.warehouse, self.core.schema, columns, merged)
        with self.core.lock:
            self.core.store["dock/store_bytes_read"] += nbytes
            self.core.store["dock/store_objects_read"] += objects
        return [pa.Table.from_batches([batch])]

    def read(self, layout: ShardLayout, s: int, columns: list[str], rows: list[int]) -> pa.Table:
        return self.core.transports[s].get({"iteration": layout.iteration, "columns": columns, "rows": rows}, self.core.rpc_timeout_s)

    def arrow_schema(self, columns: list[str], what: str) -> pa.Schema:
        key = tuple(columns)
        schema = self.core.arrow_schemas.get(key)
        if schema is None:
            try:
                schema = self.core.arrow_schemas[key] = self.core.schema.arrow_schema(columns)
            except KeyError as e:
                raise DockError(f"{what}: {e.args[0]}") from None
        return schema

    def batch(self, tables: Sequence[pa.Table | pa.RecordBatch], columns: list[str], order: np.ndarray | None = None) -> pa.RecordBatch:
        """One record batch of ``tables`` stacked, rows reordered so that row ``order[k]`` comes k-th.

        Copies nothing when the cells already come in order in one chunk per column (a claim
        from one shard in one call, the usual case)."""
        schema = self.arrow_schema(columns, "get")
        if len(tables) == 1 and order is None and isinstance(tables[0], pa.RecordBatch):
            return tables[0]  # one batch of a shard: its schema is this one (same schema version)
        if len(tables) == 1:
            table = tables[0]
        else:
            table = pa.concat_tables([pa.Table.from_batches([t]) if isinstance(t, pa.RecordBatch) else t for t in tables]
                                     or [schema.empty_table()])
        if order is not None and len(order) > 1 and (order[1:] < order[:-1]).any():
            table = table.take(pa.array(np.argsort(order), type=pa.int64()))
        return pa.RecordBatch.from_arrays([_one_chunk(table.column(c)) for c in columns], schema=schema)

    def get(self, columns: Sequence[str], rows: Sequence[int], *, iteration: int | None = None) -> pa.RecordBatch:
        """Read cells without consuming them, gathered from the shards in the order of ``rows``.

        Raises:
            DockError: unknown column, row out of range, a cell not yet written, no open
                iteration, or (with ``iteration``) another iteration open.
        """
        columns = list(columns)
        rows_arr = np.asarray(rows, dtype=np.int64)
        layout = self.core.layout_for("get", iteration)
        if not len(rows_arr):  # no shard is asked: check the columns here
            return pa.RecordBatch.from_pylist([], schema=self.arrow_schema(columns, "get"))
        parts = layout.split(rows_arr)
        tables = self.gather(layout, columns, {s: rows_arr[pos].tolist() for s, pos in parts.items()})
        return self.batch(tables, columns, np.concatenate([np.zeros(0, np.int64), *parts.values()]))

