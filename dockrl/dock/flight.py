"""One shard of the networked transfer dock, served over Arrow Flight (docs/design.md §2).

A shard owns a contiguous range of whole prompt groups of each iteration (``shard_ranges``;
the client documents the mapping) and holds, for those rows, the controller state and the
payload: it wraps one in-process ``TransferDock`` whose rows keep their global indexes.

Protocol (every body and result is UTF-8 JSON):

* ``do_action`` — the controller path, metadata only:
  ``open_iteration`` {iteration, num_rows, group_size, first_row, stop_row, shard, num_shards}
  (checked against the row mapping ``ShardLayout``),
  ``close_iteration`` {}, ``describe`` {} → {schema_version, columns, layout},
  ``claim`` {iteration, consumer, columns, count, at_least, whole_groups, timeout_s, owner,
  lease, lease_s, wait_held} → {rows, pending, held} (blocks on the dock's condition variable,
  never a sleep-poll; returns row indexes only; the rows are leased to ``owner`` under
  ``lease``), ``release`` {iteration, consumer, rows}, ``missing`` {iteration, consumer,
  columns} → {column: rows lacking}, ``stats`` {} → counters.
* leases (``dockrl.dock.local``): ``ack`` {iteration, consumer, lease, rows},
  ``renew`` {owner} → {leases, iteration}, ``release_owner`` {owner} → {rows}.
* snapshots: ``snapshot`` {uri} writes this shard's state and layout to ``uri``;
  ``restore`` {uri, layout} loads it into a shard with no open iteration, checking that the
  snapshot was taken on the shard with that ``layout`` (its ``shard_meta``, or null).
* ``do_action`` — the control channel (``dockrl.dock.control``; clients use shard 0's):
  ``announce_iteration`` {iteration} (the client's ``open_iteration`` sends it once every
  shard is open: only then does ``wait_iteration`` hand the iteration out),
  ``wait_iteration`` {after, timeout_s} → {iteration} (null once finished),
  ``report`` {iteration, stage, metrics}, ``wait_reports`` {iteration, stages, timeout_s} →
  {stage: metrics}, ``finish`` {}. The waits block on a condition variable; ``timeout_s``
  null waits without limit.
* ``do_put`` — payload in: descriptor command {iteration}; one record batch with an int64
  ``row`` column (global row indexes) plus the data columns.
* ``do_get`` — payload out: ticket {iteration, columns, rows} → the cells as a record batch
  stream, in the order of ``rows``. A client claims rows with the action, then reads them here.

A shard started with ``payload="store"`` holds metadata only (``dockrl.dock.warehouse``): it
refuses ``do_put``/``do_get`` and serves two more actions instead, ``commit`` {iteration, rows,
objects: {column: {key, offsets}}} (the cells of ``rows`` now live in warehouse objects) and
``locate`` {iteration, columns, rows} → {column: {keys, index, offsets}} (``Located``). A
``memory`` shard refuses those two. ``describe`` names the mode (``payload``).

``DockError`` and ``DockTimeoutError`` raised in the shard travel as ``FlightServerError``
whose message starts with ``dockrl.<type>:`` and whose ``extra_info`` is JSON {type, message};
``raise_dock_error`` turns them back into the same exception on the client side.

Run one shard in its own process (prints its location as the first line of stdout)::

    DOCKRL_DOCK_TOKEN=secret python -m dockrl.dock.flight --host 127.0.0.1 --port 0 --token-env DOCKRL_DOCK_TOKEN
"""

from __future__ import annotations

import argparse
import hmac
import importlib
import ipaddress
import json
import logging
import math
import os
import signal
import sys
import threading
import time
from dataclasses import dataclass
from typing import Any, Callable, Iterator, Literal, NoReturn

import numpy as np
import pyarrow as pa
import pyarrow.flight as flight

from dockrl.dock.control import RunControl
from dockrl.dock.errors import DockError, DockTimeoutError
from dockrl.dock.local import DEFAULT_OWNER, TransferDock
from dockrl.dock.schema import Schema

logger = logging.getLogger(__name__)

ROW = "row"
"""Name of the int64 column of global row indexes in every ``do_put`` batch."""
CLAIM_META = b"dockrl.claim"
"""Schema metadata key of a claim-and-read ``do_get`` answer: JSON ``{rows, pending, held}``."""
_ERRORS: dict[str, type[DockError]] = {"DockError": DockError, "DockTimeoutError": DockTimeoutError}


def dock_error_to_flight(e: DockError) -> flight.FlightServerError:
    """The Flight error that carries ``e`` (type and message) to the client."""
    info = json.dumps({"type": type(e).__name__, "message": str(e)}).encode()
    return flight.FlightServerError(f"dockrl.{type(e).__name__}: {e}", extra_info=info)


def raise_dock_error(e: BaseException) -> None:
    """Re-raise a dock error carried by Flight error ``e`` as its own type; return if ``e`` is not one.

    Raises:
        DockError | DockTimeoutError: with the shard's message.
    """
    info = getattr(e, "extra_info", None)
    if not info:
        return
    try:
        payload = json.loads(info)
        cls = _ERRORS[payload["type"]]
        message = str(payload["message"])
    except (ValueError, KeyError, TypeError):
        return
    raise cls(message) from None


def shard_ranges(num_rows: int, group_size: int, num_shards: int) -> list[tuple[int, int]]:
    """Global row range ``[start, stop)`` of each shard: contiguous runs of whole groups."""
    groups = num_rows // group_size
    return [(s * groups // num_shards * group_size, (s + 1) * groups // num_shards * group_size) for s in range(num_shards)]


@dataclass(frozen=True)
class ShardLayout:
    """Where the rows of one iteration live: shard ``s`` owns ``ranges[s]``."""

    iteration: int
    num_rows: int
    group_size: int
    num_shards: int

    @property
    def ranges(self) -> list[tuple[int, int]]:
        return shard_ranges(self.num_rows, self.group_size, self.num_shards)

    def shard_meta(self, s: int) -> dict[str, int]:
        """What shard ``s`` stores (and ``describe``s) for this iteration."""
        first, stop = self.ranges[s]
        return {"iteration": self.iteration, "num_rows": self.num_rows, "group_size": self.group_size,
                "first_row": first, "stop_row": stop, "shard": s, "num_shards": self.num_shards}

    def split(self, rows: np.ndarray) -> dict[int, np.ndarray]:
        """Positions in ``rows`` of the rows each shard owns (shards with none left out)."""
        shard = np.searchsorted(np.array([stop for _, stop in self.ranges]), rows, side="right")
        return {int(s): np.flatnonzero(shard == s) for s in np.unique(shard)}


class BearerTokenMiddlewareFactory(flight.ServerMiddlewareFactory):
    """Rejects every call whose ``authorization`` header is not ``Bearer <token>``."""

    def __init__(self, token: str) -> None:
        self._expected = f"Bearer {token}".encode()

    def start_call(self, info: flight.CallInfo, headers: dict[str, list[str]]) -> None:
        values = headers.get("authorization", [])
        if len(values) != 1 or not hmac.compare_digest(str(values[0]).encode(), self._expected):
            raise flight.FlightUnauthenticatedError(
                "dock shard: missing or wrong 'authorization: Bearer <token>' header; pass the token the shard was "
                "started with: DOCKRL_DOCK_TOKEN in the environment of `dockrl worker` (the launcher sets it), "
                "or DockClient(token=...) in code"
            )
        return None


class DockShardServer(flight.FlightServerBase):
    """One dock shard: controller state and in-memory payload for the rows it owns.

    Args:
        schema: the column schema shared by every shard and client.
        location: where to listen; port 0 picks a free port (see ``location``).
        token: shared secret every call must present as ``authorization: Bearer <token>``;
            None accepts every call (single-machine runs).
        timeout_s: default claim timeout of the wrapped dock, seconds.
        payload: ``memory`` (cells in this process, Flight ``do_put``/``do_get``) or ``store``
            (cells in a warehouse that clients read and write; this shard keeps object keys).
        lease_s: default lease term of the wrapped dock, seconds (clients send their own).

    Serving starts in the constructor (gRPC threads); ``serve()`` only blocks. ``close()``
    wakes blocked claims (they fail with "no iteration is open") and shuts the server down.
    """

    def __init__(
        self, schema: Schema, location: str = "grpc://127.0.0.1:0", *, token: str | None = None, timeout_s: float = 600.0,
        payload: Literal["memory", "store"] = "memory",
        lease_s: float = 300.0,
    ) -> None:
        if payload not in ("memory", "store"):
            raise ValueError(f"DockShardServer payload: got {payload!r}; expected 'memory' or 'store'")
        self.payload = payload
        middleware = {"auth": BearerTokenMiddlewareFactory(token)} if token else {}
        super().__init__(location, middleware=middleware)
        self.schema = schema
        self.dock = TransferDock(schema, timeout_s=timeout_s, lease_s=lease_s)
        host = location.split("://", 1)[-1].rsplit(":", 1)[0]
        self._location = f"grpc://{host}:{self.port}"
        self._lock = threading.Lock()
        self._layout: dict[str, int] | None = None
        self.controller_bytes = 0
        self._closed = False
        # the run's control channel (used on shard 0): an iteration is announced once open on every shard
        self.control = RunControl(timeout_s=timeout_s)
        self._actions: dict[str, Callable[[flight.ServerCallContext, dict], Any]] = {
            "open_iteration": self._open_iteration,
            "close_iteration": lambda ctx, req: self._close_iteration(),
            "describe": lambda ctx, req: self._describe(),
            "claim": self._claim,
            "release": lambda ctx, req: self.dock.release(req["consumer"], req["rows"], iteration=req["iteration"]),
            "missing": lambda ctx, req: self.dock.missing(req["consumer"], req["columns"], iteration=req["iteration"]),
            "stats": lambda ctx, req: self.dock.stats() | {"dock/controller_bytes": self.controller_bytes},
            "commit": self._commit,
            "locate": self._locate,
            "ack": lambda ctx, req: self.dock.ack_rows(req["consumer"], req["lease"], req["rows"], iteration=req["iteration"]),
            # the layout is read without the server lock: a snapshot in progress holds it, and beats must not wait
            "renew": lambda ctx, req: {"leases": self.dock.renew(req["owner"]), "iteration": (self._layout or {}).get("iteration")},
            "release_owner": lambda ctx, req: {"rows": self.dock.release_owner(req["owner"])},
            "snapshot": lambda ctx, req: self._snapshot(req["uri"]),
            "restore": lambda ctx, req: self._restore(req["uri"], req["layout"]),
            # control channel
            "announce_iteration": lambda ctx, req: self._announce_iteration(req["iteration"]),
            "wait_iteration": lambda ctx, req: {"iteration": self.control.wait_iteration(req["after"], _timeout(req["timeout_s"]))},
            "report": lambda ctx, req: self.control.report(req["iteration"], req["stage"], req["metrics"]),
            "wait_reports": lambda ctx, req: self.control.wait_reports(req["iteration"], req["stages"], _timeout(req["timeout_s"])),
            "finish": lambda ctx, req: self.control.finish(),
            # the driver's lease (dockrl.launch.lifeline): no server lock, a snapshot must not delay a beat
            "driver_beat": lambda ctx, req: self._driver_beat(),
            "driver_quiet": lambda ctx, req: {"quiet_s": self.driver_quiet_s()},
        }
        self._driver_seen = time.monotonic()  # the lease runs from the shard's start
        if token:
            logger.info("dock shard listening at %s (bearer token required)", self._location)
        else:
            logger.warning("dock shard listening at %s WITHOUT authentication: any process that reaches it can read and "
                           "write the run's data; start it with a token (--token-env DOCKRL_DOCK_TOKEN)", self._location)

    def _driver_beat(self) -> None:
        self._driver_seen = time.monotonic()

    def driver_quiet_s(self) -> float:
        """Seconds since the driver last renewed its lease (``driver_beat``), or since this shard started."""
        return time.monotonic() - self._driver_seen

    @property
    def location(self) -> str:
        """``grpc://host:port`` a client connects to (the real port when started with port 0)."""
        return self._location

    def close(self) -> None:
        """Fail blocked claims, then shut the server down (waits for calls in flight). Idempotent."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
            self._layout = None
        self.control.shutdown(f"dock shard at {self._location} is shutting down")
        self.dock.close_iteration()
        self.shutdown()

    def __enter__(self) -> DockShardServer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # --- controller path ----------------------------------------------------------------------
    def list_actions(self, context: flight.ServerCallContext) -> list[tuple[str, str]]:
        return [(name, "see dockrl.dock.flight") for name in self._actions]

    def do_action(self, context: flight.ServerCallContext, action: flight.Action) -> Iterator[bytes]:
        body = action.body.to_pybytes()
        handler = self._actions.get(action.type)
        if handler is None:
            _fail(DockError(f"dock shard: unknown action {action.type!r}; known: {sorted(self._actions)}"))
        result = json.dumps(_guard(action.type, lambda: handler(context, json.loads(body or b"{}")))).encode()
        with self._lock:
            self.controller_bytes += len(body) + len(result)
        return iter([result])

    def _open_iteration(self, context: flight.ServerCallContext, req: dict) -> None:
        iteration, first, stop = req["iteration"], req["first_row"], req["stop_row"]
        with self._lock:
            if self._closed:
                raise DockError(f"open_iteration({iteration}): dock shard at {self._location} is shutting down")
            if self._layout is not None:
                raise DockError(f"open_iteration({iteration}): iteration {self._layout['iteration']} is still open")
            num_rows, group_size, shard, num_shards = req["num_rows"], req["group_size"], req["shard"], req["num_shards"]
            if group_size < 1 or num_rows < 1 or num_rows % group_size or not 0 <= shard < num_shards:
                raise DockError(f"open_iteration({iteration}): invalid shard layout {req}")
            expected = ShardLayout(iteration, num_rows, group_size, num_shards).shard_meta(shard)
            if req != expected:
                raise DockError(f"open_iteration({iteration}): shard layout {req} does not match the row mapping {expected}")
            if stop > first:  # a shard may own no group when there are fewer groups than shards
                self.dock.open_iteration(iteration, stop - first, req["group_size"], first_row=first)
            self._layout = expected

    def _close_iteration(self) -> None:
        with self._lock:
            self._layout = None
            self.dock.close_iteration()
            self.control.set_open(None)

    def _announce_iteration(self, iteration: int) -> None:
        with self._lock:
            open_now = None if self._layout is None else self._layout["iteration"]
            if open_now != iteration:
                raise DockError(f"announce_iteration({iteration}): iteration {open_now} is open on this shard")
            self.control.set_open(iteration)

    def _describe(self) -> dict[str, Any]:
        with self._lock:
            layout = self._layout
        return {"schema_version": self.schema.version, "columns": [c.name for c in self.schema.columns], "layout": layout,
                "payload": self.payload}

    def _require(self, payload: str, what: str) -> None:
        if self.payload != payload:
            held = "holds metadata only (payload='store')" if self.payload == "store" else "keeps payload in memory (payload='memory')"
            fix = "a DockClient with a warehouse" if self.payload == "store" else "a DockClient without a warehouse"
            raise DockError(f"{what}: dock shard at {self._location} {held}; use {fix}")

    def _commit(self, context: flight.ServerCallContext, req: dict) -> None:
        self._require("store", "commit")
        objects = {name: (ref["key"], ref["offsets"]) for name, ref in req["objects"].items()}
        self.dock.commit(req["rows"], objects, iteration=req["iteration"])
        if "ack" in req:  # commit and ack in one round trip (DockClient.put(..., ack=claim))
            self.dock.ack_rows(req["ack"]["consumer"], req["ack"]["lease"], req["rows"], iteration=req["iteration"])

    def _locate(self, context: flight.ServerCallContext, req: dict) -> dict[str, Any]:
        self._require("store", "locate")
        located = self.dock.locate(req["columns"], req["rows"], iteration=req["iteration"])
        return {name: loc.to_json() for name, loc in located.items()}

    def _claim(self, context: flight.ServerCallContext, req: dict) -> dict[str, Any]:
        timeout = math.inf if req["timeout_s"] is None else float(req["timeout_s"])
        rows, pending, held, _ = self.dock.take(
            req["consumer"], req["columns"], req["count"], whole_groups=req["whole_groups"],
            at_least=req["at_least"], timeout_s=timeout, iteration=req["iteration"],
            owner=req.get("owner", DEFAULT_OWNER), lease=req.get("lease"), lease_s=req.get("lease_s"),
            wait_held=req.get("wait_held", True),
        )
        if rows and context.is_cancelled():
            # the client gave up (deadline or disconnect): nobody will read these rows, hand them back
            logger.warning("claim by %r cancelled by the client; releasing %d rows", req["consumer"], len(rows))
            self.dock.release(req["consumer"], rows, iteration=req["iteration"])
            rows, pending = [], pending + len(rows)
        return {"rows": rows, "pending": pending, "held": held}

    def _snapshot(self, uri: str) -> None:
        with self._lock:  # no open/close while the layout and the dock are written together
            self.dock.snapshot(uri, extra={"layout": self._layout})

    def _restore(self, uri: str, layout: dict[str, int] | None) -> None:
        with self._lock:
            if self._closed:
                raise DockError(f"restore from {uri!r}: dock shard at {self._location} is shutting down")
            if self._layout is not None:
                raise DockError(
                    f"restore from {uri!r}: iteration {self._layout['iteration']} is open on this shard; close it first"
                )
            self.dock.restore(uri, extra={"layout": layout})
            self._layout = layout

    # --- payload path ---------------------------------------------------------------------------
    def do_put(
        self,
        context: flight.ServerCallContext,
        descriptor: flight.FlightDescriptor,
        reader: flight.MetadataRecordBatchReader,
        writer: flight.FlightMetadataWriter,
    ) -> None:
        def put() -> None:
            self._require("memory", "put")
            req = json.loads(descriptor.command)
            table = reader.read_all()
            if ROW not in table.schema.names:
                raise DockError(f"put: the batch has no {ROW!r} column (int64 global row indexes); got {table.schema.names}")
            rows = table.column(ROW).to_numpy()
            columns = {name: table.column(name) for name in table.schema.names if name != ROW}
            self.dock.put(rows, columns, iteration=req["iteration"])
            if "ack" in req:  # put and ack in one round trip (DockClient.put(..., ack=claim))
                self.dock.ack_rows(req["ack"]["consumer"], req["ack"]["lease"], rows, iteration=req["iteration"])
            with self._lock:  # the descriptor is metadata: it counts as controller bytes
                self.controller_bytes += len(descriptor.command)

        _guard("put", put)

    def do_get(self, context: flight.ServerCallContext, ticket: flight.Ticket) -> flight.RecordBatchStream:
        """A read (ticket ``{iteration, columns, rows}``), or with ticket ``{"claim": <claim action
        body>}`` a claim and the read of its rows in one round trip (memory payload): the claim's
        result, metadata only, travels as the schema metadata ``CLAIM_META`` and counts as
        controller bytes."""
        def get() -> pa.Table:
            self._require("memory", "get")
            req = json.loads(ticket.ticket)
            if "claim" not in req:
                batch = self.dock.get(req["columns"], req["rows"], iteration=req["iteration"])
                return pa.Table.from_batches([batch], schema=batch.schema)
            claim = req["claim"]
            res = self._claim(context, claim)
            try:
                batch = self.dock.get(claim["columns"], res["rows"], iteration=claim["iteration"])
            except BaseException:
                self.dock.release(claim["consumer"], res["rows"], iteration=claim["iteration"])
                raise
            meta = json.dumps(res).encode()
            with self._lock:
                self.controller_bytes += len(ticket.ticket) + len(meta)
            return pa.Table.from_batches([batch], schema=batch.schema.with_metadata({CLAIM_META: meta}))

        return flight.RecordBatchStream(_guard("get", get))


def start_local_shards(
    n: int, schema: Schema, token: str | None = None, *, timeout_s: float = 600.0, lease_s: float = 300.0,
    payload: Literal["memory", "store"] = "memory",
) -> tuple[list[DockShardServer], list[str]]:
    """Start ``n`` shard servers in this process (gRPC threads) on free loopback ports.

    Returns the servers (call ``close()`` on each when done) and their locations.
    """
    servers = [
        DockShardServer(schema, "grpc://127.0.0.1:0", token=token, timeout_s=timeout_s, lease_s=lease_s, payload=payload)
        for _ in range(n)
    ]
    return servers, [s.location for s in servers]


def _fail(e: DockError) -> NoReturn:
    raise dock_error_to_flight(e)


def _guard(what: str, fn: Callable[[], Any]) -> Any:
    """Run a request; dock errors become their Flight form, malformed requests a DockError."""
    try:
        return fn()
    except DockError as e:
        _fail(e)
    except (KeyError, TypeError, json.JSONDecodeError) as e:
        _fail(DockError(f"dock shard: malformed {what} request ({type(e).__name__}: {e})"))


def _timeout(value: float | None) -> float:
    """A wait's ``timeout_s`` from a request body: null means no limit."""
    return math.inf if value is None else float(value)


def _load_schema(spec: str) -> Schema:
    module, _, attr = spec.partition(":")
    schema = getattr(importlib.import_module(module), attr or "GRPO_SCHEMA")
    if not isinstance(schema, Schema):
        raise SystemExit(f"--schema {spec!r}: expected 'module:attribute' naming a dockrl Schema, got {type(schema).__name__}")
    return schema


def is_loopback(host: str) -> bool:
    """Whether ``host`` (an address or ``localhost``) is reachable from this machine only."""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False  # a host name: it may resolve to any interface


def serve_shard(argv: list[str] | None = None) -> int:
    """Run one dock shard in this process until SIGINT/SIGTERM; print its location first.

    Returns the process exit code.
    """
    parser = argparse.ArgumentParser(prog="dockrl dock-shard", description="Run one transfer dock shard.")
    parser.add_argument("--host", default="127.0.0.1", help="interface to bind (default: loopback only)")
    parser.add_argument("--port", type=int, default=0, help="port; 0 picks a free one (printed on stdout)")
    parser.add_argument("--token-env", default=None, help="environment variable holding the shared bearer token")
    parser.add_argument("--schema", default="dockrl.dock.schema:GRPO_SCHEMA", help="module:attribute of the Schema")
    parser.add_argument("--timeout-s", type=float, default=600.0, help="default claim timeout, seconds")
    parser.add_argument("--payload", choices=("memory", "store"), default="memory",
                        help="memory: cells in this shard; store: metadata only, cells in the run's warehouse")
    parser.add_argument("--lease-s", type=float, default=300.0, help="default lease term of a claim, seconds")
    parser.add_argument("--driver-timeout-s", type=float, default=0.0,
                        help="stop when the run's driver has not renewed its lease for this long, seconds (0: never)")
    args = parser.parse_args(argv)
    if not 0 < args.lease_s < math.inf:
        parser.error(f"--lease-s {args.lease_s}: expected a finite number of seconds > 0")
    token = None
    if args.token_env:
        token = os.environ.get(args.token_env)
        if not token:
            parser.error(f"--token-env {args.token_env}: the environment variable is unset or empty; export the shard token")
    if token is None and not is_loopback(args.host):
        parser.error(f"--host {args.host}: a shard reachable from other machines must require a bearer token; "
                     "pass --token-env DOCKRL_DOCK_TOKEN (with the token in that variable), or bind --host 127.0.0.1")
    logging.basicConfig(level=logging.INFO, stream=sys.stderr, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    server = DockShardServer(
        _load_schema(args.schema), f"grpc://{args.host}:{args.port}", token=token, timeout_s=args.timeout_s,
        payload=args.payload,
        lease_s=args.lease_s,
    )
    # gRPC threads serve already; the main thread only waits for a signal. Not server.serve():
    # on a signal it shuts gRPC down first, which waits for claims blocked in the shard (up to
    # their timeout), and only then runs Python's handler; close() wakes them first.
    stopping = threading.Event()
    driver_gone: list[str] = []

    def stop(signum: int, frame: object) -> None:
        stopping.set()

    def gone(reason: str) -> None:
        driver_gone.append(reason)
        stopping.set()

    from dockrl.lifeline import driver_pid_from_env, watch_driver

    watch_driver(driver_pid=driver_pid_from_env(), lease_quiet=server.driver_quiet_s if args.driver_timeout_s > 0 else None,
                 timeout_s=args.driver_timeout_s or 60.0, what=f"dock shard at {server.location}", on_gone=gone)

    signal.signal(signal.SIGTERM, stop)
    signal.signal(signal.SIGINT, stop)
    print(server.location, flush=True)  # after the handlers: whoever reads it may stop the shard at once
    try:
        stopping.wait()
        if driver_gone:
            logger.error("%s; stopping", driver_gone[0])
        logger.info("dock shard at %s stopping", server.location)
    finally:
        server.close()
    return 1 if driver_gone else 0


if __name__ == "__main__":
    sys.exit(serve_shard())
