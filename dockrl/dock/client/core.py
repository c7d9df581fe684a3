"""The state every part of ``DockClient`` (``dockrl.dock.client.dock_client``) is given: ``ClientCore``, the calls to its
shards, the row layout of the iterations open on them, and leases.

**Rows → shards.** An iteration of G prompt groups of n rows is split into contiguous runs
of whole groups: shard ``s`` owns groups ``[s·G//S, (s+1)·G//S)``, and global row ``r`` keeps
its index on the shard that owns it (so shard errors name global rows). With fewer groups
than shards some shards own none. Every client derives the mapping from ``(num_rows,
group_size, S)`` (``shard.layout.shard_ranges``); shards also check, store and ``describe`` it, so a
worker that did not open the iteration learns it, and shards given out of order are caught.
``wait_iteration`` brings shard 0's layout of the iteration it returns, so a stage learns the
mapping without a ``describe`` per shard and ``num_rows``/``group_size`` answer without a round trip.

**Leases.** Every client has a unique ``owner`` id (``host:pid:random`` unless given) and
claims under a fresh lease id per claim, on every shard it takes rows from, with its own
``lease_s`` term, renewed while it holds them (``dockrl.dock.client.heartbeat``). ``ack`` goes to the shards owning the
claim's rows. A claim with nothing to take while other owners hold rows of the consumer
blocks on the shard holding most of them (``wait_held``), for the same reason as
a take (``ShardController.take``); rows coming back on another shard are seen when that one answers.
"""

from __future__ import annotations

import logging
import math
import os
import random
import socket
import threading
import uuid
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Callable, NamedTuple, Sequence, TypeVar

import numpy as np
import pyarrow as pa

from dockrl.dock.api import Claim
from dockrl.dock.client.heartbeat import LeaseHeartbeat
from dockrl.dock.errors import DockError
from dockrl.dock.flight.transport import FlightTransport
from dockrl.dock.schema import Schema
from dockrl.dock.shard.layout import ShardLayout
from dockrl.dock.shard.transport import ShardTransport
from dockrl.dock.tls import DockTLS
from dockrl.dock.warehouse.base import Warehouse

logger = logging.getLogger(__name__)

FANOUT = 32
"""Most calls one client has in flight at once to different shards (``ClientCore.each``)."""
T = TypeVar("T")


def _result(call: Callable[[int], T], s: int) -> T | Exception:
    try:
        return call(s)
    except Exception as e:  # noqa: BLE001 - handed to the caller, which raises it
        return e


def _one(layouts: list[dict[str, int]]) -> list[dict[str, int]] | dict[str, int] | None:
    """Layouts for a message: none as None, one as itself, several as the list."""
    return None if not layouts else layouts[0] if len(layouts) == 1 else layouts


class Prefetched(NamedTuple):
    """Rows a put took for the consumer's next claim (``dockrl.dock.client.puts``: "Claims ride on puts")."""

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


class ClientCore:
    """``DockClient``'s state and its links to the shards: calls, layouts, leases. One object per client;
    its parts (``Cells``, ``Puts``, ``Claims``, ``Snapshots``) are each given it.

    ``__init__`` takes the arguments ``DockClient`` documents, and raises as it says.
    """

    def __init__(
        self, shards: Sequence[str | ShardTransport], schema: Schema, *, token: str | None = None, timeout_s: float = 600.0,
        rpc_timeout_s: float = 60.0, warehouse: Warehouse | None = None, lease_s: float = 300.0, owner: str | None = None,
        first_shard: int | None = None, local_shard: int | None = None, max_inflight: int = 1, prefetch: bool = True,
        tls: DockTLS | None = None,
    ) -> None:
        if not shards:
            raise ValueError("DockClient: shards is empty; expected at least one grpc://host:port or shard transport")
        if not 0 < lease_s < math.inf:
            raise ValueError(f"DockClient: lease_s={lease_s!r}; expected a finite number of seconds > 0")
        if local_shard is not None and not (isinstance(local_shard, int) and 0 <= local_shard < len(shards)):
            raise ValueError(f"DockClient: local_shard={local_shard!r}; expected a shard index in [0, {len(shards)}) or None")
        self.local_shard = local_shard
        self.transports: list[ShardTransport] = [FlightTransport(t, token=token, tls=tls) if isinstance(t, str) else t
                                                  for t in shards]
        self.locations, self.schema = [t.location for t in self.transports], schema
        self.timeout_s, self.rpc_timeout_s, self.lease_s = timeout_s, rpc_timeout_s, lease_s
        self.owner = owner or f"{socket.gethostname()}:{os.getpid()}:{uuid.uuid4().hex[:8]}"
        self.heartbeat = LeaseHeartbeat(self.owner, lease_s, len(self.transports), lambda s: self.action(s, "renew", {"owner": self.owner}))
        self.closed = False
        self.lock = threading.Lock()
        self.pool: ThreadPoolExecutor | None = None  # the calls to every shard at once (``each``), made at its first call
        self.layout: ShardLayout | None = None  # this client's current iteration (opened or waited for last), else the shards' newest
        self.confirmed: int | None = None  # the iteration of _layout when this client opened it or waited for it
        self.known: dict[int, ShardLayout] = {}  # layouts of open iterations seen, by iteration
        self.max_inflight = max_inflight
        self.arrow_schemas: dict[tuple[str, ...], pa.Schema] = {}  # of the column lists read so far
        self.put_schemas: dict[tuple[str, ...], pa.Schema] = {}  # of the put batches (row + columns) sent so far
        self.next_shard = random.randrange(len(self.transports)) if first_shard is None else int(first_shard)
        self.warehouse = warehouse
        self.prefetch = prefetch and warehouse is None
        self.prefetched: dict[str, Prefetched] = {}  # by consumer: what its last put took for its next claim
        self.store = {"dock/store_bytes_written": 0, "dock/store_bytes_read": 0,
                      "dock/store_objects_written": 0, "dock/store_objects_read": 0}

    # --- calls --------------------------------------------------------------------------------
    def action(self, shard: int, name: str, body: dict[str, Any], timeout: float | None = None) -> Any:
        return self.transports[shard].action(name, body, self.rpc_timeout_s if timeout is None else timeout)

    def each(self, call: Callable[[int], T], shards: Sequence[int]) -> list[T | Exception]:
        """``call(s)`` for every shard of ``shards`` at once (at most ``FANOUT`` calls in flight): the driver's calls to
        every shard (open, close, stats) wait one round trip, not one per shard. Returns each shard's result, or the
        exception its call raised, in the order of ``shards``."""
        if len(shards) <= 1:
            return [_result(call, s) for s in shards]
        with self.lock:
            if self.pool is None:
                self.pool = ThreadPoolExecutor(min(FANOUT, len(self.transports)), thread_name_prefix="dock-fanout")
            pool = self.pool
        return list(pool.map(lambda s: _result(call, s), shards))

    @property
    def controller_bytes(self) -> int:
        """Bytes of requests and results this front end exchanged with its shards (0 in-process: nothing is serialized)."""
        return sum(getattr(t, "controller_bytes", 0) for t in self.transports)

    @property
    def mode(self) -> str:
        """The ``dock.mode`` of the shards: ``inprocess`` or ``distributed``."""
        return self.transports[0].mode

    # --- layout -------------------------------------------------------------------------------
    def describe(self, shard: int) -> dict[str, int] | None:
        """Shard ``shard``'s layout of its newest open iteration (None: none is open)."""
        layouts = self.describe_all(shard)
        return layouts[-1] if layouts else None

    def describe_all(self, shard: int) -> list[dict[str, int]]:
        """Shard ``shard``'s layouts of its open iterations, oldest first."""
        desc = self.action(shard, "describe", {})
        names = [c.name for c in self.schema.columns]
        if desc["schema_version"] != self.schema.version or desc["columns"] != names:
            raise DockError(
                f"dock shard {shard} at {self.locations[shard]} serves schema v{desc['schema_version']} "
                f"{desc['columns']}; this client has v{self.schema.version} {names}"
            )
        payload = desc.get("payload", "memory")
        if payload != self.payload:
            mine = "has no warehouse" if self.warehouse is None else f"has the warehouse {self.warehouse.url}"
            raise DockError(
                f"dock shard {shard} at {self.locations[shard]} runs with payload={payload!r} but this client {mine}; "
                "shards started with payload='store' need a DockClient with warehouse=..., payload='memory' ones one without "
                "(dock.warehouse)"
            )
        return desc.get("layouts", [desc["layout"]] if desc["layout"] is not None else [])

    def fetch_layouts(self) -> list[ShardLayout]:
        """The layouts of the iterations open on the shards, oldest first (``_known`` is set to them)."""
        raw = [self.describe_all(s) for s in range(len(self.locations))]
        layouts = [ShardLayout(m["iteration"], m["num_rows"], m["group_size"], len(raw)) for m in raw[0]]
        for s, got in enumerate(raw):
            want = [layout.shard_meta(s) for layout in layouts]
            if got != want:
                raise DockError(
                    f"dock shards disagree: shard {s} at {self.locations[s]} has layout {_one(got)}, expected {_one(want)} "
                    "from shard 0; pass every shard, in the order the iteration was opened with, and do not open it concurrently"
                )
        with self.lock:
            self.known = {layout.iteration: layout for layout in layouts}
        return layouts

    def layout_for(self, what: str, iteration: int | None = None, *, fresh: bool = False) -> ShardLayout:
        """The layout of the open iteration: the one this client knows, or (``fresh``) the shards'.

        With ``iteration``: that iteration's, asking the shards when the known one is another.

        Raises:
            DockError: no iteration is open, or ``iteration`` is not the open one.
        """
        with self.lock:
            layout = None if fresh else self.layout if iteration is None else self.known.get(iteration)
        if layout is not None and (iteration is None or layout.iteration == iteration):
            return layout
        layouts = self.fetch_layouts()
        if not layouts:
            raise DockError(f"{what}: no iteration is open (call open_iteration first, or it was closed)")
        if iteration is None:
            with self.lock:
                self.layout = layouts[-1]
            return layouts[-1]
        found = [layout for layout in layouts if layout.iteration == iteration]
        if not found:
            open_now = f"the open iteration is {layouts[0].iteration}" if len(layouts) == 1 else \
                f"the open iterations are {[x.iteration for x in layouts]}"
            raise DockError(f"{what}: iteration {iteration} is not open; {open_now}")
        return found[0]

    def open_layout(self, what: str) -> ShardLayout:
        """The layout of the iteration open on the shards now (one ``describe`` when it is the known one)."""
        shard0, known = self.describe(0), self.layout
        return self.layout_for(what, fresh=shard0 is None or known is None or known.iteration != shard0["iteration"])

    def sizes(self, what: str) -> ShardLayout:
        """The layout this client opened or waited for (``wait_iteration``) last, else the shards' (a round trip)."""
        with self.lock:
            layout = self.layout
            if layout is not None and layout.iteration == self.confirmed:
                return layout
        return self.open_layout(what)

    @property
    def num_rows(self) -> int:
        """Rows of the open iteration, all shards together: the one this client opened or last
        got from ``wait_iteration`` (no round trip), else the one open on the shards; ``DockError`` if none is open."""
        return self.sizes("num_rows").num_rows

    @property
    def group_size(self) -> int:
        """Rows per prompt group of the open iteration (as ``num_rows``); ``DockError`` if none is open."""
        return self.sizes("group_size").group_size

    @property
    def payload(self) -> str:
        """Where the shards hold the cells: ``memory`` or ``store`` (a warehouse)."""
        return "memory" if self.warehouse is None else "store"

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
            layout = self.layout_for(what, claim.iteration)
            rows = np.asarray(claim.rows, dtype=np.int64)
            errors = []
            for s, pos in layout.split(rows).items():
                body = {"iteration": claim.iteration, "consumer": claim.consumer, "lease": claim.lease,
                        "rows": rows[pos].tolist()}
                try:
                    self.action(s, "ack", body)
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
        results = [self.action(s, "renew", {"owner": owner}) for s in range(len(self.locations))]
        return [r["leases"] for r in results], results[0]["iteration"]

    def release_owner(self, owner: str) -> int:
        """End every lease of ``owner`` on every shard now (its process died): un-finished rows
        return to the ready pool at once instead of at expiry.

        Returns the number of rows returned, over all shards.
        """
        return sum(self.action(s, "release_owner", {"owner": owner})["rows"] for s in range(len(self.locations)))

    def hold(self, lease: str, iteration: int) -> None:
        """Renew an un-acked lease from the heartbeat (``dockrl.dock.client.heartbeat``) until it is acked or handed back."""
        if not self.closed:
            self.heartbeat.hold(lease, iteration)

    def release(
        self, iteration: int, consumer: str, taken: dict[int, list[int]], lease: str, timeout: float | None = None,
    ) -> None:
        """Hand the rows of ``taken`` (shard → rows) that are still held under ``lease`` back to their shards (best effort)."""
        for s, rows in taken.items():
            if rows:
                try:
                    self.action(s, "release", {"iteration": iteration, "consumer": consumer, "rows": rows, "lease": lease}, timeout)
                except Exception as e:  # noqa: BLE001 - best effort: the claim's own error is what the caller needs
                    logger.warning("could not release %d rows of %r on dock shard %d: %s", len(rows), consumer, s, e)

