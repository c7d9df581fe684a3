"""One dock shard as a service, whatever carries its calls (docs/design.md §2).

A shard owns a contiguous range of whole prompt groups of each iteration (``shard_ranges``;
``dockrl.dock.client.core`` documents the mapping) and holds, for those rows, the controller state
and (``payload="memory"``) the cells: it wraps one ``ShardController`` per open iteration, whose
rows keep their global indexes. Several iterations may be open at once (``dock.max_inflight``:
the rollout of the next overlaps the update of this one); every request names its iteration.
``ShardService`` is the shard's whole behaviour as plain calls on Python values (the row mapping
is in ``dockrl.dock.shard.layout``, the request records in ``dockrl.dock.shard.requests``, the open
iterations' controllers in ``dockrl.dock.shard.iterations``); a transport carries them
(``ShardTransport``, ``dockrl.dock.shard.transport``):

* ``LocalTransport`` — calls the service of a shard in this process directly (``dock.mode=
  inprocess``): no sockets, no serialization, the request and result objects are passed as is.
* ``FlightTransport`` (``dockrl.dock.flight.transport``) — the same calls over Arrow Flight to a
  ``DockShardServer`` in another process (``dock.mode=distributed``), which wraps a service.

Requests (``action(name, body)``; every body and result is JSON-compatible):

* controller path, metadata only: ``open_iteration`` {iteration, num_rows, group_size,
  first_row, stop_row, shard, num_shards, max_open?} (checked against the row mapping ``ShardLayout``;
  refused while ``max_open``, default 1, iterations are open), ``close_iteration`` {iteration?, keep?}
  (null or absent: every open one; ``keep``, a ``dockrl.dock.shard.kept_rollouts.KeepSpec`` body: this shard writes its rows of
  it as Parquet in the background), ``flush_rollouts`` {timeout_s?} → the ``rollouts/*`` counters once every kept
  iteration is written, ``describe`` {} → {schema_version, columns, layout (the newest
  open iteration's), layouts (every open one's, oldest first), payload, wire_version},
  ``claim`` {iteration, consumer, columns, count, at_least, whole_groups, timeout_s, owner,
  lease, lease_s, wait_held} → {rows, pending, held} (blocks on the dock's condition variable;
  rows are leased to ``owner`` under ``lease``), ``release`` {iteration, consumer, rows},
  ``drop`` {iteration, rows} (``ShardController.drop``),
  ``missing`` {iteration, consumer, columns} → {column: rows lacking}, ``stats`` {} → counters.
* leases (``dockrl.dock.shard.leases``): ``ack`` {iteration, consumer, lease, rows},
  ``renew`` {owner} → {leases, iteration (the oldest open)}, ``release_owner`` {owner} → {rows}.
* snapshots: ``snapshot`` {uri} writes this shard's state and layout to ``uri`` (the oldest open
  iteration; each further one to ``<uri>/open-<k>``, named in the stored ``more``);
  ``restore`` {uri, layout, more?} loads it into a shard with no open iteration, checking that the
  snapshot was taken on the shard with that ``layout`` (its ``shard_meta``, or null) and ``more``.
* control channel (``dockrl.dock.control``; front ends use shard 0's): ``announce_iteration``
  {iteration}, ``wait_iteration`` {after, timeout_s} → {iteration (null once finished), layout (shard 0's
  ``shard_meta`` of that iteration while it is open, else null)},
  ``report`` {iteration, stage, metrics}, ``wait_reports`` {iteration, stages, timeout_s} →
  {stage: metrics}, ``finish`` {}; ``timeout_s`` null waits without limit.
* warehouse payload (``payload="store"`` only): ``commit`` {iteration, rows, objects:
  {column: {key, offsets}}, ack?} and ``locate`` {iteration, columns, rows} → {column: Located}.
* the driver's lease (``dockrl.process.lifeline``): ``driver_beat`` {}, ``driver_quiet`` {} → {quiet_s}.

Payload (``payload="memory"`` only): ``put(body, table)`` with body {iteration, ack?} and a
table of an int64 ``row`` column (global row indexes) plus data columns; ``get`` {iteration,
columns, rows} → the cells in the order of ``rows``; ``claim_cells`` (a ``claim`` body) → the
claim's result and the cells of its rows, in one call.
"""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Callable
from typing import Any

import numpy as np
import pyarrow as pa

from dockrl.dock.control import RunControl
from dockrl.dock.errors import DockError
from dockrl.dock.schema import Schema
from dockrl.dock.shard.controller import ShardController
from dockrl.dock.shard.iterations import ShardIterations
from dockrl.dock.shard.kept_rollouts import KeepSpec, RolloutWriter
from dockrl.dock.shard.requests import ROW, WIRE_VERSION, ClaimRequest, Payload, ack_of

logger = logging.getLogger(__name__)

CANCEL_CHECK_S = 0.05
"""A claim's take that ran longer than this (seconds: it blocked) checks whether its caller gave up."""


def _timeout(value: float | None) -> float:
    """A wait's ``timeout_s`` from a request body: null means no limit."""
    return math.inf if value is None else float(value)


class ShardService:
    """One dock shard: controller state (and in-memory payload) for the rows it owns.

    Args:
        schema: the column schema shared by every shard and front end.
        name: where the shard is, for messages (``grpc://host:port``, ``local://shard-0``).
        timeout_s: default claim and control-wait timeout, seconds.
        payload: ``memory`` (cells here) or ``store`` (cells in a warehouse; keys here).
        lease_s: default lease term of a claim, seconds (front ends send their own).

    Thread-safe. ``close()`` wakes blocked claims and control waits (they fail with
    ``DockError``); later calls fail too.
    """

    def __init__(self, schema: Schema, *, name: str, timeout_s: float = 600.0, payload: Payload = "memory",
                 lease_s: float = 300.0) -> None:
        if payload not in ("memory", "store"):
            raise ValueError(f"dock shard payload: got {payload!r}; expected 'memory' or 'store'")
        self.schema, self.name, self.payload = schema, name, payload
        self.timeout_s, self.lease_s = timeout_s, lease_s
        self.control = RunControl(timeout_s=timeout_s)  # the run's control channel (used on shard 0)
        self.iterations = ShardIterations(schema, name=name, timeout_s=timeout_s, lease_s=lease_s, control=self.control)
        self.rollouts = RolloutWriter(schema, name)  # kept rollouts (run.keep_rollouts) of the iterations it closes
        self.controller_bytes = 0
        """Request and result bytes of the controller path (counted by a transport that serializes)."""
        self._driver_seen = time.monotonic()  # the driver's lease runs from the shard's start
        d, its = self._at, self.iterations
        self.actions: dict[str, Callable[[dict[str, Any]], Any]] = {
            "open_iteration": its.open,
            "close_iteration": self._close_iteration,
            "flush_rollouts": lambda req: self._flush_rollouts(req.get("timeout_s")),
            "describe": lambda req: self._describe(),
            "claim": self.claim,
            "release": lambda req: d(req).release(req["consumer"], req["rows"], iteration=req["iteration"], lease=req.get("lease")),
            "drop": lambda req: d(req).drop(req["rows"], iteration=req["iteration"]),
            "missing": lambda req: d(req).missing(req["consumer"], req["columns"], iteration=req["iteration"]),
            "stats": lambda req: self.stats(),
            "commit": self._commit,
            "locate": self._locate,
            "ack": lambda req: d(req).ack_rows(req["consumer"], req["lease"], req["rows"], iteration=req["iteration"]),
            # the layouts are read without the lock: a snapshot in progress holds it, and beats must not wait
            "renew": lambda req: {"leases": sum(c.renew(req["owner"]) for c in list(its.docks.values())),
                                  "iteration": min(its.layouts, default=None)},
            "release_owner": lambda req: {"rows": sum(c.release_owner(req["owner"]) for c in list(its.docks.values()))},
            "snapshot": lambda req: its.snapshot(req["uri"]),
            "restore": lambda req: its.restore(req["uri"], req["layout"], req.get("more") or []),
            "announce_iteration": lambda req: its.announce(req["iteration"]),
            "wait_iteration": lambda req: self._wait_iteration(req["after"], _timeout(req["timeout_s"])),
            "report": lambda req: self.control.report(req["iteration"], req["stage"], req["metrics"]),
            "wait_reports": lambda req: self.control.wait_reports(req["iteration"], req["stages"], _timeout(req["timeout_s"])),
            "finish": lambda req: self.control.finish(),
            # no lock: a snapshot must not delay a beat
            "driver_beat": lambda req: self._driver_beat(),
            "driver_quiet": lambda req: {"quiet_s": self.driver_quiet_s()},
        }

    def action(self, name: str, body: dict[str, Any]) -> Any:
        """Run request ``name`` (see the module docstring).

        Raises:
            DockError: an unknown request, or as the request's own call.
        """
        handler = self.actions.get(name)
        if handler is None:
            raise DockError(f"dock shard: unknown action {name!r}; known: {sorted(self.actions)}")
        return handler(body)

    @property
    def dock(self) -> ShardController:
        """The controller of the open iteration (of the newest when several are open; a never
        opened one, which refuses every call, when none is)."""
        return self.iterations.newest()

    def _at(self, req: dict[str, Any]) -> ShardController:
        """The controller of the request's iteration (``req["iteration"]``; null: the only open one).

        Raises:
            DockError: that iteration is not open on this shard while others are (with one or
                none open, that controller refuses it with its own message).
        """
        return self._at_iteration(req.get("iteration"))

    def _at_iteration(self, iteration: int | None) -> ShardController:
        """``_at`` of a request naming ``iteration`` (``ShardIterations.at``)."""
        return self.iterations.at(iteration)

    def stats(self) -> dict[str, float]:
        """The controllers' counters (``ShardController.stats``) over every iteration so far, and ``dock/controller_bytes``."""
        return self.iterations.stats() | {"dock/controller_bytes": self.controller_bytes} | self.rollouts.stats()

    def close(self) -> None:
        """Fail blocked claims and waits, and every later one; write the kept rollouts still queued. Idempotent."""
        self.iterations.close_all()
        self.rollouts.close()

    def _close_iteration(self, req: dict[str, Any]) -> None:
        """The ``close_iteration`` request; with ``keep`` (a ``KeepSpec`` body) this shard's rows of the closed
        iterations go to its background writer (``dockrl.dock.shard.kept_rollouts``), which may make the close wait while it
        is ``QUEUE`` iterations behind."""
        closed = self.iterations.close(req.get("iteration"))
        keep = req.get("keep")
        if keep is None:
            return
        spec = KeepSpec.of(keep)
        for shard, table in closed:  # outside the iterations' lock: a wait for the writer blocks no other request
            self.rollouts.submit(table, shard, spec)

    def _flush_rollouts(self, timeout_s: float | None) -> dict[str, float]:
        """The ``flush_rollouts`` request: wait until the kept iterations are written; their counters."""
        if not self.rollouts.flush(None if timeout_s is None else float(timeout_s)):
            raise DockError(f"flush_rollouts: dock shard at {self.name} still writes kept rollouts after {timeout_s}s")
        return self.rollouts.stats()

    def _driver_beat(self) -> None:
        self._driver_seen = time.monotonic()

    def driver_quiet_s(self) -> float:
        """Seconds since the driver last renewed its lease (``driver_beat``), or since this shard started."""
        return time.monotonic() - self._driver_seen

    # --- controller path ----------------------------------------------------------------------
    def _wait_iteration(self, after: int, timeout_s: float) -> dict[str, Any]:
        """``RunControl.wait_iteration``, answered with this shard's layout of that iteration while it is open
        (a front end learns the row mapping with the iteration, without a ``describe`` per shard)."""
        iteration = self.control.wait_iteration(after, timeout_s)
        layout = None if iteration is None else self.iterations.layouts.get(iteration)  # read without the lock, as renew does
        return {"iteration": iteration, "layout": None if layout is None else dict(layout)}

    def _describe(self) -> dict[str, Any]:
        layouts = self.iterations.described()
        return {"schema_version": self.schema.version, "columns": [c.name for c in self.schema.columns],
                "layout": layouts[-1] if layouts else None, "layouts": layouts, "payload": self.payload,
                "wire_version": WIRE_VERSION}

    def _require(self, payload: str, what: str) -> None:
        if self.payload != payload:
            held = "holds metadata only (payload='store')" if self.payload == "store" else "keeps payload in memory (payload='memory')"
            fix = "a dock with a warehouse" if self.payload == "store" else "a dock without a warehouse"
            raise DockError(f"{what}: dock shard at {self.name} {held}; use {fix} (dock.warehouse)")

    def _commit(self, req: dict[str, Any]) -> None:
        self._require("store", "commit")
        objects = {name: (ref["key"], ref["offsets"]) for name, ref in req["objects"].items()}
        self._at(req).commit(req["rows"], objects, iteration=req["iteration"])
        if "ack" in req:  # commit and ack in one call (put(..., ack=claim))
            self._at(req).ack_rows(req["ack"]["consumer"], req["ack"]["lease"], req["rows"], iteration=req["iteration"])

    def _locate(self, req: dict[str, Any]) -> dict[str, Any]:
        self._require("store", "locate")
        located = self._at(req).locate(req["columns"], req["rows"], iteration=req["iteration"])
        return {name: loc.to_json() for name, loc in located.items()}

    def claim(self, req: dict[str, Any], cancelled: Callable[[], bool] = lambda: False) -> dict[str, Any]:
        """The ``claim`` action: take rows for a claim (``take``) → {rows, pending, held}."""
        rows, pending, held, _ = self.take(ClaimRequest.from_json(req), cancelled, read=False)
        return {"rows": rows.tolist(), "pending": pending, "held": held}

    def take(
        self, req: ClaimRequest, cancelled: Callable[[], bool] = lambda: False, read: bool = False,
    ) -> tuple[np.ndarray, int, int, pa.RecordBatch | None]:
        """Take rows for a claim (``ShardController.take``): (rows taken, global int64 ascending;
        the consumer's rows pending after it; rows other owners hold; with ``read`` the cells).

        Rows taken for a caller that gave up (``cancelled()`` true once a take that blocked
        returns) are handed back.

        Raises:
            DockError: as ``ShardController.take``.
        """
        start = time.monotonic()
        controller = self._at_iteration(req.iteration)
        rows, pending, held, _, batch = controller.take_rows(
            req.consumer, req.columns, req.limit, whole_groups=req.whole_groups, at_least=req.at_least,
            timeout_s=_timeout(req.timeout_s), iteration=req.iteration, owner=req.owner, lease=req.lease,
            lease_s=req.lease_s, wait_held=req.wait_held, read=read,
        )
        # only a take that blocked can outlive its caller (whose deadline is the wait plus an RPC's
        # slack); asking the transport costs more than a take that did not block
        if len(rows) and time.monotonic() - start > CANCEL_CHECK_S and cancelled():
            logger.warning("claim by %r cancelled by the client; releasing %d rows", req.consumer, len(rows))
            controller.release(req.consumer, rows, iteration=req.iteration)
            rows, pending, batch = rows[:0], pending + len(rows), None if batch is None else batch.slice(0, 0)
        return rows, pending, held, batch

    # --- payload path -------------------------------------------------------------------------
    def put(self, req: dict[str, Any], table: pa.Table | pa.RecordBatch) -> None:
        """Write the cells of ``table`` (an int64 ``row`` column plus data columns), then ack with
        ``req["ack"]`` ({consumer, lease}, if there): ``write`` of ``req["iteration"]``.

        Raises:
            DockError: as ``write``.
        """
        self.write(req["iteration"], table, ack_of(req))

    def write(
        self, iteration: int, table: pa.Table | pa.RecordBatch, ack: tuple[str, str] | None = None, *, from_ipc: bool = False,
    ) -> None:
        """Write the cells of ``table`` (an int64 ``row`` column plus data columns) in ``iteration``,
        then ack them under ``ack=(consumer, lease)`` (put and ack in one call: ``put(..., ack=claim)``).
        ``from_ipc``: ``table`` was read from an Arrow IPC stream (its arrays own exactly their buffers).

        Raises:
            DockError: a store-payload shard, no ``row`` column, or as ``ShardController.put``/``ack_rows``.
        """
        self._require("memory", "put")
        names = table.schema.names
        if ROW not in names:
            raise DockError(f"put: the batch has no {ROW!r} column (int64 global row indexes); got {names}")
        if isinstance(table, pa.Table):
            batches = table.to_batches()
            if len(batches) == 1:  # one batch (a client's put): its arrays as they are
                table = batches[0]
        row = table.column(ROW)
        rows = row.to_numpy() if isinstance(row, pa.Array) else row.combine_chunks().to_numpy()
        columns = {name: table.column(name) for name in names if name != ROW}
        self._at_iteration(iteration).put(rows, columns, iteration=iteration, ack=ack, own_buffers=from_ipc)

    def get(self, req: dict[str, Any]) -> pa.RecordBatch:
        """The cells of ``req["rows"]`` (``ShardController.get``) of a memory-payload shard."""
        self._require("memory", "get")
        return self._at(req).get(req["columns"], req["rows"], iteration=req["iteration"])

    def claim_cells(
        self, req: ClaimRequest, cancelled: Callable[[], bool] = lambda: False,
    ) -> tuple[np.ndarray, int, int, pa.RecordBatch]:
        """``take`` and the cells of its rows in one call, under one lock (memory payload):
        (rows, pending, held, the cells of ``req.columns`` in the order of the rows).

        Raises:
            DockError: a store-payload shard, or as ``ShardController.take``.
        """
        self._require("memory", "get")
        rows, pending, held, batch = self.take(req, cancelled, read=True)
        assert batch is not None
        return rows, pending, held, batch

    def put_claim(
        self, iteration: int, table: pa.Table | pa.RecordBatch, ack: tuple[str, str] | None, req: ClaimRequest, *,
        from_ipc: bool = False,
    ) -> tuple[np.ndarray, int, int, pa.RecordBatch] | DockError:
        """``write`` then ``claim_cells`` in one call: a put (usually with the ack of a claim) that
        carries the next claim, so that a stage's claim cycle costs one round trip.

        ``req`` must not block (``at_least`` 0). The put either fails (nothing written, nothing
        taken: its ``DockError`` is raised) or lands; once it landed a claim that fails is answered
        by its ``DockError`` as the result instead of raised, so that the caller knows the put landed.

        Raises:
            DockError: as ``write``; ``req`` asks to wait, or is for another iteration than the put.
        """
        if req.at_least or req.wait_held or req.iteration != iteration:
            raise DockError(f"put: the claim a put carries takes what is ready now in the put's iteration {iteration}; got "
                            f"at_least={req.at_least}, wait_held={req.wait_held}, iteration {req.iteration}")
        self.write(iteration, table, ack, from_ipc=from_ipc)
        try:
            return self.claim_cells(req)
        except Exception as e:  # noqa: BLE001 - the put landed: the caller must hear that, whatever the claim met
            return e if isinstance(e, DockError) else DockError(f"{type(e).__name__}: {e}")
