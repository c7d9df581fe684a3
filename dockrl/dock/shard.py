"""One dock shard as a service, whatever carries its calls (docs/design.md §2).

A shard owns a contiguous range of whole prompt groups of each iteration (``shard_ranges``;
``dockrl.dock.client`` documents the mapping) and holds, for those rows, the controller state
and (``payload="memory"``) the cells: it wraps one ``ShardController`` per open iteration, whose
rows keep their global indexes. Several iterations may be open at once (``dock.max_inflight``:
the rollout of the next overlaps the update of this one); every request names its iteration.
``ShardService`` is the shard's whole behaviour as plain calls on Python values; a transport
carries them (``ShardTransport``):

* ``LocalTransport`` — calls the service of a shard in this process directly (``dock.mode=
  inprocess``): no sockets, no serialization, the request and result objects are passed as is.
* ``FlightTransport`` (``dockrl.dock.flight``) — the same calls over Arrow Flight to a
  ``DockShardServer`` in another process (``dock.mode=distributed``), which wraps a service.

Requests (``action(name, body)``; every body and result is JSON-compatible):

* controller path, metadata only: ``open_iteration`` {iteration, num_rows, group_size,
  first_row, stop_row, shard, num_shards, max_open?} (checked against the row mapping ``ShardLayout``;
  refused while ``max_open``, default 1, iterations are open), ``close_iteration`` {iteration?}
  (null or absent: every open one), ``describe`` {} → {schema_version, columns, layout (the newest
  open iteration's), layouts (every open one's, oldest first), payload, wire_version},
  ``claim`` {iteration, consumer, columns, count, at_least, whole_groups, timeout_s, owner,
  lease, lease_s, wait_held} → {rows, pending, held} (blocks on the dock's condition variable;
  rows are leased to ``owner`` under ``lease``), ``release`` {iteration, consumer, rows},
  ``drop`` {iteration, rows} (``ShardController.drop``),
  ``missing`` {iteration, consumer, columns} → {column: rows lacking}, ``stats`` {} → counters.
* leases (``dockrl.dock.leases``): ``ack`` {iteration, consumer, lease, rows},
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
* the driver's lease (``dockrl.lifeline``): ``driver_beat`` {}, ``driver_quiet`` {} → {quiet_s}.

Payload (``payload="memory"`` only): ``put(body, table)`` with body {iteration, ack?} and a
table of an int64 ``row`` column (global row indexes) plus data columns; ``get`` {iteration,
columns, rows} → the cells in the order of ``rows``; ``claim_cells`` (a ``claim`` body) → the
claim's result and the cells of its rows, in one call.
"""

from __future__ import annotations

import functools
import logging
import math
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Literal, NamedTuple, Protocol

import numpy as np
import pyarrow as pa

from dockrl.dock.control import RunControl
from dockrl.dock.errors import DockError
from dockrl.dock.iteration import check_sizes, one_run
from dockrl.dock.schema import Schema
from dockrl.dock.shard_controller import DEFAULT_OWNER, ShardController
from dockrl.dock.snapshot import join_uri

logger = logging.getLogger(__name__)

ROW = "row"
"""Name of the int64 column of global row indexes in every put table."""
Payload = Literal["memory", "store"]
CANCEL_CHECK_S = 0.05
"""A claim's take that ran longer than this (seconds: it blocked) checks whether its caller gave up."""


def shard_ranges(num_rows: int, group_size: int, num_shards: int) -> list[tuple[int, int]]:
    """Global row range ``[start, stop)`` of each shard: contiguous runs of whole groups."""
    groups = num_rows // group_size
    return [(s * groups // num_shards * group_size, (s + 1) * groups // num_shards * group_size) for s in range(num_shards)]


@dataclass(frozen=True)
class ShardLayout:
    """Where the rows of one iteration live: shard ``s`` owns ``ranges[s]``.

    Raises:
        DockError: sizes that ``ShardController.open_iteration`` refuses.
    """

    iteration: int
    num_rows: int
    group_size: int
    num_shards: int

    def __post_init__(self) -> None:
        check_sizes(self.iteration, self.num_rows, self.group_size)

    @functools.cached_property  # a claim asks for it every time
    def ranges(self) -> list[tuple[int, int]]:
        return shard_ranges(self.num_rows, self.group_size, self.num_shards)

    @functools.cached_property
    def active(self) -> list[int]:
        """The shards that own rows of the iteration (with fewer groups than shards some own none)."""
        return [s for s, (start, stop) in enumerate(self.ranges) if stop > start]

    def shard_meta(self, s: int) -> dict[str, int]:
        """What shard ``s`` stores (and ``describe``s) for this iteration."""
        first, stop = self.ranges[s]
        return {"iteration": self.iteration, "num_rows": self.num_rows, "group_size": self.group_size,
                "first_row": first, "stop_row": stop, "shard": s, "num_shards": self.num_shards}

    def split(self, rows: np.ndarray) -> dict[int, np.ndarray]:
        """Positions in ``rows`` of the rows each shard owns (shards with none left out).

        A row out of range goes to the shard owning the nearest row, which refuses it: the
        shard's checks are the only ones.
        """
        if self.num_shards == 1:
            return {0: np.arange(len(rows))}
        stops = np.array([stop for _, stop in self.ranges])
        shard = np.searchsorted(stops, np.clip(rows, 0, self.num_rows - 1), side="right")
        return {int(s): np.flatnonzero(shard == s) for s in np.unique(shard)}


WIRE_VERSION = 3
"""Version of the binary claim ticket, claim result and put descriptor over Flight (1: the JSON forms before
them; 3: a put may carry the next claim, ``do_exchange``); ``describe`` answers it as ``wire_version`` (a shard of
version 1 leaves it out)."""


def row_runs(rows: np.ndarray) -> np.ndarray:
    """The ascending, distinct int64 ``rows`` as runs of consecutive rows: an int64 ``(k, 2)`` array of ``[start, stop)``."""
    n = len(rows)
    if not n:
        return np.zeros((0, 2), dtype=np.int64)
    run = one_run(rows)
    if run is not None:
        return np.array([run], dtype=np.int64)
    breaks = np.flatnonzero(np.diff(rows) != 1) + 1
    starts = np.concatenate(([0], breaks))
    stops = np.concatenate((breaks, [n]))
    return np.stack([rows[starts], rows[stops - 1] + 1], axis=1).astype(np.int64, copy=False)


def runs_rows(runs: np.ndarray) -> np.ndarray:
    """The rows of ``runs`` (``row_runs``), in order, as an int64 array."""
    if len(runs) == 1:
        return np.arange(runs[0, 0], runs[0, 1], dtype=np.int64)
    return np.concatenate([np.zeros(0, dtype=np.int64), *(np.arange(a, b, dtype=np.int64) for a, b in runs.tolist())])


class ClaimRequest(NamedTuple):
    """One take on one shard (the ``claim`` request's fields, ``ShardController.take``'s arguments).

    Built by the front end, carried as is in this process (``LocalTransport``), in the binary
    claim ticket over Flight (``dockrl.dock.flight.encode_claim``), or as the JSON body of the
    ``claim`` action (``to_json``/``from_json``).
    """

    iteration: int
    """The iteration the take is for (refused unless it is open on the shard)."""
    consumer: str
    """The consuming stage (one of the schema's consumers); its rows are marked consumed."""
    columns: tuple[str, ...]
    """Columns that must be written for a row to be ready, and that a claim with cells reads."""
    limit: int
    """Rows to take at most (the body's ``count``)."""
    at_least: int
    """Ready rows to wait for: the take blocks until ``min(at_least, rows pending)`` are ready; 0: take what is ready now."""
    whole_groups: bool
    """Take whole groups of ``group_size`` consecutive rows only (``limit`` then a multiple of it)."""
    timeout_s: float | None
    """Seconds the take may block; None: no limit."""
    owner: str
    """Who holds the lease (a worker's id): its heartbeat renews it, ``release_owner`` ends it."""
    lease: str | None
    """Lease id of the rows taken; None: a fresh one."""
    lease_s: float | None
    """Lease term, seconds; None: the shard's default."""
    wait_held: bool
    """With no row pending and ``at_least > 0``, block while other owners hold rows (leased, not acked: they come
    back if their leases end); False: answer at once."""

    @classmethod
    def from_json(cls, req: dict[str, Any]) -> ClaimRequest:
        """From a ``claim`` action body.

        Raises:
            KeyError, TypeError: a required field is missing or not a list of columns.
        """
        return cls(req["iteration"], req["consumer"], tuple(req["columns"]), req["count"], req["at_least"], req["whole_groups"],
                   req["timeout_s"], req.get("owner", DEFAULT_OWNER), req.get("lease"), req.get("lease_s"),
                   req.get("wait_held", True))

    def to_json(self) -> dict[str, Any]:
        """The ``claim`` action body."""
        body = self._asdict() | {"columns": list(self.columns), "count": self.limit}
        del body["limit"]
        return body


def ack_of(body: dict[str, Any]) -> tuple[str, str] | None:
    """The (consumer, lease) of a put body's ``ack`` ({consumer, lease}), or None without one."""
    ack = body.get("ack")
    return None if ack is None else (ack["consumer"], ack["lease"])


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
        self._lock = threading.Lock()
        self._idle = ShardController(schema, timeout_s=timeout_s, lease_s=lease_s)  # never opened: answers "no iteration is open"
        self._docks: dict[int, ShardController] = {}  # of the open iterations this shard owns rows of
        self._layouts: dict[int, dict[str, int]] = {}  # of every open iteration, oldest first
        self._closed_stats: dict[str, float] = {}  # counters of the controllers of closed iterations
        self._closed = False
        self.controller_bytes = 0
        """Request and result bytes of the controller path (counted by a transport that serializes)."""
        self._driver_seen = time.monotonic()  # the driver's lease runs from the shard's start
        d = self._at
        self.actions: dict[str, Callable[[dict[str, Any]], Any]] = {
            "open_iteration": self._open_iteration,
            "close_iteration": lambda req: self._close_iteration(req.get("iteration")),
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
            "renew": lambda req: {"leases": sum(c.renew(req["owner"]) for c in list(self._docks.values())),
                                  "iteration": min(self._layouts, default=None)},
            "release_owner": lambda req: {"rows": sum(c.release_owner(req["owner"]) for c in list(self._docks.values()))},
            "snapshot": lambda req: self._snapshot(req["uri"]),
            "restore": lambda req: self._restore(req["uri"], req["layout"], req.get("more") or []),
            "announce_iteration": lambda req: self._announce_iteration(req["iteration"]),
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
        docks = list(self._docks.values())
        return docks[-1] if docks else self._idle

    def _at(self, req: dict[str, Any]) -> ShardController:
        """The controller of the request's iteration (``req["iteration"]``; null: the only open one).

        Raises:
            DockError: that iteration is not open on this shard while others are (with one or
                none open, that controller refuses it with its own message).
        """
        return self._at_iteration(req.get("iteration"))

    def _at_iteration(self, iteration: int | None) -> ShardController:
        """``_at`` of a request naming ``iteration``."""
        docks = self._docks
        found = docks.get(iteration) if iteration is not None else None
        if found is not None:
            return found
        if len(docks) <= 1:
            return next(iter(docks.values()), self._idle)
        open_now = sorted(docks)
        if iteration is None:
            raise DockError(f"iterations {open_now} are open on dock shard {self.name}: name the iteration")
        raise DockError(f"iteration {iteration} is not open; the open iterations are {open_now}")

    def stats(self) -> dict[str, float]:
        """The controllers' counters (``ShardController.stats``) over every iteration so far, and ``dock/controller_bytes``."""
        total = dict(self._closed_stats)
        for controller in [*list(self._docks.values()), self._idle]:
            for key, value in controller.stats().items():
                total[key] = total.get(key, 0) + value
        return total | {"dock/controller_bytes": self.controller_bytes}

    def close(self) -> None:
        """Fail blocked claims and waits, and every later one. Idempotent."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
            docks, self._docks, self._layouts = list(self._docks.values()), {}, {}
        self.control.shutdown(f"dock shard at {self.name} is shutting down")
        for controller in docks:
            controller.close_iteration()

    def _driver_beat(self) -> None:
        self._driver_seen = time.monotonic()

    def driver_quiet_s(self) -> float:
        """Seconds since the driver last renewed its lease (``driver_beat``), or since this shard started."""
        return time.monotonic() - self._driver_seen

    # --- controller path ----------------------------------------------------------------------
    def _open_iteration(self, req: dict[str, Any]) -> None:
        req = dict(req)
        max_open = int(req.pop("max_open", 1))
        iteration, first, stop = req["iteration"], req["first_row"], req["stop_row"]
        with self._lock:
            if self._closed:
                raise DockError(f"open_iteration({iteration}): dock shard at {self.name} is shutting down")
            if iteration in self._layouts or len(self._layouts) >= max_open:
                open_now = list(self._layouts)
                raise DockError(
                    f"open_iteration({iteration}): iteration {open_now[0]} is still open" if len(open_now) == 1 else
                    f"open_iteration({iteration}): iterations {open_now} are still open (at most {max_open}: dock.max_inflight)"
                )
            if self._layouts and iteration < max(self._layouts):
                raise DockError(f"open_iteration({iteration}): iteration {max(self._layouts)} is open; iterations open in order")
            shard, num_shards = req["shard"], req["num_shards"]
            if not 0 <= shard < num_shards:
                raise DockError(f"open_iteration({iteration}): shard {shard} is not one of {num_shards} shards")
            expected = ShardLayout(iteration, req["num_rows"], req["group_size"], num_shards).shard_meta(shard)
            if req != expected:
                raise DockError(f"open_iteration({iteration}): shard layout {req} does not match the row mapping {expected}")
            if stop > first:  # a shard may own no group when there are fewer groups than shards
                controller = ShardController(self.schema, timeout_s=self.timeout_s, lease_s=self.lease_s)
                controller.open_iteration(iteration, stop - first, req["group_size"], first_row=first, total_rows=req["num_rows"])
                self._docks = {**self._docks, iteration: controller}  # replaced, not changed: read without the lock
            self._layouts = {**self._layouts, iteration: expected}

    def _close_iteration(self, iteration: int | None = None) -> None:
        with self._lock:
            closing = list(self._layouts) if iteration is None else [iteration] if iteration in self._layouts else []
            self._layouts = {k: v for k, v in self._layouts.items() if k not in closing}
            docks = [self._docks[k] for k in closing if k in self._docks]
            self._docks = {k: v for k, v in self._docks.items() if k not in closing}
            for controller in docks:
                controller.close_iteration()
                for key, value in controller.stats().items():
                    self._closed_stats[key] = self._closed_stats.get(key, 0) + value
            self.control.set_closed(iteration)

    def _wait_iteration(self, after: int, timeout_s: float) -> dict[str, Any]:
        """``RunControl.wait_iteration``, answered with this shard's layout of that iteration while it is open
        (a front end learns the row mapping with the iteration, without a ``describe`` per shard)."""
        iteration = self.control.wait_iteration(after, timeout_s)
        layout = None if iteration is None else self._layouts.get(iteration)  # read without the lock, as renew does
        return {"iteration": iteration, "layout": None if layout is None else dict(layout)}

    def _announce_iteration(self, iteration: int) -> None:
        with self._lock:
            if iteration not in self._layouts:
                open_now = list(self._layouts) or None
                raise DockError(f"announce({iteration}): iteration {open_now if open_now is None or len(open_now) > 1 else open_now[0]} "
                                f"is open on dock shard 0 at {self.name}")
            self.control.set_open(iteration)

    def _describe(self) -> dict[str, Any]:
        with self._lock:
            layouts = [dict(v) for v in self._layouts.values()]
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

    @staticmethod
    def _snapshots(uri: str, layout: dict[str, int] | None, more: list[dict[str, int]]) -> list[tuple[dict[str, int] | None, str, dict]]:
        """Where each open iteration's controller is stored, and the ``extra`` stored with it: the
        oldest (or none) at ``uri``, naming the others (``more``), each of them at ``<uri>/open-<k>``."""
        first = (layout, uri, {"layout": layout} | ({"more": more} if more else {}))
        return [first, *((m, join_uri(uri, f"open-{m['iteration']}"), {"layout": m}) for m in more)]

    def _snapshot(self, uri: str) -> None:
        with self._lock:  # no open/close while the layouts and the controllers are written together
            layouts = list(self._layouts.values())
            places = self._snapshots(uri, layouts[0] if layouts else None, layouts[1:])
            for layout, where, extra in reversed(places):  # the oldest's, naming the others, last
                controller = self._idle if layout is None else self._docks.get(layout["iteration"], self._idle)
                controller.snapshot(where, extra=extra)

    def _restore(self, uri: str, layout: dict[str, int] | None, more: list[dict[str, int]]) -> None:
        with self._lock:
            if self._closed:
                raise DockError(f"restore from {uri!r}: dock shard at {self.name} is shutting down")
            if self._layouts:
                raise DockError(f"restore from {uri!r}: iteration {next(iter(self._layouts))} is open on this shard; close it first")
            docks, layouts = {}, {}
            for lay, where, extra in self._snapshots(uri, layout, more):
                controller = ShardController(self.schema, timeout_s=self.timeout_s, lease_s=self.lease_s)
                controller.restore(where, extra=extra)
                if lay is not None:
                    layouts[lay["iteration"]] = lay
                    if lay["stop_row"] > lay["first_row"]:  # a shard that owns no group of it stores none
                        docks[lay["iteration"]] = controller
            self._docks, self._layouts = docks, layouts

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


class ShardTransport(Protocol):
    """How a front end reaches one shard's ``ShardService``: in this process or over Flight.

    ``timeout`` is the deadline of one call in seconds (None: none); an in-process transport
    needs none. Errors of the shard arrive as the same ``DockError``/``DockTimeoutError``.
    """

    location: str
    """Where the shard is, for messages: ``grpc://host:port`` or ``local://shard-<s>``."""
    mode: Literal["inprocess", "distributed"]
    """The ``dock.mode`` this transport serves."""

    def action(self, name: str, body: dict[str, Any], timeout: float | None) -> Any: ...

    def put(self, body: dict[str, Any], batch: pa.RecordBatch, timeout: float | None) -> None: ...

    def get(self, body: dict[str, Any], timeout: float | None) -> pa.Table: ...

    def claim_cells(self, req: ClaimRequest, timeout: float | None) -> tuple[np.ndarray, int, int, pa.RecordBatch]:
        """``ShardService.claim_cells`` on the shard: (rows, global int64 ascending; pending; held; the cells)."""

    def put_claim(
        self, body: dict[str, Any], batch: pa.RecordBatch, req: ClaimRequest, timeout: float | None,
    ) -> tuple[np.ndarray, int, int, pa.RecordBatch] | DockError:
        """``put`` with the body's ack, then ``claim_cells`` of ``req`` in one call (``ShardService.put_claim``)."""

    def close(self) -> None: ...


class LocalTransport:
    """Calls a ``ShardService`` of this process directly: no sockets, no serialization.

    Args:
        service: the shard.
        owned: ``close()`` closes the shard too (the dock that built it owns it).
    """

    mode: Literal["inprocess", "distributed"] = "inprocess"

    def __init__(self, service: ShardService, *, owned: bool = False) -> None:
        self.service, self.owned, self.location = service, owned, service.name

    def action(self, name: str, body: dict[str, Any], timeout: float | None) -> Any:
        return self.service.action(name, body)

    def put(self, body: dict[str, Any], batch: pa.RecordBatch, timeout: float | None) -> None:
        self.service.put(body, batch)

    def get(self, body: dict[str, Any], timeout: float | None) -> pa.Table:
        return pa.Table.from_batches([self.service.get(body)])

    def claim_cells(self, req: ClaimRequest, timeout: float | None) -> tuple[np.ndarray, int, int, pa.RecordBatch]:
        return self.service.claim_cells(req)

    def put_claim(
        self, body: dict[str, Any], batch: pa.RecordBatch, req: ClaimRequest, timeout: float | None,
    ) -> tuple[np.ndarray, int, int, pa.RecordBatch] | DockError:
        return self.service.put_claim(body["iteration"], batch, ack_of(body), req)

    def close(self) -> None:
        if self.owned:
            self.service.close()


def local_shards(n: int, schema: Schema, *, timeout_s: float = 600.0, lease_s: float = 300.0,
                 payload: Payload = "memory") -> list[ShardService]:
    """``n`` shards in this process, named ``local://shard-<s>``."""
    return [ShardService(schema, name=f"local://shard-{s}", timeout_s=timeout_s, lease_s=lease_s, payload=payload)
            for s in range(n)]
