"""Dock shards over Arrow Flight (``dock.mode=distributed``; docs/design.md §2).

``DockShardServer`` serves one ``dockrl.dock.shard.ShardService`` (the shard's behaviour and
its requests are documented there); ``FlightTransport`` is the front end's side of it
(``dockrl.dock.client.DockClient`` given ``grpc://`` locations builds one per shard). The
mapping onto Flight (every body and result UTF-8 JSON):

* ``do_action`` — every request of the service, by name (``ShardService.action``).
* ``do_put`` — payload in: descriptor command {iteration, ack?}; one record batch with an
  int64 ``row`` column (global row indexes) plus the data columns.
* ``do_get`` — payload out: ticket {iteration, columns, rows} → the cells as a record batch
  stream, in the order of ``rows``; ticket {"claim": <claim body>} claims and reads in one
  round trip, the claim's result travelling as the schema metadata ``CLAIM_META`` (JSON
  {runs, pending, held}: ``ShardService.claim_cells``).

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
from typing import Any, Callable, Iterator, Literal, NoReturn, TypeVar

import pyarrow as pa
import pyarrow.flight as flight

from dockrl.dock.errors import DockError, DockTimeoutError
from dockrl.dock.local import ShardController
from dockrl.dock.schema import Schema
from dockrl.dock.shard import Payload, ShardService

logger = logging.getLogger(__name__)

T = TypeVar("T")
CLAIM_META = b"dockrl.claim"
"""Schema metadata key of a claim-and-read ``do_get`` answer: JSON ``{runs, pending, held}`` (rows as ranges)."""
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
    """One dock shard served over Arrow Flight: a ``ShardService`` behind gRPC.

    Args:
        schema: the column schema shared by every shard and client.
        location: where to listen; port 0 picks a free port (see ``location``).
        token: shared secret every call must present as ``authorization: Bearer <token>``;
            None accepts every call (single-machine runs).
        timeout_s: default claim timeout of the shard, seconds.
        payload: ``memory`` (cells in this process, Flight ``do_put``/``do_get``) or ``store``
            (cells in a warehouse that clients read and write; this shard keeps object keys).
        lease_s: default lease term of the shard, seconds (clients send their own).

    Serving starts in the constructor (gRPC threads); ``serve()`` only blocks. ``close()``
    wakes blocked claims (they fail with "no iteration is open") and shuts the server down.
    """

    def __init__(
        self, schema: Schema, location: str = "grpc://127.0.0.1:0", *, token: str | None = None, timeout_s: float = 600.0,
        payload: Payload = "memory", lease_s: float = 300.0,
    ) -> None:
        if payload not in ("memory", "store"):
            raise ValueError(f"DockShardServer payload: got {payload!r}; expected 'memory' or 'store'")
        middleware = {"auth": BearerTokenMiddlewareFactory(token)} if token else {}
        super().__init__(location, middleware=middleware)
        host = location.split("://", 1)[-1].rsplit(":", 1)[0]
        self._location = f"grpc://{host}:{self.port}"
        self.service = ShardService(schema, name=self._location, timeout_s=timeout_s, payload=payload, lease_s=lease_s)
        self._lock = threading.Lock()
        self._closed = False
        self._ipc = pa.ipc.IpcWriteOptions()  # once: the default options read the environment on every stream
        if token:
            logger.info("dock shard listening at %s (bearer token required)", self._location)
        else:
            logger.warning("dock shard listening at %s WITHOUT authentication: any process that reaches it can read and "
                           "write the run's data; start it with a token (--token-env DOCKRL_DOCK_TOKEN)", self._location)

    @property
    def location(self) -> str:
        """``grpc://host:port`` a client connects to (the real port when started with port 0)."""
        return self._location

    @property
    def dock(self) -> ShardController:
        """The shard's controller of its open iteration (``ShardService.dock``)."""
        return self.service.dock

    @property
    def controller_bytes(self) -> int:
        """Bytes of action bodies and results, put descriptors and claim tickets this shard served."""
        return self.service.controller_bytes

    def _count(self, nbytes: int) -> None:
        with self._lock:
            self.service.controller_bytes += nbytes

    def driver_quiet_s(self) -> float:
        """Seconds since the driver last renewed its lease (``driver_beat``), or since this shard started."""
        return self.service.driver_quiet_s()

    def close(self) -> None:
        """Fail blocked claims and waits, then shut the server down (waits for calls in flight). Idempotent."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
        self.service.close()
        self.shutdown()

    def __enter__(self) -> DockShardServer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def list_actions(self, context: flight.ServerCallContext) -> list[tuple[str, str]]:
        return [(name, "see dockrl.dock.shard") for name in self.service.actions]

    def do_action(self, context: flight.ServerCallContext, action: flight.Action) -> Iterator[bytes]:
        body = action.body.to_pybytes()

        def run() -> Any:
            req = json.loads(body or b"{}")
            if action.type == "claim":
                return self.service.claim(req, context.is_cancelled)
            return self.service.action(action.type, req)

        result = json.dumps(_guard(action.type, run)).encode()
        self._count(len(body) + len(result))
        return iter([result])

    def do_put(
        self,
        context: flight.ServerCallContext,
        descriptor: flight.FlightDescriptor,
        reader: flight.MetadataRecordBatchReader,
        writer: flight.FlightMetadataWriter,
    ) -> None:
        def put() -> None:
            self.service.put(json.loads(descriptor.command), reader.read_all())
            self._count(len(descriptor.command))  # the descriptor is metadata: it counts as controller bytes

        _guard("put", put)

    def do_get(self, context: flight.ServerCallContext, ticket: flight.Ticket) -> flight.RecordBatchStream:
        """A read (ticket ``{iteration, columns, rows}``), or with ticket ``{"claim": <claim body>}``
        a claim and the read of its rows in one round trip (``ShardService.claim_cells``)."""
        def get() -> pa.Table:
            req = json.loads(ticket.ticket)
            if "claim" not in req:
                batch = self.service.get(req)
                return pa.Table.from_batches([batch], schema=batch.schema)
            res, batch = self.service.claim_cells(req["claim"], context.is_cancelled)
            meta = json.dumps(res).encode()
            self._count(len(ticket.ticket) + len(meta))
            return pa.Table.from_batches([batch], schema=batch.schema.with_metadata({CLAIM_META: meta}))

        return flight.RecordBatchStream(_guard("get", get), options=self._ipc)


class FlightTransport:
    """The front end's side of one ``DockShardServer``: ``ShardTransport`` over Arrow Flight.

    Args:
        location: ``grpc://host:port`` of the shard.
        token: the shard's bearer token; None when it runs without auth.

    Flight errors (unreachable shard, ``FlightUnauthenticatedError`` for a wrong token) are
    annotated with the shard and the call; dock errors come back as their own type.
    """

    mode: Literal["inprocess", "distributed"] = "distributed"

    def __init__(self, location: str, *, token: str | None = None) -> None:
        self.location = location
        self._headers = [(b"authorization", f"Bearer {token}".encode())] if token else []
        self._client = flight.connect(location)
        self._lock = threading.Lock()
        self._call_options: dict[float | None, flight.FlightCallOptions] = {}
        self.controller_bytes = 0
        """Bytes of action bodies and results, put descriptors and claim tickets and results sent and received."""

    def _options(self, timeout: float | None) -> flight.FlightCallOptions:
        options = self._call_options.get(timeout)
        if options is None:
            options = flight.FlightCallOptions(headers=self._headers, timeout=timeout)
            if len(self._call_options) < 64:  # the timeouts a client uses repeat (rpc_timeout_s, a claim's wait + slack)
                self._call_options[timeout] = options
        return options

    def _call(self, what: str, fn: Callable[[], T]) -> T:
        try:
            return fn()
        except (flight.FlightError, pa.ArrowException) as e:
            raise_dock_error(e)
            e.add_note(f"while calling {what} on the dock shard at {self.location}")
            raise

    def _count(self, nbytes: int) -> None:
        with self._lock:
            self.controller_bytes += nbytes

    def action(self, name: str, body: dict[str, Any], timeout: float | None) -> Any:
        data = json.dumps(body).encode()
        results = self._call(name, lambda: list(self._client.do_action(flight.Action(name, data), self._options(timeout))))
        out = results[0].body.to_pybytes() if results else b"null"
        self._count(len(data) + len(out))
        return json.loads(out)

    def put(self, body: dict[str, Any], batch: pa.RecordBatch, timeout: float | None) -> None:
        command = json.dumps(body).encode()
        self._count(len(command))

        def send() -> None:
            writer, _ = self._client.do_put(flight.FlightDescriptor.for_command(command), batch.schema, self._options(timeout))
            writer.write_batch(batch)
            writer.close()

        self._call("put", send)

    def get(self, body: dict[str, Any], timeout: float | None) -> pa.Table:
        ticket = flight.Ticket(json.dumps(body).encode())
        return self._call("get", lambda: self._client.do_get(ticket, self._options(timeout)).read_all())

    def claim_cells(self, body: dict[str, Any], timeout: float | None) -> tuple[dict[str, Any], pa.Table]:
        data = json.dumps({"claim": body}).encode()
        table = self._call("claim", lambda: self._client.do_get(flight.Ticket(data), self._options(timeout)).read_all())
        meta = table.schema.metadata[CLAIM_META]
        self._count(len(data) + len(meta))
        return json.loads(meta), table.replace_schema_metadata(None)

    def close(self) -> None:
        self._client.close()


def start_local_shards(
    n: int, schema: Schema, token: str | None = None, *, timeout_s: float = 600.0, lease_s: float = 300.0,
    payload: Payload = "memory",
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
