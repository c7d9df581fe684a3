"""The snapshot of one shard controller (``ShardController.snapshot``/``restore``), in the format
of ``dockrl.dock.snapshot``: the open iteration's metadata (layout, readiness, consumed and acked
bits) and payload, or, for a column whose payload is in a warehouse, where its cells are. A
restore ends the snapshot's un-acked leases (their holders belong to the old run).
"""

from __future__ import annotations

from typing import Any

import numpy as np
import pyarrow as pa

from dockrl.dock.errors import DockError
from dockrl.dock.rows import one_run
from dockrl.dock.schema import Schema
from dockrl.dock.shard.iteration import IterationTable
from dockrl.dock.shard.leases import lease_done
from dockrl.dock.snapshot import read_table


def dock_snapshot(schema: Schema, it: IterationTable | None, extra: dict[str, Any] | None) -> tuple[dict[str, Any], dict[str, pa.Table]]:
    """The ``meta.json`` and tables of a shard controller's state, for ``write_snapshot``: the open
    iteration ``it`` (or none), its readiness, consumed and acked bits, and every written cell
    (or, for a column whose payload is in a warehouse, where its cells are); ``extra`` beside it.
    The caller holds the controller's lock and ended the expired leases first."""
    meta: dict[str, Any] = {
        "kind": "transfer_dock", "schema_version": schema.version,
        "columns": [[c.name, str(c.type)] for c in schema.columns],
        "consumers": list(schema.consumers), "extra": extra, "iteration": None,
    }
    tables: dict[str, pa.Table] = {}
    if it is None:
        return meta, tables
    meta |= {"iteration": it.iteration, "num_rows": it.num_rows, "group_size": it.group_size,
             "first_row": it.first_row, "total_rows": it.total_rows, "leases": len(it.leases)}
    acked = it.acked.copy()  # un-acked leases end at restore: store what they finished as acked
    for lease in it.leases.values():
        rows, done = lease_done(it, lease)
        acked[rows[done], lease.consumer] = True
    state = {f"ready:{c.name}": it.ready[:, i] for i, c in enumerate(schema.columns)}
    state |= {f"consumed:{c}": it.consumed[:, i] for i, c in enumerate(schema.consumers)}
    state |= {f"acked:{c}": acked[:, i] for i, c in enumerate(schema.consumers)}
    tables["state"] = pa.table({k: pa.array(v) for k, v in state.items()})
    meta["objects"] = []
    for i, c in enumerate(schema.columns):
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
            values = it.cells(c.name, rows)
            tables[f"payload.{c.name}"] = pa.table({"row": pa.array(rows + it.first_row), c.name: values})
    return meta, tables


def check_dock_snapshot(schema: Schema, meta: dict[str, Any], what: str, extra: dict[str, Any] | None) -> None:
    """Refuse a snapshot that is not a shard controller's of ``schema`` (with ``extra``: taken with another ``extra``).

    Raises:
        DockError: naming what differs.
    """
    columns = [[c.name, str(c.type)] for c in schema.columns]
    if meta.get("kind") != "transfer_dock":
        raise DockError(f"{what}: the snapshot there is a {meta.get('kind')!r}, not a transfer_dock snapshot")
    ours = (schema.version, columns, list(schema.consumers))
    if (meta["schema_version"], meta["columns"], meta["consumers"]) != ours:
        raise DockError(
            f"{what}: snapshot has schema v{meta['schema_version']} columns {meta['columns']} consumers {meta['consumers']}; "
            f"this dock has v{schema.version} columns {columns} consumers {list(schema.consumers)}"
        )
    if extra is not None and meta["extra"] != extra:
        raise DockError(f"{what}: snapshot was taken with {meta['extra']}; expected {extra}")


def load_iteration(schema: Schema, uri: str, meta: dict[str, Any], what: str) -> tuple[IterationTable, int]:
    """The iteration table stored at ``uri`` (``meta`` read there, with an iteration), and the rows
    returned to the ready pool: the old run's un-acked leases end (its consumed bits narrow to the acked ones).

    Raises:
        DockError: the state or payload tables disagree with each other or with ``meta``.
    """
    it = IterationTable(schema, meta["iteration"], meta["num_rows"], meta["group_size"], meta["first_row"],
                        meta.get("total_rows", meta["first_row"] + meta["num_rows"]))
    state = read_table(uri, meta, "state")
    if state.num_rows != it.num_rows:
        raise DockError(f"{what}: state table has {state.num_rows} rows; the iteration has {it.num_rows}")
    for i, c in enumerate(schema.columns):
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
    for i, consumer in enumerate(schema.consumers):
        it.acked[:, i] = state.column(f"acked:{consumer}").to_numpy(zero_copy_only=False)
        it.consumed[:, i] = state.column(f"consumed:{consumer}").to_numpy(zero_copy_only=False)  # narrowed to acked on install
    if (it.acked & ~it.consumed).any():
        raise DockError(f"{what}: state table marks rows acked that are not consumed")
    returned = int((it.consumed & ~it.acked).sum())
    it.consumed &= it.acked
    it.derive()
    return it, returned
