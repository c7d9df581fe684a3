"""The transfer dock's one front end: the ``Dock`` API over S shards, in either ``dock.mode``.

``DockClient`` talks to its shards through transports (``dockrl.dock.shard.ShardTransport``):
``FlightTransport`` to ``DockShardServer`` processes (``dock.mode=distributed``; a
``grpc://host:port`` location builds one) or ``LocalTransport`` to ``ShardService`` objects of
this process (``dock.mode=inprocess``; ``open_dock`` builds ``dock.shards`` of them with the
configured ``dock.warehouse``). Everything below holds for both: the shards check every request
(the front end only routes rows), and a snapshot taken in one mode restores in the other.

**Rows → shards.** An iteration of G prompt groups of n rows is split into contiguous runs
of whole groups: shard ``s`` owns groups ``[s·G//S, (s+1)·G//S)``, and global row ``r`` keeps
its index on the shard that owns it (so shard errors name global rows). With fewer groups
than shards some shards own none. Every client derives the mapping from ``(num_rows,
group_size, S)`` (``flight.shard_ranges``); shards also check, store and ``describe`` it, so a
worker that did not open the iteration learns it, and shards given out of order are caught.
``wait_iteration`` brings shard 0's layout of the iteration it returns, so a stage learns the
mapping without a ``describe`` per shard and ``num_rows``/``group_size`` answer without a round trip.

**Claims.** The controller path is metadata only: a claim takes row indexes on a shard and,
with the payload in the shards' memory, brings their cells in the same ``do_get`` (the indexes
travel as schema metadata); with a warehouse the ``claim`` action returns the indexes and the
client reads the objects. ``put(..., ack=claim)`` acks with the put, one round trip per shard.
**Claims ride on puts** (``prefetch``, memory payload, in the iteration the client opened or
waited for): that put also takes the consumer's next claim of the same shape (columns, count,
whole groups) on one shard it goes to (with a locality hint the local one only), what is ready
now, under a fresh lease, and brings its cells back in the same round trip (a Flight
``do_exchange``); the stage's next ``claim`` of that shape starts from those rows, so a stage's
claim cycle (claim, compute, put with the ack) costs one round trip, not two. The rows are
leased (and renewed) from the put on until this client claims again; a claim of another shape by
the same consumer or in another iteration, or ``close()``, hands back those still under that
lease at once. A claim
sweeps the shards from a rotating start (a random shard for a client's first claim, unless
``first_shard``), taking what is ready without waiting. A client with a locality hint
(``local_shard``: the shard on its own node or pod, whose cells do not cross a network link)
claims from that shard alone, blocking on it, while it has rows left for the consumer (ready or
not); once it has none (empty), the claim steals from the others as below, for what it still
lacks; while short
of ``min(count, rows the consumer has left)`` it blocks server-side on one shard (the one
with most rows left for the consumer; for at least the rows no other shard can cover, else
one row or group) with the remaining deadline, then sweeps the others again: no client
sleep loop. On a timeout or any error the rows taken are released: a failed claim consumes
nothing. Known limit: while blocked on one shard, rows that become ready only on another
are seen when that shard answers or at the deadline (a last sweep runs before timing out).

**Leases.** Every client has a unique ``owner`` id (``host:pid:random`` unless given) and
claims under a fresh lease id per claim, on every shard it takes rows from, with its own
``lease_s`` term, renewed while it holds them (``dockrl.dock.heartbeat``). ``ack`` goes to the shards owning the
claim's rows. A claim with nothing to take while other owners hold rows of the consumer
blocks on the shard holding most of them (``wait_held``), for the same reason as
a take (``ShardController.take``); rows coming back on another shard are seen when that one answers.

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

**Iterations in flight.** With ``max_inflight`` > 1 (``dock.max_inflight``) up to that many
iterations are open at once, oldest first (the rollout of the next overlaps the update of this
one). Every request names its iteration: a stage's claims, puts and gets go to the iteration
it last waited for (``wait_iteration``), the driver's to the one it opened last, unless
``iteration=`` names another; ``close_iteration(k)`` closes one. A snapshot holds every open
iteration (``ShardService``: the others beside the oldest).

**Control channel.** ``wait_iteration``, ``report``, ``wait_reports`` and ``finish``
(``dockrl.dock.control``) go to shard 0, which holds the run's control state for every client;
the waits block server-side with the client's timeout (plus ``rpc_timeout_s`` of slack).
``open_iteration`` announces the iteration on shard 0 only once every shard has opened it.

Puts and gets go straight to the shards owning the rows (a row out of range goes to the shard
nearest to it, which refuses it). A put's values are converted to the schema's Arrow types
first (``arrow_columns``), then it is atomic per shard but not across shards (one shard may
refuse an already written cell after another accepted its part).

**Warehouse.** With ``warehouse=`` (a ``dockrl.dock.warehouse`` store; shards started with
``payload="store"``) no payload passes through the shards: a put writes one object per
(column, owning shard) straight to the store, all of them before any shard hears of it, then
sends each shard a ``commit`` (keys and offsets); a shard that refuses its commit (a cell
already written) or a store failure leaves no object of the refused part behind and no
readiness bit set. A get or claim ``locate``s the cells on the shards and reads each object it
needs once. ``close_iteration`` deletes the iteration's objects.
"""

from __future__ import annotations

import logging
import math
import os
import random
import socket
import threading
import time
import uuid
from typing import TYPE_CHECKING, Any, Mapping, NamedTuple, Sequence

import numpy as np
import pyarrow as pa

from dockrl.dock.api import Claim, Columns, Dock
from dockrl.dock.control import check_metrics
from dockrl.dock.errors import DockError, DockTimeoutError
from dockrl.dock.flight import FlightTransport
from dockrl.dock.heartbeat import LeaseHeartbeat
from dockrl.dock.iteration import arrow_columns
from dockrl.dock.schema import Schema
from dockrl.dock.shard import ROW, ClaimRequest, LocalTransport, Payload, ShardLayout, ShardTransport, local_shards
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
from dockrl.dock.warehouse import (
    Located,
    Warehouse,
    WarehouseError,
    delete_iteration,
    delete_quietly,
    make_warehouse,
    new_key,
    read_cells,
    write_arrays,
)

if TYPE_CHECKING:
    from dockrl.config import DockConfig

logger = logging.getLogger(__name__)


def _part(array: pa.Array, pos: np.ndarray) -> pa.Array:
    """``array[pos]`` (``pos`` ascending, distinct): the array itself or a zero-copy slice when ``pos`` is
    one contiguous run (the usual put), else a take."""
    if len(pos) == len(array):
        return array
    if len(pos) and pos[-1] - pos[0] + 1 == len(pos) and (np.diff(pos) == 1).all():
        return array.slice(int(pos[0]), len(pos))
    return array.take(pa.array(pos))


def _one(layouts: list[dict[str, int]]) -> list[dict[str, int]] | dict[str, int] | None:
    """Layouts for a message: none as None, one as itself, several as the list."""
    return None if not layouts else layouts[0] if len(layouts) == 1 else layouts


def _one_chunk(column: pa.ChunkedArray | pa.Array) -> pa.Array:
    """The cells of ``column`` as one array (zero-copy when it has one chunk)."""
    if isinstance(column, pa.Array):
        return column
    return column.chunk(0) if column.num_chunks == 1 else column.combine_chunks()


_RELEASE_TIMEOUT_S = 10.0
"""Longest wait, seconds, for a shard to take back rows a put took for a claim that will not use them (``close``
must not hang on a shard that is gone: the rows' lease ends at its term anyway)."""


class _Prefetched(NamedTuple):
    """Rows a put took for the consumer's next claim (``DockClient`` "Claims ride on puts")."""

    shape: tuple[tuple[str, ...], int, bool]
    """(columns, count, whole_groups) of the claim."""
    iteration: int
    shard: int
    lease: str
    rows: np.ndarray
    """Global row indexes taken (int64, ascending), leased under ``lease``."""
    pending: int
    held: int
    cells: pa.RecordBatch


class DockClient:
    """The transfer dock over S shards (the ``Dock`` protocol), in this process or over Flight.

    Args:
        shards: every shard, in shard order: a ``grpc://host:port`` location (a
            ``FlightTransport`` with ``token``) or a transport (``LocalTransport``).
        schema: the column schema (checked against each shard's).
        token: shared bearer token of Flight shards; None when they run without auth.
        timeout_s: default claim timeout, seconds.
        rpc_timeout_s: deadline of each non-blocking call, and the slack a blocking claim
            call gets past its own timeout.
        warehouse: the object store of the payload, for shards started with ``payload="store"``;
            None for shards that hold the payload in memory. The mode must match the shards'.
        lease_s: lease term of this client's claims, seconds; renewed every ``lease_s/3``.
        owner: lease owner id; default ``host:pid:random``, unique per client. A launcher that
            passes a known id can ``release_owner`` it when the worker's process dies.
        first_shard: the shard this client's first claim sweeps from (each claim then starts one
            shard further); default a random one, so that clients do not all start on shard 0.
        local_shard: locality hint, the shard co-located with this client (same node or pod):
            claims take (and wait for) its rows while it has rows left for the consumer, and
            steal from the others (in rotation) only once it is empty; None (default) for no
            preference.
        max_inflight: iterations this client may have open at once (``open_iteration``; ``dock.max_inflight``).
        prefetch: a put that acks a claim carries the consumer's next claim of the same shape (see
            "Claims ride on puts" above; memory payload only); False: every claim is its own round trip.

    Thread-safe; every method may raise ``DockError`` as the shards' ``ShardController`` does,
    and Flight errors (unreachable shard, ``FlightUnauthenticatedError`` for a wrong token)
    annotated with the shard and call.

    Raises:
        ValueError: no shards, ``lease_s`` not a finite number > 0, or ``local_shard`` not a shard index.
    """

    def __init__(
        self, shards: Sequence[str | ShardTransport], schema: Schema, *, token: str | None = None, timeout_s: float = 600.0,
        rpc_timeout_s: float = 60.0, warehouse: Warehouse | None = None, lease_s: float = 300.0, owner: str | None = None,
        first_shard: int | None = None, local_shard: int | None = None, max_inflight: int = 1, prefetch: bool = True,
    ) -> None:
        if not shards:
            raise ValueError("DockClient: shards is empty; expected at least one grpc://host:port or shard transport")
        if not 0 < lease_s < math.inf:
            raise ValueError(f"DockClient: lease_s={lease_s!r}; expected a finite number of seconds > 0")
        if local_shard is not None and not (isinstance(local_shard, int) and 0 <= local_shard < len(shards)):
            raise ValueError(f"DockClient: local_shard={local_shard!r}; expected a shard index in [0, {len(shards)}) or None")
        self.local_shard = local_shard
        self.transports: list[ShardTransport] = [FlightTransport(t, token=token) if isinstance(t, str) else t for t in shards]
        self.locations, self.schema = [t.location for t in self.transports], schema
        self.timeout_s, self.rpc_timeout_s, self.lease_s = timeout_s, rpc_timeout_s, lease_s
        self.owner = owner or f"{socket.gethostname()}:{os.getpid()}:{uuid.uuid4().hex[:8]}"
        self.heartbeat = LeaseHeartbeat(self.owner, lease_s, len(self.transports), lambda s: self._action(s, "renew", {"owner": self.owner}))
        self._closed = False
        self._lock = threading.Lock()
        self._layout: ShardLayout | None = None  # this client's current iteration (opened or waited for last), else the shards' newest
        self._confirmed: int | None = None  # the iteration of _layout when this client opened it or waited for it
        self._known: dict[int, ShardLayout] = {}  # layouts of open iterations seen, by iteration
        self.max_inflight = max_inflight
        self._arrow_schemas: dict[tuple[str, ...], pa.Schema] = {}  # of the column lists read so far
        self._put_schemas: dict[tuple[str, ...], pa.Schema] = {}  # of the put batches (row + columns) sent so far
        self._next = random.randrange(len(self.transports)) if first_shard is None else int(first_shard)
        self.warehouse = warehouse
        self.prefetch = prefetch and warehouse is None
        self._prefetched: dict[str, _Prefetched] = {}  # by consumer: what its last put took for its next claim
        self.store = {"dock/store_bytes_written": 0, "dock/store_bytes_read": 0,
                      "dock/store_objects_written": 0, "dock/store_objects_read": 0}

    # --- calls --------------------------------------------------------------------------------
    def _action(self, shard: int, name: str, body: dict[str, Any], timeout: float | None = None) -> Any:
        return self.transports[shard].action(name, body, self.rpc_timeout_s if timeout is None else timeout)

    @property
    def controller_bytes(self) -> int:
        """Bytes of requests and results this front end exchanged with its shards (0 in-process: nothing is serialized)."""
        return sum(getattr(t, "controller_bytes", 0) for t in self.transports)

    @property
    def mode(self) -> str:
        """The ``dock.mode`` of the shards: ``inprocess`` or ``distributed``."""
        return self.transports[0].mode

    # --- layout -------------------------------------------------------------------------------
    def _describe(self, shard: int) -> dict[str, int] | None:
        """Shard ``shard``'s layout of its newest open iteration (None: none is open)."""
        layouts = self._describe_all(shard)
        return layouts[-1] if layouts else None

    def _describe_all(self, shard: int) -> list[dict[str, int]]:
        """Shard ``shard``'s layouts of its open iterations, oldest first."""
        desc = self._action(shard, "describe", {})
        names = [c.name for c in self.schema.columns]
        if desc["schema_version"] != self.schema.version or desc["columns"] != names:
            raise DockError(
                f"dock shard {shard} at {self.locations[shard]} serves schema v{desc['schema_version']} "
                f"{desc['columns']}; this client has v{self.schema.version} {names}"
            )
        payload = desc.get("payload", "memory")
        if payload != self._payload:
            mine = "has no warehouse" if self.warehouse is None else f"has the warehouse {self.warehouse.url}"
            raise DockError(
                f"dock shard {shard} at {self.locations[shard]} runs with payload={payload!r} but this client {mine}; "
                "shards started with payload='store' need a DockClient with warehouse=..., payload='memory' ones one without "
                "(dock.warehouse)"
            )
        return desc.get("layouts", [desc["layout"]] if desc["layout"] is not None else [])

    def _fetch_layouts(self) -> list[ShardLayout]:
        """The layouts of the iterations open on the shards, oldest first (``_known`` is set to them)."""
        raw = [self._describe_all(s) for s in range(len(self.locations))]
        layouts = [ShardLayout(m["iteration"], m["num_rows"], m["group_size"], len(raw)) for m in raw[0]]
        for s, got in enumerate(raw):
            want = [layout.shard_meta(s) for layout in layouts]
            if got != want:
                raise DockError(
                    f"dock shards disagree: shard {s} at {self.locations[s]} has layout {_one(got)}, expected {_one(want)} "
                    "from shard 0; pass every shard, in the order the iteration was opened with, and do not open it concurrently"
                )
        with self._lock:
            self._known = {layout.iteration: layout for layout in layouts}
        return layouts

    def _fetch_layout(self) -> ShardLayout | None:
        layouts = self._fetch_layouts()
        layout = layouts[-1] if layouts else None
        with self._lock:
            self._layout = layout
        return layout

    def _layout_for(self, what: str, iteration: int | None = None, *, fresh: bool = False) -> ShardLayout:
        """The layout of the open iteration: the one this client knows, or (``fresh``) the shards'.

        With ``iteration``: that iteration's, asking the shards when the known one is another.

        Raises:
            DockError: no iteration is open, or ``iteration`` is not the open one.
        """
        with self._lock:
            layout = None if fresh else self._layout if iteration is None else self._known.get(iteration)
        if layout is not None and (iteration is None or layout.iteration == iteration):
            return layout
        layouts = self._fetch_layouts()
        if not layouts:
            raise DockError(f"{what}: no iteration is open (call open_iteration first, or it was closed)")
        if iteration is None:
            with self._lock:
                self._layout = layouts[-1]
            return layouts[-1]
        found = [layout for layout in layouts if layout.iteration == iteration]
        if not found:
            open_now = f"the open iteration is {layouts[0].iteration}" if len(layouts) == 1 else \
                f"the open iterations are {[x.iteration for x in layouts]}"
            raise DockError(f"{what}: iteration {iteration} is not open; {open_now}")
        return found[0]

    def _open_layout(self, what: str) -> ShardLayout:
        """The layout of the iteration open on the shards now (one ``describe`` when it is the known one)."""
        shard0, known = self._describe(0), self._layout
        return self._layout_for(what, fresh=shard0 is None or known is None or known.iteration != shard0["iteration"])

    def _sizes(self, what: str) -> ShardLayout:
        """The layout this client opened or waited for (``wait_iteration``) last, else the shards' (a round trip)."""
        with self._lock:
            layout = self._layout
            if layout is not None and layout.iteration == self._confirmed:
                return layout
        return self._open_layout(what)

    @property
    def num_rows(self) -> int:
        """Rows of the open iteration, all shards together: the one this client opened or last
        got from ``wait_iteration`` (no round trip), else the one open on the shards; ``DockError`` if none is open."""
        return self._sizes("num_rows").num_rows

    @property
    def group_size(self) -> int:
        """Rows per prompt group of the open iteration (as ``num_rows``); ``DockError`` if none is open."""
        return self._sizes("group_size").group_size

    # --- iteration lifecycle ------------------------------------------------------------------
    def open_iteration(self, iteration: int, num_rows: int, group_size: int, *, announce: bool = True) -> None:
        """Open the iteration on every shard, each for its range of whole groups.

        Then announce it on the control channel, unless ``announce=False``: stages see it
        only after ``announce(iteration)`` (the driver fills and snapshots it first).

        Raises:
            DockError: an iteration is still open (nothing is left opened), or bad sizes.
        """
        layout = ShardLayout(int(iteration), int(num_rows), int(group_size), len(self.locations))
        opened: list[int] = []
        limit = {"max_open": self.max_inflight} if self.max_inflight != 1 else {}
        try:
            for s in range(layout.num_shards):
                self._action(s, "open_iteration", layout.shard_meta(s) | limit)
                opened.append(s)
        except BaseException:
            for s in opened:  # leave no shard half-opened
                try:
                    self._action(s, "close_iteration", {"iteration": layout.iteration})
                except Exception as e:  # noqa: BLE001 - the open's own error is what the caller needs
                    logger.warning("could not close half-opened iteration %d on dock shard %d: %s", iteration, s, e)
            raise
        with self._lock:
            self._layout, self._confirmed = layout, layout.iteration
            self._known[layout.iteration] = layout
        if announce:
            self.announce(layout.iteration)

    def announce(self, iteration: int) -> None:
        """Let the stages' ``wait_iteration`` return ``iteration``, which must be open on shard 0.

        Raises:
            DockError: another iteration, or none, is open on shard 0.
        """
        self._action(0, "announce_iteration", {"iteration": int(iteration)})  # control channel: now stages may start
        if self._confirmed != iteration:  # one restored from a snapshot: this client's calls go to it, as after open_iteration
            layout = self._layout_for("announce", int(iteration))
            with self._lock:
                self._layout, self._confirmed = layout, layout.iteration

    def close_iteration(self, iteration: int | None = None) -> None:
        """Drop ``iteration`` (default: every open one) on every shard; claims blocked on it fail with ``DockError``.

        With a warehouse, the iteration's objects are deleted afterwards (a store failure there
        is logged, not raised: the iteration is closed either way).
        """
        closing = ([m["iteration"] for m in self._describe_all(0)] if iteration is None else [int(iteration)]) \
            if self.warehouse is not None else []
        with self._lock:
            if iteration is None or (self._layout is not None and self._layout.iteration == iteration):
                self._layout = self._confirmed = None
            self._known = {} if iteration is None else {k: v for k, v in self._known.items() if k != iteration}
        self._forget_prefetched(iteration)
        for s in range(len(self.locations)):
            self._action(s, "close_iteration", {} if iteration is None else {"iteration": int(iteration)})
        for it in closing:
            try:
                delete_iteration(self.warehouse, it)  # type: ignore[arg-type]  # closing is empty without a warehouse
            except WarehouseError as e:
                logger.warning("iteration %d closed, but its objects stay in %s: %s", it, self.warehouse.url, e)  # type: ignore[union-attr]

    # --- writes and reads ---------------------------------------------------------------------
    def put(self, rows: Sequence[int], columns: Columns, *, iteration: int | None = None, ack: Claim | None = None) -> None:
        """Write cells, sending each shard the rows it owns (``ShardController.put`` semantics).

        With ``iteration`` the put is refused unless that iteration is the open one. With
        ``ack`` the claim is acked once the put succeeded: when the put covers exactly the
        claim's rows each shard acks its part with the put itself (one call per shard instead
        of two), else ``put`` then ``ack``.

        Raises:
            DockError: as ``ShardController.put`` and ``ack_rows``, or the iteration was closed since
                this client learnt it; atomic per shard only.
        """
        kept = ack.row_array if ack is not None and rows is ack.rows else None  # put(claim.rows, ..., ack=claim)
        rows_arr = kept if kept is not None and len(kept) == len(rows) else np.asarray(rows, dtype=np.int64)
        arrays = arrow_columns(self.schema, columns, len(rows_arr))
        layout = self._layout_for("put", iteration)
        fused = (ack is not None and len(ack.rows) > 0 and ack.iteration == layout.iteration
                 and (rows is ack.rows or np.array_equal(rows_arr, ack.rows)
                      or np.array_equal(np.sort(rows_arr), np.sort(np.asarray(ack.rows, dtype=np.int64)))))
        lease = ack.lease if ack is not None else ""
        extra = {"ack": {"consumer": ack.consumer, "lease": lease}} if fused and ack is not None else {}
        try:
            if self.warehouse is not None:
                self._put_objects(self.warehouse, layout, rows_arr, arrays, extra)
            else:
                schema = self._put_schema(tuple(arrays))
                parts: dict[int, np.ndarray | None] = {}  # no rows: no call
                if len(rows_arr):  # positions each shard owns; None: every row (one shard: no split)
                    parts = {0: None} if layout.num_shards == 1 else dict(layout.split(rows_arr))
                # the shard whose put carries the next claim: with a locality hint the local one only (a claim
                # steals from the others only for what the local one lacks), else the last one the put goes to
                carrier = None
                if fused and self.prefetch and ack is not None and ack.shape is not None and parts and layout.iteration == self._confirmed:
                    carrier = list(parts)[-1] if self.local_shard is None else self.local_shard if self.local_shard in parts else None
                if carrier is not None:
                    parts[carrier] = parts.pop(carrier)  # last: a put refused by another shard carries no claim
                for s, pos in parts.items():
                    if pos is None or len(pos) == len(rows_arr):  # one shard owns every row: the arrays as they are
                        columns_out = [pa.array(rows_arr), *arrays.values()]
                    else:
                        columns_out = [pa.array(rows_arr[pos]), *(_part(a, pos) for a in arrays.values())]
                    batch = pa.RecordBatch.from_arrays(columns_out, schema=schema)
                    body = {"iteration": layout.iteration} | extra
                    if s == carrier and ack is not None and ack.shape is not None:
                        self._put_claim(s, body, batch, layout, ack.consumer, ack.shape)
                    else:
                        self.transports[s].put(body, batch, self.rpc_timeout_s)
        finally:
            if fused:  # acked with the put (or failed as an ack fails): stop renewing its lease
                self.heartbeat.drop(lease)
        if ack is not None and not fused:
            self.ack(ack)

    def _put_claim(
        self, s: int, body: dict[str, Any], batch: pa.RecordBatch, layout: ShardLayout, consumer: str,
        shape: tuple[tuple[str, ...], int, bool],
    ) -> None:
        """Put ``batch`` on shard ``s`` carrying the next claim of ``shape`` for ``consumer``; keep what it took.

        Raises:
            as the put (when it did not land, or its answer was lost: rows the claim may have taken go back).
        """
        names, count, whole_groups = shape
        iteration, lease = layout.iteration, os.urandom(16).hex()
        req = ClaimRequest(iteration, consumer, names, count, 0, whole_groups, 0.0, self.owner, lease, self.lease_s, False)

        def give_back() -> None:  # rows the claim took that this client does not know of: all of the shard's under the lease
            self._release(iteration, consumer, {s: list(range(*layout.ranges[s]))}, lease, min(self.rpc_timeout_s, _RELEASE_TIMEOUT_S))

        try:
            result = self.transports[s].put_claim(body, batch, req, self.rpc_timeout_s)
        except BaseException:  # the put did not land, or its answer was lost after it did
            give_back()
            raise
        if isinstance(result, DockError):  # the put landed, the claim did not (or its answer was incomplete)
            logger.debug("the claim a put carried failed (the next claim is its own call): %s", result)
            give_back()
            return
        rows, pending, held, cells = result
        taken = _Prefetched(shape, iteration, s, lease, rows, pending, held, cells)
        if len(rows):
            self._hold(lease, iteration)
        with self._lock:
            left = [self._prefetched.pop(consumer, None)]  # put twice without a claim between: the older rows go back
            if self._closed:  # closed meanwhile: these too
                left.append(taken)
            else:
                self._prefetched[consumer] = taken
        for t in left:
            if t is not None:
                self._drop_prefetched(consumer, t)

    def _prefetched_for(self, consumer: str, shape: tuple[tuple[str, ...], int, bool], layout: ShardLayout) -> _Prefetched | None:
        """The rows a put took for ``consumer``'s claim of ``shape`` in ``layout``'s iteration, if any: only in the
        iteration this client opened or waited for (another may have opened since); other rows go back."""
        with self._lock:
            taken = self._prefetched.pop(consumer, None)
        if taken is not None and (taken.shape != shape or taken.iteration != layout.iteration or layout.iteration != self._confirmed):
            self._drop_prefetched(consumer, taken)
            taken = None
        return taken

    def _drop_prefetched(self, consumer: str, taken: _Prefetched) -> None:
        """Hand rows a put took for a claim that will not use them back to their shard (best effort: else at lease expiry)."""
        self.heartbeat.drop(taken.lease)
        if len(taken.rows):
            self._release(taken.iteration, consumer, {taken.shard: taken.rows.tolist()}, taken.lease,
                          min(self.rpc_timeout_s, _RELEASE_TIMEOUT_S))

    def _forget_prefetched(self, iteration: int | None) -> None:
        """Forget what puts took in ``iteration`` (None: in every one): it was closed or replaced, its leases are gone."""
        with self._lock:
            gone = {c: t for c, t in self._prefetched.items() if iteration is None or t.iteration == iteration}
            for c in gone:
                del self._prefetched[c]
        self.heartbeat.drop(*(t.lease for t in gone.values()))

    def _put_schema(self, names: tuple[str, ...]) -> pa.Schema:
        """The schema of a put batch of ``names`` (checked columns): the int64 row column, then theirs (one
        object per column list: a stream of a schema seen before costs less)."""
        schema = self._put_schemas.get(names)
        if schema is None:
            schema = self._put_schemas[names] = pa.schema(
                [pa.field(ROW, pa.int64()), *(pa.field(n, self.schema.column(n).type) for n in names)])
        return schema

    def _put_objects(
        self, warehouse: Warehouse, layout: ShardLayout, rows: np.ndarray, arrays: dict[str, pa.Array], extra: dict[str, Any],
    ) -> None:
        """A put through the warehouse: every object first, then one ``commit`` per owning shard (with ``extra``)."""
        parts = layout.split(rows)
        keys = {(s, name): new_key(layout.iteration, name, int(rows[pos].min())) for s, pos in parts.items() for name in arrays}
        objects = [(keys[s, name], name, _part(array, pos)) for s, pos in parts.items() for name, array in arrays.items()]
        nbytes = write_arrays(warehouse, objects)  # all or none
        with self._lock:
            self.store["dock/store_bytes_written"] += nbytes
            self.store["dock/store_objects_written"] += len(objects)
        committed: list[int] = []
        unknown = None
        try:
            for s, pos in parts.items():
                refs = {name: {"key": keys[s, name], "offsets": list(range(len(pos)))} for name in arrays}
                try:
                    self._action(s, "commit", {"iteration": layout.iteration, "rows": rows[pos].tolist(), "objects": refs} | extra)
                except DockError:
                    raise  # refused: the shard recorded nothing of this part
                except BaseException:
                    unknown = s  # the commit may have landed: keep its objects (close_iteration deletes them)
                    raise
                committed.append(s)
        finally:  # objects of the parts no shard recorded are referenced by nobody
            delete_quietly(warehouse, [keys[s, name] for s in parts if s not in committed and s != unknown for name in arrays])

    def _gather(self, layout: ShardLayout, columns: list[str], parts: dict[int, list[int]]) -> list[pa.Table]:
        """The cells of ``parts`` (shard → rows), one table per shard in memory mode, one in all with a warehouse."""
        parts = {s: rows for s, rows in parts.items() if rows}
        if self.warehouse is None:
            return [self._read(layout, s, columns, rows) for s, rows in parts.items()]
        located = [
            self._action(s, "locate", {"iteration": layout.iteration, "columns": columns, "rows": rows}) for s, rows in parts.items()
        ]
        merged = {name: Located.concat([Located.from_json(loc[name]) for loc in located]) for name in columns}
        batch, objects, nbytes = read_cells(self.warehouse, self.schema, columns, merged)
        with self._lock:
            self.store["dock/store_bytes_read"] += nbytes
            self.store["dock/store_objects_read"] += objects
        return [pa.Table.from_batches([batch])]

    def _read(self, layout: ShardLayout, s: int, columns: list[str], rows: list[int]) -> pa.Table:
        return self.transports[s].get({"iteration": layout.iteration, "columns": columns, "rows": rows}, self.rpc_timeout_s)

    def _arrow_schema(self, columns: list[str], what: str) -> pa.Schema:
        key = tuple(columns)
        schema = self._arrow_schemas.get(key)
        if schema is None:
            try:
                schema = self._arrow_schemas[key] = self.schema.arrow_schema(columns)
            except KeyError as e:
                raise DockError(f"{what}: {e.args[0]}") from None
        return schema

    def _batch(self, tables: Sequence[pa.Table | pa.RecordBatch], columns: list[str], order: np.ndarray | None = None) -> pa.RecordBatch:
        """One record batch of ``tables`` stacked, rows reordered so that row ``order[k]`` comes k-th.

        Copies nothing when the cells already come in order in one chunk per column (a claim
        from one shard in one call, the usual case)."""
        schema = self._arrow_schema(columns, "get")
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
        layout = self._layout_for("get", iteration)
        if not len(rows_arr):  # no shard is asked: check the columns here
            return pa.RecordBatch.from_pylist([], schema=self._arrow_schema(columns, "get"))
        parts = layout.split(rows_arr)
        tables = self._gather(layout, columns, {s: rows_arr[pos].tolist() for s, pos in parts.items()})
        return self._batch(tables, columns, np.concatenate([np.zeros(0, np.int64), *parts.values()]))

    # --- claims -------------------------------------------------------------------------------
    def claim(
        self, consumer: str, columns: Sequence[str], count: int, *, whole_groups: bool = False, timeout_s: float | None = None
    ) -> Claim:
        """Take up to ``count`` rows over all shards, as ``ShardController.take`` does on one.

        Returns rows in ascending order with their cells; an empty claim once ``consumer``
        has taken every row of the iteration.

        Raises:
            DockError: unknown column or consumer, bad count, no open iteration.
            DockTimeoutError: not enough rows became ready in time; names the columns still
                missing on each shard. Nothing is consumed.
        """
        columns = list(columns)
        what = f"claim by {consumer!r}"
        timeout = self.timeout_s if timeout_s is None else timeout_s
        deadline = time.monotonic() + timeout
        layout = self._layout_for(what)
        shape = (tuple(columns), int(count), bool(whole_groups)) if self.prefetch else None
        taken = self._prefetched_for(consumer, shape, layout) if shape is not None and self._prefetched else None
        try:
            claim = self._claim(layout, consumer, columns, count, whole_groups, timeout, deadline, taken, shape)
        except DockError as e:
            open_now = [] if isinstance(e, DockTimeoutError) or layout.iteration == self._confirmed else \
                [m["iteration"] for m in self._describe_all(0)]
            # closed (maybe still closing), still open, or the one this client opened or waited for: never another's rows
            if not open_now or layout.iteration in open_now:
                raise
            # the iteration this client knew was closed and another opened: claim from that one
            claim = self._claim(self._layout_for(what, fresh=True), consumer, columns, count, whole_groups, timeout, deadline,
                                None, shape)
        return claim  # held (renewed) since its first rows were taken

    def _claim(
        self, layout: ShardLayout, consumer: str, columns: list[str], count: int, whole_groups: bool,
        timeout: float, deadline: float, prefetched: _Prefetched | None = None,
        shape: tuple[tuple[str, ...], int, bool] | None = None,
    ) -> Claim:
        unit = layout.group_size if whole_groups else 1
        active = layout.active
        with self._lock:
            first, self._next = self._next % len(active), self._next + 1
        order = active[first:] + active[:first]
        local = self.local_shard if self.local_shard in active else None
        if local is not None:  # the co-located shard first: the others are swept (stolen from) only for what it lacks
            order.remove(local)
            order.insert(0, local)
        lease = os.urandom(16).hex() if prefetched is None else prefetched.lease  # as uuid4().hex, without building a UUID
        names = tuple(columns)
        taken: dict[int, list[np.ndarray]] = {}  # rows of each take (global, ascending), by shard
        pending: dict[int, int] = {}
        held: dict[int, int] = {}  # rows of the consumer other owners lease, by shard: they may come back
        cells: dict[int, list[pa.Table | pa.RecordBatch]] = {}  # memory payload: the cells each take brought along, by shard
        got = 0  # rows taken so far
        if prefetched is not None:  # the first take, done by the put that acked the previous claim
            p = prefetched.shard
            taken[p], pending[p], held[p], cells[p] = [prefetched.rows], prefetched.pending, prefetched.held, [prefetched.cells]
            got = len(prefetched.rows)

        def take(s: int, limit: int, at_least: int, wait_s: float = 0.0, wait_held: bool = False) -> None:
            nonlocal got
            finite = math.isfinite(wait_s)
            req = ClaimRequest(layout.iteration, consumer, names, int(limit), at_least, whole_groups, wait_s if finite else None,
                               self.owner, lease, self.lease_s, wait_held)
            rpc = wait_s + self.rpc_timeout_s if finite else None
            if self.warehouse is None:  # claim and read in one call
                rows, pending[s], held[s], table = self.transports[s].claim_cells(req, rpc)
                cells.setdefault(s, []).append(table)
            else:
                res = self._action(s, "claim", req.to_json(), timeout=rpc)
                rows, pending[s], held[s] = np.asarray(res["rows"], dtype=np.int64), res["pending"], res.get("held", 0)
            taken.setdefault(s, []).append(rows)
            if len(rows):  # renewed from now on: the claim may still wait on other shards for longer than a term
                got += len(rows)
                self._hold(lease, layout.iteration)

        try:
            if local is not None:  # the co-located shard alone while it has rows left for the consumer, ready or not
                if local not in pending:  # (a put to it may have taken the first rows: then it was asked)
                    take(local, count - got, at_least=0)
                try:
                    while got < count and pending[local] > 0:
                        take(local, count - got, min(pending[local], count - got), max(deadline - time.monotonic(), 0.0))
                except DockTimeoutError:
                    pass  # the sweep below looks at every other shard once more, then raises the claim's timeout
            for i, s in enumerate(order):  # sweep: take what is ready now (the first shard checks the request)
                if s in pending:  # asked already: the local shard, or the one a put asked
                    continue
                if (i == 0 and not pending) or got < count:
                    take(s, count - got, at_least=0)
            want = min(count, got + sum(pending.values()))
            # block while short of rows the consumer still has pending, or, with nothing to take at all,
            # while other owners hold rows (an empty claim means the consumer is done)
            while got < want or (got == 0 and sum(held.values()) > 0):
                if got < want:
                    left = [s for s in order if pending.get(s, 0) > 0]
                    # the local shard while it has rows left for the consumer, else the first of the most loaded shards
                    s = local if local in left else max(left, key=lambda t: pending[t])
                    others = sum(pending[t] for t in left if t != s)
                    at_least, wait_held = max(unit, min(pending[s], want - got - others)), False
                else:
                    left = [s for s in order if held.get(s, 0) > 0]
                    s = max(left, key=lambda t: held[t])
                    at_least, wait_held = unit, True
                try:
                    take(s, count - got, at_least, max(deadline - time.monotonic(), 0.0), wait_held)
                except DockTimeoutError:
                    for t in order:  # a last look at the other shards before giving up
                        if t != s and got < count:
                            take(t, count - got, at_least=0)
                    if got < want or got == 0:
                        raise self._timeout(layout, consumer, columns, timeout, want, got, pending, held) from None
                    break
                for t in order:  # rows held elsewhere may have come back too (leases of one claim expire together)
                    if t != s and got < count and (pending.get(t, 0) > 0 or held.get(t, 0) > 0):
                        take(t, count - got, at_least=0)
                want = min(count, got + sum(pending.values()))  # other clients of this consumer may take rows too
            # shards hold ascending ranges, and one take's rows come ascending: rows come out ascending
            shards = [s for s in sorted(taken) if any(len(r) for r in taken[s])]
            parts = [taken[s][0] if len(taken[s]) == 1 else np.sort(np.concatenate(taken[s])) for s in shards]
            if self.warehouse is None:
                batches = [self._batch(cells[s], columns, None if len(cells[s]) == 1 else np.concatenate(taken[s])) for s in shards]
                batch = batches[0] if len(batches) == 1 else self._batch([pa.Table.from_batches([b]) for b in batches], columns)
            else:
                batch = self._batch(self._gather(layout, columns, {s: r.tolist() for s, r in zip(shards, parts)}), columns)
        except BaseException:
            self._release(layout.iteration, consumer, {s: np.concatenate(r).tolist() for s, r in taken.items()}, lease)
            self.heartbeat.drop(lease)
            raise
        row_array = parts[0] if len(parts) == 1 else np.concatenate([np.zeros(0, dtype=np.int64), *parts])
        claimed = row_array.tolist()
        # with ``shape``, the put that acks the claim carries the next claim of that shape
        return Claim(layout.iteration, claimed, batch, lease if claimed else "", consumer, row_array, shape if claimed else None)

    def _timeout(
        self, layout: ShardLayout, consumer: str, columns: list[str], timeout: float, want: int, ready: int,
        pending: dict[int, int], held: dict[int, int],
    ) -> DockTimeoutError:
        """The timeout error of a claim, with the columns each shard still lacks for ``consumer``."""
        missing = {}
        for s in sorted(t for t, n in pending.items() if n):
            lacking = self._action(s, "missing", {"iteration": layout.iteration, "consumer": consumer, "columns": columns})
            if lacking:
                missing[f"shard {s} at {self.locations[s]}"] = lacking
        held_note = (
            f"; {sum(held.values())} rows are leased by other owners and not yet acked (they come back if their "
            "leases expire or are released)" if sum(held.values()) else ""
        )
        return DockTimeoutError(
            f"claim by {consumer!r} timed out after {timeout:.1f}s in iteration {layout.iteration}: "
            f"wanted {want} rows ready in {columns}, {ready} ready; columns still missing (rows lacking) by shard: "
            f"{missing}{held_note}"
        )

    def _release(
        self, iteration: int, consumer: str, taken: dict[int, list[int]], lease: str, timeout: float | None = None,
    ) -> None:
        """Hand the rows of ``taken`` (shard → rows) that are still held under ``lease`` back to their shards (best effort)."""
        for s, rows in taken.items():
            if rows:
                try:
                    self._action(s, "release", {"iteration": iteration, "consumer": consumer, "rows": rows, "lease": lease}, timeout)
                except Exception as e:  # noqa: BLE001 - best effort: the claim's own error is what the caller needs
                    logger.warning("could not release %d rows of %r on dock shard %d: %s", len(rows), consumer, s, e)

    def drop(self, rows: Sequence[int], *, iteration: int | None = None) -> None:
        """Take ``rows`` out of the iteration for every consumer that has not taken them, on the
        shards owning them (``ShardController.drop``).

        Raises:
            DockError: row out of range or repeated, no open iteration, or another one open.
        """
        rows_arr = np.asarray(rows, dtype=np.int64)
        layout = self._layout_for("drop", iteration)
        for s, pos in layout.split(rows_arr).items():
            if len(pos):
                self._action(s, "drop", {"iteration": layout.iteration, "rows": rows_arr[pos].tolist()})

    # --- leases -------------------------------------------------------------------------------
    def ack(self, claim: Claim) -> None:
        """The claim's consumer is done with its rows (call after its put): ends the lease on
        the shards owning them (``ShardController.ack_rows`` semantics; an empty claim is a no-op).

        Raises:
            DockError: the claim's iteration is no longer open, or rows of the lease ended before
                the ack and were re-delivered (every shard is acked first; the message names the
                rows of each shard that refused).
        """
        if not claim.rows:
            return
        what = f"ack by {claim.consumer!r}"
        try:
            layout = self._layout_for(what, claim.iteration)
            rows = np.asarray(claim.rows, dtype=np.int64)
            errors = []
            for s, pos in layout.split(rows).items():
                body = {"iteration": claim.iteration, "consumer": claim.consumer, "lease": claim.lease,
                        "rows": rows[pos].tolist()}
                try:
                    self._action(s, "ack", body)
                except DockError as e:
                    errors.append(f"shard {s}: {e}" if len(self.locations) > 1 else str(e))
            if errors:
                raise DockError("; ".join(errors))
        finally:
            self.heartbeat.drop(claim.lease)

    def renew(self, owner: str | None = None) -> int:
        """Push every lease of ``owner`` (default this client's) a full term ahead on every shard.

        Returns the number of leases renewed, over all shards.
        """
        return sum(self._renew(owner or self.owner)[0])

    def _renew(self, owner: str) -> tuple[list[int], int | None]:
        results = [self._action(s, "renew", {"owner": owner}) for s in range(len(self.locations))]
        return [r["leases"] for r in results], results[0]["iteration"]

    def release_owner(self, owner: str) -> int:
        """End every lease of ``owner`` on every shard now (its process died): un-finished rows
        return to the ready pool at once instead of at expiry.

        Returns the number of rows returned, over all shards.
        """
        return sum(self._action(s, "release_owner", {"owner": owner})["rows"] for s in range(len(self.locations)))

    def _hold(self, lease: str, iteration: int) -> None:
        """Renew an un-acked lease from the heartbeat (``dockrl.dock.heartbeat``) until it is acked or handed back."""
        if not self._closed:
            self.heartbeat.hold(lease, iteration)

    # --- snapshots ----------------------------------------------------------------------------
    def snapshot(self, uri: str) -> None:
        """Snapshot every shard to ``<uri>/<id>/shard-<s>``, then ``<uri>/meta.json`` last.

        Raises:
            DockError: the shards disagree on the layout, or a shard's filesystem refused a write.
        """
        layouts = self._fetch_layouts()
        layout, more = (layouts[0], layouts[1:]) if layouts else (None, [])
        sid = new_id()
        shards = [f"{sid}/shard-{s:05d}" for s in range(len(self.locations))]
        for s, name in enumerate(shards):
            self._action(s, "snapshot", {"uri": join_uri(uri, name)})
        keys = object_keys(uri, shards, "snapshot")
        if keys:  # payload in a warehouse: copy the objects, which die with their iteration, into the snapshot
            assert self.warehouse is not None  # shards refer to objects only with payload "store"
            for key in keys:
                write_blob(uri, f"{sid}/{OBJECTS_DIR}/{key}", self.warehouse.read(key))
        meta = {"kind": CLIENT_SNAPSHOT_KIND, "schema_version": self.schema.version, "num_shards": len(self.locations),
                "mode": self.mode, "payload": self._payload, "layout": None if layout is None else layout.shard_meta(0),
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
        self._forget_prefetched(None)  # the shards hold no iteration: what puts took is gone with it
        meta = read_meta(uri)
        what = f"restore from {uri!r}"
        check_client_snapshot(meta, what, schema_version=self.schema.version, num_shards=len(self.locations), mode=self.mode,
                              payload=self._payload)
        first = meta["layout"]
        layout = None
        if first is not None:
            layout = ShardLayout(first["iteration"], first["num_rows"], first["group_size"], len(self.locations))
        more = [ShardLayout(m["iteration"], m["num_rows"], m["group_size"], len(self.locations)) for m in meta.get("more", [])]
        for s in range(len(self.locations)):
            open_now = self._describe(s)
            if open_now is not None:
                raise DockError(
                    f"{what}: iteration {open_now['iteration']} is open on dock shard {s} at {self.locations[s]}; close it first"
                )
        keys = meta.get("objects", [])
        for key in keys:
            # the snapshot's copies of the objects, back into this run's warehouse
            assert self.warehouse is not None  # a snapshot with objects has payload "store", as this dock (checked above)
            self.warehouse.write(key, read_blob(uri, f"{meta['id']}/{OBJECTS_DIR}/{key}", what))
        for s, name in enumerate(meta["shards"]):
            self._action(s, "restore", {"uri": join_uri(uri, name), "layout": None if layout is None else layout.shard_meta(s)}
                         | ({"more": [m.shard_meta(s) for m in more]} if more else {}))
        with self._lock:
            self._layout = layout
            self._known = {x.iteration: x for x in ([layout] if layout else []) + more}

    def stats(self) -> dict[str, float]:
        """Counters summed over shards: ``dock/bytes_put``, ``dock/bytes_read`` (payload bytes
        through the shards), ``dock/wait_s``, ``dock/controller_bytes`` (action bodies and
        results), and ``dock/shards``; with a warehouse also this client's traffic to the store:
        ``dock/store_bytes_written``, ``dock/store_bytes_read`` (Arrow IPC bytes),
        ``dock/store_objects_written``, ``dock/store_objects_read``."""
        total: dict[str, float] = {}
        for s in range(len(self.locations)):
            for key, value in self._action(s, "stats", {}).items():
                total[key] = total.get(key, 0) + value
        with self._lock:
            store = dict(self.store) if self.warehouse is not None else {}
        return total | store | {"dock/shards": len(self.locations)}

    @property
    def _payload(self) -> str:
        """Where the shards hold the cells: ``memory`` or ``store`` (a warehouse)."""
        return "memory" if self.warehouse is None else "store"

    # --- control channel (shard 0) -------------------------------------------------------------
    def _wait_action(self, name: str, body: dict[str, Any], timeout_s: float | None) -> Any:
        """A blocking control action on shard 0: the server waits ``timeout_s``, the call a little longer."""
        timeout = self.timeout_s if timeout_s is None else float(timeout_s)
        finite = math.isfinite(timeout)
        body = body | {"timeout_s": timeout if finite else None}
        return self._action(0, name, body, timeout=timeout + self.rpc_timeout_s if finite else None)

    def wait_iteration(self, after: int, timeout_s: float | None = None) -> int | None:
        """Block until an iteration newer than ``after`` is open and return it; ``None`` after ``finish()``.

        Raises:
            DockTimeoutError: nothing happened within ``timeout_s`` (default: the client's).
            DockError: the shard is shutting down.
        """
        res = self._wait_action("wait_iteration", {"after": int(after)}, timeout_s)
        meta = res.get("layout")
        if meta is not None and meta.get("num_shards") == len(self.locations) and meta["iteration"] == res["iteration"]:
            layout = ShardLayout(meta["iteration"], meta["num_rows"], meta["group_size"], len(self.locations))
            if layout.shard_meta(0) == meta:  # the row mapping comes with the iteration: no describe per shard
                with self._lock:
                    self._layout, self._confirmed = layout, layout.iteration
                    self._known = {k: v for k, v in self._known.items() if k > layout.iteration - 64} | {layout.iteration: layout}
        return res["iteration"]

    def report(self, iteration: int, stage: str, metrics: Mapping[str, float]) -> None:
        """Record ``stage``'s metrics of ``iteration`` on shard 0 (``RunControl.report``).

        Raises:
            DockError: bad metrics, or the stage already reported this iteration.
        """
        self._action(0, "report", {"iteration": iteration, "stage": stage, "metrics": check_metrics(metrics, "report")})

    def wait_reports(self, iteration: int, stages: Sequence[str], timeout_s: float | None = None) -> dict[str, dict[str, float]]:
        """Block until each of ``stages`` reported ``iteration``; return ``{stage: metrics}``.

        Raises:
            DockTimeoutError: stages missing at the timeout (default: the client's); names them.
        """
        return self._wait_action("wait_reports", {"iteration": int(iteration), "stages": list(stages)}, timeout_s)

    def finish(self) -> None:
        """No further iteration will open: idle ``wait_iteration`` calls return ``None``."""
        self._action(0, "finish", {})

    def close(self) -> None:
        """Hand back rows puts took for claims not made yet, stop renewing leases and close the transports:
        connections to Flight shards (which keep running), in-process shards this dock owns (``open_dock``)."""
        with self._lock:  # closed first: a put in flight in another thread hands its rows back itself (_put_claim)
            self._closed = True
            prefetched, self._prefetched = self._prefetched, {}
        for consumer, taken in prefetched.items():
            self._drop_prefetched(consumer, taken)
        self.heartbeat.close(self.rpc_timeout_s)
        for t in self.transports:
            t.close()

    def __enter__(self) -> DockClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def open_dock(cfg: DockConfig, schema: Schema, *, run: str, owner: str | None = None) -> Dock:
    """The in-process dock of run ``run`` (``dock.mode=inprocess``): the stages of this process share it.

    The same sharded front end as in distributed mode (``dockrl.dock.client.DockClient``) over
    ``dock.shards`` shards of this process reached by direct calls (``LocalTransport``): the
    settings mean the same in both modes and a snapshot taken in one restores in the other.
    ``close()`` closes the shards.

    Args:
        cfg: the run's ``dock`` config: ``shards`` shards in this process, the payload in their
            memory or in ``warehouse``, ``timeout_s``, ``lease_s`` and ``prefetch`` as in distributed mode.
        schema: the column schema.
        run: the run's name (the warehouse's per-run prefix).
        owner: lease owner id of the claims made through it; default unique per call.

    Raises:
        ValueError: as ``make_warehouse`` for a bad ``dock.warehouse`` setting.
    """
    warehouse = make_warehouse(cfg, run)
    payload: Payload = "memory" if warehouse is None else "store"
    shards = local_shards(cfg.shards, schema, timeout_s=cfg.timeout_s, lease_s=cfg.lease_s, payload=payload)
    # one front end serves every stage of the process: its sweeps start at shard 0, so a run repeats exactly
    return DockClient([LocalTransport(s, owned=True) for s in shards], schema, timeout_s=cfg.timeout_s,
                      warehouse=warehouse, lease_s=cfg.lease_s, owner=owner, first_shard=0, prefetch=cfg.prefetch)
