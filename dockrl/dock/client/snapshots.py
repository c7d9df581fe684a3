"""``DockClient``'s (``dockrl.dock.client.dock_client``) snapshots and counters.

**Snapshots** (one format in both modes). ``snapshot(uri)`` has every shard write its own snapshot under
``<uri>/<id>/shard-<s>``, copies the warehouse objects the rows live in (with a warehouse) to
``<uri>/<id>/objects/<key>`` (objects are deleted with their iteration, a snapshot must outlive
it), then writes ``<uri>/meta.json`` (shard count, layout, object keys) last, so a
snapshot cut short is never read as complete. It is consistent per shard, not across shards
(rows are independent, so each row's state is one some moment had). ``restore(uri)`` loads
shard ``s``'s snapshot into shard ``s`` of this client (same count, ``dock.shards``, and payload
place, ``dock.warehouse``: a snapshot taken otherwise is refused naming them; no iteration open
there), after writing the copied objects back into this client's warehouse under their keys. A
restored open iteration is not announced: the driver calls ``announce``.
"""

from __future__ import annotations

from dockrl.dock.client.core import ClientCore
from dockrl.dock.client.puts import Puts
from dockrl.dock.errors import DockError
from dockrl.dock.shard.layout import ShardLayout
from dockrl.dock.snapshot import (
    CLIENT_SNAPSHOT_KIND,
    OBJECTS_DIR,
    check_client_snapshot,
    join_uri,
    new_id,
    object_keys,
    read_blob,
    read_meta,
    write_blob,
    write_snapshot,
)


class Snapshots:
    """``DockClient``'s ``snapshot``, ``restore`` and ``stats``."""

    def __init__(self, core: ClientCore, puts: Puts) -> None:
        self.core, self.puts = core, puts

    # --- snapshots ----------------------------------------------------------------------------
    def snapshot(self, uri: str) -> None:
        """Snapshot every shard to ``<uri>/<id>/shard-<s>``, then ``<uri>/meta.json`` last.

        Raises:
            DockError: the shards disagree on the layout, or a shard's filesystem refused a write.
        """
        layouts = self.core.fetch_layouts()
        layout, more = (layouts[0], layouts[1:]) if layouts else (None, [])
        sid = new_id()
        shards = [f"{sid}/shard-{s:05d}" for s in range(len(self.core.locations))]
        for s, name in enumerate(shards):
            self.core.action(s, "snapshot", {"uri": join_uri(uri, name)})
        keys = object_keys(uri, shards, "snapshot")
        if keys:  # payload in a warehouse: copy the objects, which die with their iteration, into the snapshot
            assert self.core.warehouse is not None  # shards refer to objects only with payload "store"
            for key in keys:
                write_blob(uri, f"{sid}/{OBJECTS_DIR}/{key}", self.core.warehouse.read(key))
        meta = {"kind": CLIENT_SNAPSHOT_KIND, "schema_version": self.core.schema.version, "num_shards": len(self.core.locations),
                "mode": self.core.mode, "payload": self.core.payload, "layout": None if layout is None else layout.shard_meta(0),
                "shards": shards, "objects": keys} | ({"more": [m.shard_meta(0) for m in more]} if more else {})
        write_snapshot(uri, meta, {}, snapshot_id=sid)

    def restore(self, uri: str) -> None:
        """Load the snapshot at ``uri`` into the shards, shard ``s``'s into shard ``s``.

        Un-acked leases of the snapshot end (``ShardController.restore``).

        A snapshot taken in either ``dock.mode`` restores in either, with the same shard count.

        Raises:
            DockError: no complete snapshot, another schema version, another shard count
                (names ``dock.shards`` and ``dock.mode``), another payload place (names
                ``dock.warehouse``), or an iteration open on a shard (checked before any
                shard is touched).
        """
        self.puts.forget_prefetched(None)  # the shards hold no iteration: what puts took is gone with it
        meta = read_meta(uri)
        what = f"restore from {uri!r}"
        check_client_snapshot(meta, what, schema_version=self.core.schema.version, num_shards=len(self.core.locations), mode=self.core.mode,
                              payload=self.core.payload)
        first = meta["layout"]
        layout = None
        if first is not None:
            layout = ShardLayout(first["iteration"], first["num_rows"], first["group_size"], len(self.core.locations))
        more = [ShardLayout(m["iteration"], m["num_rows"], m["group_size"], len(self.core.locations)) for m in meta.get("more", [])]
        for s in range(len(self.core.locations)):
            open_now = self.core.describe(s)
            if open_now is not None:
                raise DockError(
                    f"{what}: iteration {open_now['iteration']} is open on dock shard {s} at {self.core.locations[s]}; close it first"
                )
        keys = meta.get("objects", [])
        for key in keys:
            # the snapshot's copies of the objects, back into this run's warehouse
            assert self.core.warehouse is not None  # a snapshot with objects has payload "store", as this dock (checked above)
            self.core.warehouse.write(key, read_blob(uri, f"{meta['id']}/{OBJECTS_DIR}/{key}", what))
        for s, name in enumerate(meta["shards"]):
            self.core.action(s, "restore", {"uri": join_uri(uri, name), "layout": None if layout is None else layout.shard_meta(s)}
                         | ({"more": [m.shard_meta(s) for m in more]} if more else {}))
        with self.core.lock:
            self.core.layout = layout
            self.core.known = {x.iteration: x for x in ([layout] if layout else []) + more}

    def stats(self) -> dict[str, float]:
        """Counters summed over shards: ``dock/bytes_put``, ``dock/bytes_read`` (payload bytes
        through the shards), ``dock/wait_s``, ``dock/controller_bytes`` (action bodies and
        results), and ``dock/shards``; with a warehouse also this client's traffic to the store:
        ``dock/store_bytes_written``, ``dock/store_bytes_read`` (Arrow IPC bytes),
        ``dock/store_objects_written``, ``dock/store_objects_read``."""
        total: dict[str, float] = {}
        for counters in self.core.each(lambda s: self.core.action(s, "stats", {}), range(len(self.core.locations))):
            if isinstance(counters, Exception):
                raise counters
            for key, value in counters.items():
                total[key] = total.get(key, 0) + value
        with self.core.lock:
            store = dict(self.core.store) if self.core.warehouse is not None else {}
        return total | store | {"dock/shards": len(self.core.locations)}
