"""Snapshots of dock state on any ``pyarrow.fs`` filesystem: a local directory or ``s3://…``.

A snapshot at ``uri`` is a directory holding ``meta.json`` (JSON metadata) and, under a
fresh id, one Arrow IPC file per table::

    <uri>/meta.json              {"format", "version", "id", "files", …caller's metadata}
    <uri>/<id>/<table>.arrow     Arrow IPC file format

The tables are written first, then ``meta.json`` is written under a temporary name and moved
into place (a rename on a local disk, one object put on S3), and only then is the previous
snapshot's ``<old id>/`` deleted. A reader trusts ``meta.json`` alone, so a snapshot cut short
at any point is never read as complete: the reader sees the previous snapshot or none.

A shard controller's snapshot (``dock_snapshot``, ``check_dock_snapshot``, ``load_iteration``, in
``dockrl.dock.shard.controller_snapshot``) stores the open iteration's metadata (layout, readiness, consumed and acked bits) and payload;
a restore ends its un-acked leases (their holders belong to the old run).

URIs are what ``pyarrow.fs.FileSystem.from_uri`` accepts: an absolute path, ``file:///…``, or
``s3://bucket/key?endpoint_override=…&scheme=http`` (credentials from the usual AWS
environment variables).
"""

from __future__ import annotations

import json
import logging
import uuid
from typing import Any, Sequence

import pyarrow as pa
import pyarrow.fs as pafs

from dockrl.dock.errors import DockError

logger = logging.getLogger(__name__)

FORMAT = "dockrl.dock.snapshot"
"""Value of ``meta.json``'s ``format`` field."""
VERSION = 1
"""Snapshot layout version; ``read_meta`` refuses others."""
META = "meta.json"
CLIENT_SNAPSHOT_KIND = "dock"
"""``kind`` of the ``meta.json`` of a dock client's snapshot (one shard controller's snapshot per shard beside it)."""
OBJECTS_DIR = "objects"
"""Folder of a client's snapshot (under its id) with copies of the warehouse objects its rows live in."""


def new_id() -> str:
    """A fresh snapshot id (hex, safe as a file name)."""
    return uuid.uuid4().hex


def join_uri(uri: str, name: str) -> str:
    """``uri`` with ``/name`` appended to its path, query string kept (``s3://b/p?x=1`` → ``s3://b/p/name?x=1``)."""
    path, sep, query = uri.partition("?")
    return f"{path.rstrip('/')}/{name.strip('/')}{sep}{query}"


def _filesystem(uri: str, what: str) -> tuple[pafs.FileSystem, str]:
    try:
        fs, root = pafs.FileSystem.from_uri(uri)
    except (pa.ArrowException, OSError, ValueError) as e:
        raise DockError(f"{what}: cannot open {uri!r} as a filesystem URI (absolute path, file://, s3://): {e}") from None
    return fs, root.rstrip("/")


def _read_meta(fs: pafs.FileSystem, root: str) -> dict[str, Any] | None:
    path = f"{root}/{META}"
    if fs.get_file_info(path).type != pafs.FileType.File:
        return None
    with fs.open_input_stream(path) as f:
        return json.loads(f.read())


def write_snapshot(uri: str, meta: dict[str, Any], tables: dict[str, pa.Table], *, snapshot_id: str | None = None) -> None:
    """Write ``tables`` and ``meta`` as the snapshot at ``uri``, replacing any previous one.

    ``snapshot_id`` names the directory the tables go to (a caller that writes more files
    under ``<uri>/<id>/`` first, as the sharded client does, passes its own).

    Raises:
        DockError: the filesystem refused a write; names the URI.
    """
    fs, root = _filesystem(uri, "snapshot")
    sid = snapshot_id or new_id()
    try:
        fs.create_dir(f"{root}/{sid}", recursive=True)
        for name, table in tables.items():
            with fs.open_output_stream(f"{root}/{sid}/{name}.arrow") as out, pa.ipc.new_file(out, table.schema) as writer:
                writer.write_table(table)
        old = _read_meta(fs, root)
        doc = {**meta, "format": FORMAT, "version": VERSION, "id": sid, "files": sorted(tables)}
        tmp = f"{root}/{META}.tmp-{sid}"
        with fs.open_output_stream(tmp) as out:
            out.write(json.dumps(doc).encode())
        fs.move(tmp, f"{root}/{META}")
    except (OSError, pa.ArrowException) as e:
        raise DockError(f"snapshot: writing {uri!r} failed: {e}") from None
    if old and old.get("id") and old["id"] != sid:
        try:
            fs.delete_dir(f"{root}/{old['id']}")
        except (OSError, pa.ArrowException) as e:  # the new snapshot is complete; a leftover directory is only garbage
            logger.warning("snapshot %s: could not delete the previous snapshot's files %s/: %s", uri, old["id"], e)


def read_meta(uri: str, what: str = "restore") -> dict[str, Any]:
    """The metadata of the complete snapshot at ``uri``.

    Raises:
        DockError: no complete snapshot there, another format, or an unknown version.
    """
    fs, root = _filesystem(uri, what)
    try:
        meta = _read_meta(fs, root)
    except (OSError, pa.ArrowException, ValueError) as e:
        raise DockError(f"{what}: reading {uri}/{META} failed: {e}") from None
    if meta is None:
        raise DockError(f"{what}: no complete snapshot at {uri!r} (no {META}; a snapshot cut short leaves none)")
    if meta.get("format") != FORMAT or meta.get("version") != VERSION:
        raise DockError(
            f"{what}: {uri!r} holds format {meta.get('format')!r} version {meta.get('version')!r}; "
            f"this dock reads {FORMAT!r} version {VERSION}"
        )
    return meta


def read_table(uri: str, meta: dict[str, Any], name: str, what: str = "restore") -> pa.Table:
    """Table ``name`` of the snapshot at ``uri`` whose metadata is ``meta``.

    Raises:
        DockError: the table is not part of the snapshot or cannot be read.
    """
    if name not in meta["files"]:
        raise DockError(f"{what}: snapshot at {uri!r} has no table {name!r}; it has {meta['files']}")
    fs, root = _filesystem(uri, what)
    try:
        with fs.open_input_file(f"{root}/{meta['id']}/{name}.arrow") as f:
            return pa.ipc.open_file(f).read_all()
    except (OSError, pa.ArrowException) as e:
        raise DockError(f"{what}: reading table {name!r} of the snapshot at {uri!r} failed: {e}") from None


def write_blob(uri: str, name: str, data: bytes) -> None:
    """Write ``data`` as the file ``<uri>/<name>`` (parent directories created).

    Raises:
        DockError: the filesystem refused the write; names the URI and file.
    """
    fs, root = _filesystem(uri, "snapshot")
    path = f"{root}/{name.strip('/')}"
    try:
        fs.create_dir(path.rsplit("/", 1)[0], recursive=True)
        with fs.open_output_stream(path) as out:
            out.write(data)
    except (OSError, pa.ArrowException) as e:
        raise DockError(f"snapshot: writing {name!r} under {uri!r} failed: {e}") from None


def read_blob(uri: str, name: str, what: str = "restore") -> bytes:
    """The bytes of the file ``<uri>/<name>``.

    Raises:
        DockError: the file is missing or unreadable; names the URI and file.
    """
    fs, root = _filesystem(uri, what)
    try:
        with fs.open_input_stream(f"{root}/{name.strip('/')}") as f:
            return f.read()
    except (OSError, pa.ArrowException) as e:
        raise DockError(f"{what}: reading {name!r} under {uri!r} failed: {e}") from None


def object_keys(uri: str, shards: Sequence[str], what: str) -> list[str]:
    """Warehouse keys the shard snapshots ``<uri>/<shard>`` of a client's snapshot refer to, sorted
    (with the iterations a shard stored open beside its oldest, ``ShardService``)."""
    keys: set[str] = set()
    for name in shards:
        shard_uri = join_uri(uri, name)
        more = (read_meta(shard_uri, what).get("extra") or {}).get("more") or []  # open beside the oldest (ShardService)
        for where in [shard_uri, *(join_uri(shard_uri, f"open-{m['iteration']}") for m in more)]:
            meta = read_meta(where, what)
            for column in meta.get("objects", []):
                keys.update(read_table(where, meta, f"objects.{column}", what).column("key").to_pylist())
    return sorted(keys)


def check_client_snapshot(meta: dict[str, Any], what: str, *, schema_version: int, num_shards: int, mode: str, payload: str) -> None:
    """Refuse a client's snapshot (its ``meta.json``) that a dock of ``schema_version``, ``num_shards``
    shards and ``payload`` place cannot restore; either ``mode`` restores it.

    Raises:
        DockError: naming the settings it was taken with (``dock.shards``, ``dock.warehouse``) and the fix.
    """
    if meta.get("kind") != CLIENT_SNAPSHOT_KIND:
        raise DockError(f"{what}: the snapshot there is a {meta.get('kind')!r}, not a dock snapshot")
    if meta["schema_version"] != schema_version:
        raise DockError(f"{what}: snapshot has schema v{meta['schema_version']}; this dock has v{schema_version}")
    taken = f"dock.mode={meta['mode']}, dock.shards={meta['num_shards']}"
    if meta["num_shards"] != num_shards:
        raise DockError(
            f"{what}: the snapshot was taken with {taken}; this dock has dock.mode={mode}, "
            f"dock.shards={num_shards}: resume with dock.shards={meta['num_shards']} (either dock.mode restores it)"
        )
    if meta["payload"] != payload:
        place = {"memory": "dock.warehouse=memory", "store": "dock.warehouse=directory or s3"}
        raise DockError(
            f"{what}: the snapshot was taken with {place[meta['payload']]} ({taken}); this dock has "
            f"{place[payload]}: resume with {place[meta['payload']]}"
        )
