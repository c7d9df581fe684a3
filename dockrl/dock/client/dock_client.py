"""The transfer dock's one front end: the ``Dock`` API over S shards, in either ``dock.mode``.

``DockClient`` talks to its shards through transports (``dockrl.dock.shard.transport.ShardTransport``):
``FlightTransport`` to ``DockShardServer`` processes (``dock.mode=distributed``; a
``grpc://host:port`` location builds one) or ``LocalTransport`` to ``ShardService`` objects of
this process (``dock.mode=inprocess``; ``open_dock`` builds ``dock.shards`` of them with the
configured ``dock.warehouse``). Everything below and in the parts' modules holds for both: the
shards check every request (the front end only routes rows), and a snapshot taken in one mode
restores in the other.

``DockClient`` is composed of small parts over one state object, ``ClientCore`` (``core.py``: the
transports, the row layouts of the open iterations, the lock, leases); each part is given that
object and the parts it builds on: ``Cells`` (``cells.py``: put batches, warehouse objects, reads),
``Puts`` (``puts.py``: puts, and the claims that ride on them), ``Claims`` (``claims.py``: claims,
drops), ``Snapshots`` (``snapshots.py``: snapshots, counters). ``DockClient``'s row calls hand on to
them; this module holds the iteration lifecycle, the control channel and ``open_dock``.

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
"""

from __future__ import annotations

import logging
import math
from typing import TYPE_CHECKING, Any, Mapping, Sequence

import pyarrow as pa

from dockrl.dock.api import Claim, Columns, Dock
from dockrl.dock.client.cells import Cells
from dockrl.dock.client.claims import Claims
from dockrl.dock.client.core import ClientCore
from dockrl.dock.client.puts import Puts
from dockrl.dock.client.snapshots import Snapshots
from dockrl.dock.control import check_metrics
from dockrl.dock.schema import Schema
from dockrl.dock.shard.kept_rollouts import KeepSpec
from dockrl.dock.shard.layout import ShardLayout
from dockrl.dock.shard.requests import Payload
from dockrl.dock.shard.transport import LocalTransport, ShardTransport, local_shards
from dockrl.dock.tls import DockTLS
from dockrl.dock.warehouse.base import Warehouse, WarehouseError, delete_iteration
from dockrl.dock.warehouse.stores import make_warehouse

if TYPE_CHECKING:
    from dockrl.config import DockConfig

logger = logging.getLogger(__name__)


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
            "Claims ride on puts" in ``dockrl.dock.client.puts``; memory payload only); False: every claim is its own round trip.
        tls: the run's mutual TLS, client end (``dockrl.dock.tls``), for ``grpc+tls://`` shards; None: plain connections.

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
        tls: DockTLS | None = None,
    ) -> None:
        # one state object; each part is given it (and the parts it builds on), none holds state of the others
        self.core = core = ClientCore(shards, schema, token=token, timeout_s=timeout_s, rpc_timeout_s=rpc_timeout_s,
                                      warehouse=warehouse, lease_s=lease_s, owner=owner, first_shard=first_shard,
                                      local_shard=local_shard, max_inflight=max_inflight, prefetch=prefetch, tls=tls)
        self.cells = Cells(core)
        self.puts = Puts(core, self.cells)
        self.claims = Claims(core, self.cells, self.puts)
        self.snapshots = Snapshots(core, self.puts)
        # the settings, read-only after construction
        self.transports, self.locations, self.schema, self.owner = core.transports, core.locations, core.schema, core.owner
        self.timeout_s, self.rpc_timeout_s, self.lease_s = core.timeout_s, core.rpc_timeout_s, core.lease_s
        self.warehouse, self.max_inflight, self.prefetch, self.local_shard = core.warehouse, core.max_inflight, core.prefetch, core.local_shard
        self.heartbeat, self.store = core.heartbeat, core.store

    @property
    def mode(self) -> str:
        """The ``dock.mode`` of the shards: ``inprocess`` or ``distributed``."""
        return self.core.mode

    @property
    def controller_bytes(self) -> int:
        """Bytes of requests and results this front end exchanged with its shards (0 in-process: nothing is serialized)."""
        return self.core.controller_bytes

    @property
    def num_rows(self) -> int:
        """Rows of the open iteration (``ClientCore.num_rows``); ``DockError`` if none is open."""
        return self.core.num_rows

    @property
    def group_size(self) -> int:
        """Rows per prompt group of the open iteration; ``DockError`` if none is open."""
        return self.core.group_size

    # --- rows: each call is one part's (their docstrings say how) -------------------------------
    def claim(
        self, consumer: str, columns: Sequence[str], count: int, *, whole_groups: bool = False, timeout_s: float | None = None
    ) -> Claim:
        """Take up to ``count`` rows over all shards (``Claims.claim``)."""
        return self.claims.claim(consumer, columns, count, whole_groups=whole_groups, timeout_s=timeout_s)

    def put(self, rows: Sequence[int], columns: Columns, *, iteration: int | None = None, ack: Claim | None = None) -> None:
        """Write cells, each shard the rows it owns; with ``ack`` ack the claim with the put (``Puts.put``)."""
        self.puts.put(rows, columns, iteration=iteration, ack=ack)

    def get(self, columns: Sequence[str], rows: Sequence[int], *, iteration: int | None = None) -> pa.RecordBatch:
        """Read cells without consuming them, in the order of ``rows`` (``Cells.get``)."""
        return self.cells.get(columns, rows, iteration=iteration)

    def ack(self, claim: Claim) -> None:
        """The claim's consumer is done with its rows (``ClientCore.ack``)."""
        self.core.ack(claim)

    def drop(self, rows: Sequence[int], *, iteration: int | None = None) -> None:
        """Take ``rows`` out of the iteration for every consumer that has not taken them (``Claims.drop``)."""
        self.claims.drop(rows, iteration=iteration)

    def renew(self, owner: str | None = None) -> int:
        """Push every lease of ``owner`` (default this client's) a full term ahead; the leases renewed (``ClientCore.renew``)."""
        return self.core.renew(owner)

    def release_owner(self, owner: str) -> int:
        """End every lease of ``owner`` now; the rows returned (``ClientCore.release_owner``)."""
        return self.core.release_owner(owner)

    def snapshot(self, uri: str) -> None:
        """Snapshot every shard under ``uri`` (``Snapshots.snapshot``)."""
        self.snapshots.snapshot(uri)

    def restore(self, uri: str) -> None:
        """Load the snapshot at ``uri`` into the shards (``Snapshots.restore``)."""
        self.snapshots.restore(uri)

    def stats(self) -> dict[str, float]:
        """Counters summed over shards, with this client's store traffic (``Snapshots.stats``)."""
        return self.snapshots.stats()

    # --- iteration lifecycle ------------------------------------------------------------------
    def open_iteration(self, iteration: int, num_rows: int, group_size: int, *, announce: bool = True) -> None:
        """Open the iteration on every shard, each for its range of whole groups.

        Then announce it on the control channel, unless ``announce=False``: stages see it
        only after ``announce(iteration)`` (the driver fills and snapshots it first).

        Raises:
            DockError: an iteration is still open (nothing is left opened), or bad sizes.
        """
        layout = ShardLayout(int(iteration), int(num_rows), int(group_size), len(self.core.locations))
        limit = {"max_open": self.core.max_inflight} if self.core.max_inflight != 1 else {}
        shards = range(layout.num_shards)
        results = self.core.each(lambda s: self.core.action(s, "open_iteration", layout.shard_meta(s) | limit), shards)
        failed = [r for r in results if isinstance(r, Exception)]
        if failed:
            opened = [s for s, r in zip(shards, results) if not isinstance(r, Exception)]
            closed = self.core.each(lambda s: self.core.action(s, "close_iteration", {"iteration": layout.iteration}), opened)
            for s, r in zip(opened, closed):  # leave no shard half-opened
                if isinstance(r, Exception):  # the open's own error is what the caller needs
                    logger.warning("could not close half-opened iteration %d on dock shard %d: %s", iteration, s, r)
            raise failed[0]
        with self.core.lock:
            self.core.layout, self.core.confirmed = layout, layout.iteration
            self.core.known[layout.iteration] = layout
        if announce:
            self.announce(layout.iteration)

    def announce(self, iteration: int) -> None:
        """Let the stages' ``wait_iteration`` return ``iteration``, which must be open on shard 0.

        Raises:
            DockError: another iteration, or none, is open on shard 0.
        """
        self.core.action(0, "announce_iteration", {"iteration": int(iteration)})  # control channel: now stages may start
        if self.core.confirmed != iteration:  # one restored from a snapshot: this client's calls go to it, as after open_iteration
            layout = self.core.layout_for("announce", int(iteration))
            with self.core.lock:
                self.core.layout, self.core.confirmed = layout, layout.iteration

    def close_iteration(self, iteration: int | None = None, *, keep: KeepSpec | None = None) -> None:
        """Drop ``iteration`` (default: every open one) on every shard; claims blocked on it fail with ``DockError``.

        With ``keep`` (``run.keep_rollouts``) each shard writes its rows of it under ``keep.uri`` in the background
        (``dockrl.dock.shard.kept_rollouts``; only the spec travels, no payload); ``flush_rollouts`` waits for those writes.
        With a warehouse, the iteration's objects are deleted afterwards (a store failure there
        is logged, not raised: the iteration is closed either way).
        """
        closing = ([m["iteration"] for m in self.core.describe_all(0)] if iteration is None else [int(iteration)]) \
            if self.core.warehouse is not None else []
        with self.core.lock:
            if iteration is None or (self.core.layout is not None and self.core.layout.iteration == iteration):
                self.core.layout = self.core.confirmed = None
            self.core.known = {} if iteration is None else {k: v for k, v in self.core.known.items() if k != iteration}
        self.puts.forget_prefetched(iteration)
        body: dict[str, Any] = ({} if iteration is None else {"iteration": int(iteration)}) | ({} if keep is None else {"keep": keep.body()})
        # a shard whose writer is QUEUE iterations behind answers once it has room: the rpc deadline covers the wait
        timeout = None if keep is None else self.core.timeout_s + self.core.rpc_timeout_s
        failed = [r for r in self.core.each(lambda s: self.core.action(s, "close_iteration", body, timeout=timeout),
                                            range(len(self.core.locations))) if isinstance(r, Exception)]
        if failed:  # every shard was asked: one that failed leaves the others closed
            raise failed[0]
        for it in closing:
            try:
                delete_iteration(self.core.warehouse, it)  # type: ignore[arg-type]  # closing is empty without a warehouse
            except WarehouseError as e:
                logger.warning("iteration %d closed, but its objects stay in %s: %s", it, self.core.warehouse.url, e)  # type: ignore[union-attr]

    def flush_rollouts(self, timeout_s: float | None = None) -> dict[str, float]:
        """Wait until every shard wrote the iterations it keeps (``close_iteration(keep=...)``); their
        ``rollouts/*`` counters summed over the shards (empty when none kept any).

        Raises:
            DockError: a shard still writes after ``timeout_s`` (default: the client's).
        """
        timeout = self.core.timeout_s if timeout_s is None else float(timeout_s)
        total: dict[str, float] = {}
        for s in range(len(self.core.locations)):
            for key, value in self.core.action(s, "flush_rollouts", {"timeout_s": timeout}, timeout=timeout + self.core.rpc_timeout_s).items():
                total[key] = total.get(key, 0) + value
        return total

    # --- control channel (shard 0) -------------------------------------------------------------
    def _wait_action(self, name: str, body: dict[str, Any], timeout_s: float | None) -> Any:
        """A blocking control action on shard 0: the server waits ``timeout_s``, the call a little longer."""
        timeout = self.core.timeout_s if timeout_s is None else float(timeout_s)
        finite = math.isfinite(timeout)
        body = body | {"timeout_s": timeout if finite else None}
        return self.core.action(0, name, body, timeout=timeout + self.core.rpc_timeout_s if finite else None)

    def wait_iteration(self, after: int, timeout_s: float | None = None) -> int | None:
        """Block until an iteration newer than ``after`` is open and return it; ``None`` after ``finish()``.

        Raises:
            DockTimeoutError: nothing happened within ``timeout_s`` (default: the client's).
            DockError: the shard is shutting down.
        """
        res = self._wait_action("wait_iteration", {"after": int(after)}, timeout_s)
        meta = res.get("layout")
        if meta is not None and meta.get("num_shards") == len(self.core.locations) and meta["iteration"] == res["iteration"]:
            layout = ShardLayout(meta["iteration"], meta["num_rows"], meta["group_size"], len(self.core.locations))
            if layout.shard_meta(0) == meta:  # the row mapping comes with the iteration: no describe per shard
                with self.core.lock:
                    self.core.layout, self.core.confirmed = layout, layout.iteration
                    self.core.known = {k: v for k, v in self.core.known.items() if k > layout.iteration - 64} | {layout.iteration: layout}
        return res["iteration"]

    def report(self, iteration: int, stage: str, metrics: Mapping[str, float]) -> None:
        """Record ``stage``'s metrics of ``iteration`` on shard 0 (``RunControl.report``).

        Raises:
            DockError: bad metrics, or the stage already reported this iteration.
        """
        self.core.action(0, "report", {"iteration": iteration, "stage": stage, "metrics": check_metrics(metrics, "report")})

    def wait_reports(self, iteration: int, stages: Sequence[str], timeout_s: float | None = None) -> dict[str, dict[str, float]]:
        """Block until each of ``stages`` reported ``iteration``; return ``{stage: metrics}``.

        Raises:
            DockTimeoutError: stages missing at the timeout (default: the client's); names them.
        """
        return self._wait_action("wait_reports", {"iteration": int(iteration), "stages": list(stages)}, timeout_s)

    def finish(self) -> None:
        """No further iteration will open: idle ``wait_iteration`` calls return ``None``."""
        self.core.action(0, "finish", {})

    def close(self) -> None:
        """Hand back rows puts took for claims not made yet, stop renewing leases and close the transports:
        connections to Flight shards (which keep running), in-process shards this dock owns (``open_dock``)."""
        with self.core.lock:  # closed first: a put in flight in another thread hands its rows back itself (_put_claim)
            self.core.closed = True
            prefetched, self.core.prefetched = self.core.prefetched, {}
        for consumer, taken in prefetched.items():
            self.puts.drop_prefetched(consumer, taken)
        self.core.heartbeat.close(self.core.rpc_timeout_s)
        if self.core.pool is not None:
            self.core.pool.shutdown(wait=True)
        for t in self.core.transports:
            t.close()

    def __enter__(self) -> DockClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def open_dock(cfg: DockConfig, schema: Schema, *, run: str, owner: str | None = None) -> Dock:
    """The in-process dock of run ``run`` (``dock.mode=inprocess``): the stages of this process share it.

    The same sharded front end as in distributed mode (``dockrl.dock.client.dock_client.DockClient``) over
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
