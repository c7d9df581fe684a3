"""Warehouse backends of the transfer dock: where the payload of the columns lives (docs/design.md §2).

Chosen per run by ``dock.warehouse`` (``make_warehouse``, in ``dockrl.dock.warehouse.stores``).
This module holds what every backend shares: the ``Warehouse`` protocol, object keys, the Arrow
IPC encoding of an object, where cells live (``Located``), and reading and writing cells through
any backend.

* ``memory`` — the payload stays in the dock shards' memory (``DockShardServer(payload="memory")``,
  Arrow Flight ``do_put``/``do_get``); there is no warehouse object (``make_warehouse`` → None).
* ``s3`` — ``S3Warehouse`` (``dockrl.dock.warehouse.s3``): a bucket and a per-run prefix of an
  S3 store (MinIO in a cluster, any S3), through the ``minio`` client, with short timeouts and
  bounded retries.
* ``directory`` — ``DirectoryWarehouse`` (``dockrl.dock.warehouse.stores``): the same objects as
  files under a local directory (the embedded object store of a laptop run), each written
  atomically (temp file + rename).

**Object layout.** One Arrow IPC file per (iteration, column, chunk), under the run's root:
``iter-<iteration:08d>/<column>/<first row:08d>-<uuid>.arrow``, holding one record batch with
one field named after the column, of the schema's Arrow type. A chunk is the cells of one put
that one shard owns, in the put's row order. Objects are immutable: written once, read any
number of times, deleted with their iteration (``delete_iteration``).

**Who does what.** With a store backend the shards hold only metadata
(``DockShardServer(payload="store")``): a client's put writes its objects here, then tells each
owning shard with the ``commit`` action which rows of which column live in which object at which
offsets; a get or claim asks the shards to ``locate`` the cells (``Located``) and reads each
object it needs once (``read_cells``). No payload byte passes through a shard, and controller
bytes grow with the number of rows, not with the size of the cells.
"""

from __future__ import annotations

import logging
import re
import uuid
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, Callable, Mapping, Protocol, Sequence, TypeVar

import numpy as np
import pyarrow as pa

from dockrl.dock.errors import DockError
from dockrl.dock.schema import Schema

logger = logging.getLogger(__name__)
T = TypeVar("T")

MAX_PARALLEL = 8
"""Objects read or written concurrently by one call."""
_KEY = re.compile(r"[A-Za-z0-9._-]+(/[A-Za-z0-9._-]+)*/?")


class WarehouseError(DockError):
    """The object store failed: unreachable, credentials refused, object missing or not readable.

    The message names the store (endpoint and bucket, or directory), the operation and the key.
    """


class Warehouse(Protocol):
    """An object store holding immutable objects under ``/``-separated keys relative to the run's root.

    Every method raises ``WarehouseError`` naming the store and the key when the store fails.
    """

    url: str
    """Where the objects live, for messages: ``s3://endpoint/bucket/prefix`` or ``file:///dir``."""

    def write(self, key: str, data: bytes) -> None:
        """Store ``data`` under ``key``, atomically: readers see the whole object or none."""

    def read(self, key: str) -> bytes:
        """The bytes stored under ``key``."""

    def delete(self, keys: Sequence[str]) -> None:
        """Remove objects; keys that do not exist are ignored."""

    def list(self, prefix: str = "") -> list[str]:
        """Keys of the objects under ``prefix`` (``""``: all of the run's), sorted."""


# --- keys and Arrow IPC encoding -----------------------------------------------------------------


def iteration_prefix(iteration: int) -> str:
    """Key prefix of every object of ``iteration``."""
    return f"iter-{iteration:08d}/"


def new_key(iteration: int, column: str, first_row: int) -> str:
    """A fresh object key for a chunk of ``column`` whose first row is ``first_row``."""
    return f"{iteration_prefix(iteration)}{column}/{first_row:08d}-{uuid.uuid4().hex}.arrow"


def check_key(key: str, url: str) -> str:
    """``key``, checked: relative ``/``-separated names of ``[A-Za-z0-9._-]``, none ``.`` or ``..``.

    Raises:
        WarehouseError: naming the store ``url`` and the key.
    """
    if not _KEY.fullmatch(key) or any(part in (".", "..") for part in key.split("/")):
        raise WarehouseError(f"object store {url}: invalid key {key!r}; expected relative '/'-separated names of [A-Za-z0-9._-]")
    return key


def encode_array(column: str, array: pa.Array) -> bytes:
    """An Arrow IPC file with one record batch of one field ``column`` holding ``array``."""
    batch = pa.RecordBatch.from_arrays([array], names=[column])
    sink = pa.BufferOutputStream()
    with pa.ipc.new_file(sink, batch.schema) as writer:
        writer.write_batch(batch)
    return sink.getvalue().to_pybytes()


def decode_array(data: bytes, column: str, type: pa.DataType, where: str) -> pa.Array:
    """The array of an object written by ``encode_array``.

    Raises:
        WarehouseError: ``data`` is not an Arrow IPC file, or its field is not ``column`` of ``type``.
    """
    try:
        table = pa.ipc.open_file(pa.py_buffer(data)).read_all()
    except (pa.ArrowInvalid, OSError) as e:
        raise WarehouseError(f"{where}: not a readable Arrow IPC file ({e})") from None
    if table.schema.names != [column] or table.schema.field(0).type != type:
        raise WarehouseError(f"{where}: holds {table.schema}; expected one field {column!r} of type {type}")
    return table.column(0).combine_chunks()


# --- locations of cells --------------------------------------------------------------------------


@dataclass(frozen=True)
class Located:
    """Where the cells of one column live, in the order they were asked for.

    Cell ``k`` is row ``offsets[k]`` of object ``keys[index[k]]``; ``index`` and ``offsets`` are
    int64 arrays of shape ``(cells,)``.
    """

    keys: tuple[str, ...]
    index: np.ndarray
    offsets: np.ndarray

    def to_json(self) -> dict[str, Any]:
        return {"keys": list(self.keys), "index": self.index.tolist(), "offsets": self.offsets.tolist()}

    @classmethod
    def from_json(cls, data: Mapping[str, Any]) -> Located:
        return cls(tuple(data["keys"]), np.asarray(data["index"], np.int64), np.asarray(data["offsets"], np.int64))

    @staticmethod
    def concat(parts: Sequence[Located]) -> Located:
        """The cells of ``parts`` one after the other."""
        keys: list[str] = []
        index = []
        for part in parts:
            index.append(part.index + len(keys))
            keys += part.keys
        empty = np.zeros(0, np.int64)
        return Located(tuple(keys), np.concatenate([empty, *index]), np.concatenate([empty, *(p.offsets for p in parts)]))


def _parallel(fn: Callable[[Any], T], items: Sequence[Any]) -> list[T]:
    if len(items) <= 1:
        return [fn(x) for x in items]
    with ThreadPoolExecutor(max_workers=min(MAX_PARALLEL, len(items)), thread_name_prefix="dock-warehouse") as pool:
        return list(pool.map(fn, items))


def write_arrays(warehouse: Warehouse, objects: Sequence[tuple[str, str, pa.Array]]) -> int:
    """Write each ``(key, column, array)`` as one object, concurrently; all or none.

    Returns the bytes written. On any failure the objects already written are deleted (best
    effort, logged) before the error is raised, so no half-written put stays behind.

    Raises:
        WarehouseError: the store failed.
    """
    encoded = [(key, encode_array(column, array)) for key, column, array in objects]
    done: list[str] = []

    def write(item: tuple[str, bytes]) -> None:
        warehouse.write(*item)
        done.append(item[0])  # list.append is atomic under the GIL

    try:
        _parallel(write, encoded)
    except BaseException:
        delete_quietly(warehouse, done)
        raise
    return sum(len(data) for _, data in encoded)


def delete_quietly(warehouse: Warehouse, keys: Sequence[str]) -> None:
    """Delete ``keys``; a failure is logged, not raised (cleanup after another error)."""
    if not keys:
        return
    try:
        warehouse.delete(keys)
    except WarehouseError as e:
        logger.warning("could not delete %d unreferenced objects from %s: %s", len(keys), warehouse.url, e)


def read_cells(
    warehouse: Warehouse, schema: Schema, columns: Sequence[str], located: Mapping[str, Located]
) -> tuple[pa.RecordBatch, int, int]:
    """The located cells as one record batch (columns in order, cells in ``located`` order).

    Each distinct object is read once, concurrently. Returns the batch, the number of objects
    read and their bytes.

    Raises:
        WarehouseError: the store failed, an object is missing, or it is shorter than an offset.
    """
    column_of = {key: name for name in columns for key in located[name].keys}
    keys = list(column_of)
    blobs = dict(zip(keys, _parallel(warehouse.read, keys)))
    arrays = {
        key: decode_array(blobs[key], name, schema.column(name).type, f"object {key!r} in {warehouse.url}")
        for key, name in column_of.items()
    }
    out = []
    for name in columns:
        loc = located[name]
        chunks = [arrays[key] for key in loc.keys]
        lengths = np.array([len(c) for c in chunks], dtype=np.int64)
        bad = loc.offsets >= lengths[loc.index] if len(chunks) else loc.offsets >= 0
        if bad.any() or (loc.offsets < 0).any():
            k = int(np.flatnonzero(bad | (loc.offsets < 0))[0])
            raise WarehouseError(
                f"object {loc.keys[loc.index[k]]!r} in {warehouse.url} has no row {int(loc.offsets[k])} for column {name!r}"
            )
        starts = np.concatenate([[0], np.cumsum(lengths)[:-1]]).astype(np.int64)
        flat = pa.chunked_array(chunks, type=schema.column(name).type)
        out.append(flat.take(pa.array(starts[loc.index] + loc.offsets, type=pa.int64())).combine_chunks())
    batch = pa.RecordBatch.from_arrays(out, schema=schema.arrow_schema(list(columns)))
    return batch, len(keys), sum(len(b) for b in blobs.values())


def delete_iteration(warehouse: Warehouse, iteration: int) -> int:
    """Delete every object of ``iteration``; returns how many there were.

    Raises:
        WarehouseError: the store failed.
    """
    keys = warehouse.list(iteration_prefix(iteration))
    warehouse.delete(keys)
    return len(keys)
