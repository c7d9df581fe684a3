"""Dock shards over Arrow Flight (``dock.mode=distributed``; docs/design.md §2).

``DockShardServer`` serves one ``dockrl.dock.shard.ShardService`` (the shard's behaviour and
its requests are documented there); ``FlightTransport`` is the front end's side of it
(``dockrl.dock.client.DockClient`` given ``grpc://`` locations builds one per shard). The
mapping onto Flight (action bodies and results UTF-8 JSON; the claim cycle's messages binary):

* ``do_action`` — every request of the service, by name (``ShardService.action``).
* ``do_put`` — payload in: descriptor command {iteration, ack?} as JSON, or the same in the
  binary put descriptor (``encode_put``, what ``FlightTransport`` sends); one record batch with
  an int64 ``row`` column (global row indexes) plus the data columns.
* ``do_get`` — payload out: ticket {iteration, columns, rows} (JSON) → the cells as a record
  batch stream, in the order of ``rows``; a binary claim ticket (``encode_claim``: a
  ``ClaimRequest``) claims and reads in one round trip: one record batch of the cells, the
  claim's result travelling as its ``app_metadata`` (``encode_claim_result``: pending, held and
  the rows as ascending runs; ``ShardService.claim_cells``).
* ``do_exchange`` — a put that carries the next claim (``ShardService.put_claim``): descriptor
  command ``encode_exchange`` of a put descriptor and a claim ticket, then the put's one record
  batch in; out, as a claim's ``do_get``: one record batch of the claimed cells with the claim's
  result as its ``app_metadata``, or, when the put landed and the claim failed, only
  ``app_metadata`` naming the claim's error (``encode_claim_failed``).

The binary messages carry ``WIRE_VERSION``; a shard refuses another version, and a claim
ticket in the JSON form of earlier releases, naming both versions.

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
import struct
import sys
import threading
from typing import Any, Callable, Iterator, Literal, NoReturn, TypeVar

import numpy as np
import pyarrow as pa
import pyarrow.flight as flight

from dockrl.dock.errors import DockError, DockTimeoutError
from dockrl.dock.iteration import one_run
from dockrl.dock.schema import Schema
from dockrl.dock.shard import WIRE_VERSION as WIRE_VERSION  # the version of these messages; describe answers it
from dockrl.dock.shard import ClaimRequest, Payload, ShardService, ack_of, row_runs, runs_rows
from dockrl.dock.shard_controller import ShardController

logger = logging.getLogger(__name__)

T = TypeVar("T")
_ERRORS: dict[str, type[DockError]] = {"DockError": DockError, "DockTimeoutError": DockTimeoutError}

# --- the claim cycle's binary messages ---------------------------------------------------------
# A claim ticket: header, then the lease id, then the request's fixed part (JSON [consumer, owner,
# columns]: the same bytes claim after claim, parsed once per shard). Little-endian throughout.
_CLAIM_MAGIC, _PUT_MAGIC = b"dkc", b"dkp"
_CLAIM_HEAD = struct.Struct("<3sBqqqddBHH")
"""magic, version, iteration, count, at_least, timeout_s (NaN: none), lease_s (NaN: the shard's), flags, len(lease), len(fixed part)."""
_WHOLE_GROUPS, _WAIT_HELD = 1, 2
_RESULT_HEAD = struct.Struct("<BqqI")
"""version, pending, held, number of runs; then the runs as int64 ``[start, stop)`` pairs."""
_RUN = struct.Struct("<qq")
_PUT_HEAD = struct.Struct("<3sBqBHH")
"""magic, version, iteration, flags (``_PUT_ACK``: the put acks a claim), len(ack consumer), len(ack lease); then the two strings."""
_PUT_ACK = 1
_EXCHANGE_MAGIC = b"dkx"
_EXCHANGE_HEAD = struct.Struct("<3sBI")
"""magic, version, len(put descriptor); then the put descriptor (``encode_put``), then the claim ticket (``encode_claim``)."""
_CLAIM_FAILED = 0
"""First byte of the ``app_metadata`` of an exchange whose put landed and whose claim failed (no wire version is 0)."""
_UNASKED = object()
_NOT_A_VERSION_ERROR = (DockTimeoutError, flight.FlightTimedOutError, flight.FlightUnavailableError,
                        flight.FlightUnauthenticatedError, flight.FlightCancelledError)
"""Failures of a put or claim that say nothing of the shard's wire version: no ``describe`` after them."""
_WIRE_CHECK_TIMEOUT_S = 10.0
"""Seconds a client waits for a shard's ``describe`` when it checks the shard's wire version."""
_MAX_PREPARED = 1024
"""Fixed parts of claim tickets a shard keeps parsed (cleared when full)."""


def claim_fixed_part(consumer: str, owner: str, columns: tuple[str, ...]) -> bytes:
    """The part of a claim ticket that repeats from claim to claim of one client (``encode_claim``)."""
    return json.dumps([consumer, owner, list(columns)]).encode()


def encode_claim(req: ClaimRequest, fixed: bytes) -> bytes:
    """The binary claim ticket of ``req`` (``fixed``: ``claim_fixed_part`` of its consumer, owner and columns)."""
    lease = (req.lease or "").encode()
    flags = (_WHOLE_GROUPS if req.whole_groups else 0) | (_WAIT_HELD if req.wait_held else 0)
    head = _CLAIM_HEAD.pack(
        _CLAIM_MAGIC, WIRE_VERSION, req.iteration, req.limit, req.at_least, math.nan if req.timeout_s is None else req.timeout_s,
        math.nan if req.lease_s is None else req.lease_s, flags, len(lease), len(fixed),
    )
    return head + lease + fixed


_SAME_RELEASE = "run clients and shards of the same dockrl release"


def _version_error(what: str, version: object, location: str | None = None) -> DockError:
    """The refusal of a message of another wire version, naming both versions.

    ``location`` None: raised by the shard, ``version`` the client's; else raised by the client,
    ``version`` that of the shard at ``location``.
    """
    if location is None:
        return DockError(f"{what}: the client speaks dock wire version {version}; this shard speaks {WIRE_VERSION}: "
                         f"{_SAME_RELEASE}")
    return DockError(f"{what}: the dock shard at {location} speaks wire version {version}; this client speaks "
                     f"{WIRE_VERSION}: {_SAME_RELEASE}")


def decode_claim(data: bytes, fixed_parts: dict[bytes, tuple[str, str, tuple[str, ...]]]) -> ClaimRequest:
    """The ``ClaimRequest`` of a binary claim ticket; ``fixed_parts`` caches the parsed fixed parts.

    Raises:
        DockError: another wire version, or a malformed ticket.
    """
    if len(data) > 3 and data[3] != WIRE_VERSION:  # the version first: another version may have another header
        raise _version_error("claim", data[3])
    if len(data) < _CLAIM_HEAD.size:
        raise DockError(f"dock shard: malformed claim ticket ({len(data)} bytes)")
    _, _, iteration, count, at_least, timeout_s, lease_s, flags, n_lease, n_fixed = _CLAIM_HEAD.unpack_from(data)
    start = _CLAIM_HEAD.size + n_lease
    if len(data) != start + n_fixed:
        raise DockError(f"dock shard: malformed claim ticket ({len(data)} bytes; the header says {start + n_fixed})")
    key = data[start:]
    fixed = fixed_parts.get(key)
    if fixed is None:
        consumer, owner, columns = json.loads(key)
        if not (isinstance(consumer, str) and isinstance(owner, str) and isinstance(columns, list)
                and all(isinstance(c, str) for c in columns)):
            raise DockError(f"dock shard: malformed claim ticket (consumer, owner, columns: {key[:200]!r})")
        if len(fixed_parts) >= _MAX_PREPARED:
            fixed_parts.clear()
        fixed = fixed_parts[key] = (consumer, owner, tuple(columns))
    return ClaimRequest(
        iteration, fixed[0], fixed[2], count, at_least, bool(flags & _WHOLE_GROUPS), None if math.isnan(timeout_s) else timeout_s,
        fixed[1], data[_CLAIM_HEAD.size:start].decode() if n_lease else None, None if math.isnan(lease_s) else lease_s,
        bool(flags & _WAIT_HELD),
    )


def encode_claim_result(rows: np.ndarray, pending: int, held: int) -> bytes:
    """A claim's answer (the ``app_metadata`` of its cells): pending, held and ``rows`` (ascending, distinct) as runs."""
    run = one_run(rows)
    if run is not None:  # the usual claim
        return _RESULT_HEAD.pack(WIRE_VERSION, pending, held, 1) + _RUN.pack(*run)
    runs = row_runs(rows)
    return _RESULT_HEAD.pack(WIRE_VERSION, pending, held, len(runs)) + runs.astype("<i8", copy=False).tobytes()


def decode_claim_result(meta: bytes, location: str = "(unknown)") -> tuple[np.ndarray, int, int]:
    """(rows as an int64 array, pending, held) of ``encode_claim_result`` from the shard at ``location``.

    Raises:
        DockError: another wire version, or a malformed answer (both naming ``location``).
    """
    if not meta or meta[0] != WIRE_VERSION:  # the version first: another version may have another layout
        if not meta:
            raise DockError(f"claim: malformed answer of the dock shard at {location} (0 bytes)")
        raise _version_error("claim", meta[0], location)
    if len(meta) < _RESULT_HEAD.size:
        raise DockError(f"claim: malformed answer of the dock shard at {location} ({len(meta)} bytes)")
    _, pending, held, n = _RESULT_HEAD.unpack_from(meta)
    if len(meta) != _RESULT_HEAD.size + 16 * n:
        raise DockError(f"claim: malformed answer of the dock shard at {location} ({len(meta)} bytes for {n} runs)")
    if n == 1:  # one run (the usual claim)
        start, stop = _RUN.unpack_from(meta, _RESULT_HEAD.size)
        return np.arange(start, stop, dtype=np.int64), pending, held
    runs = np.frombuffer(meta, dtype="<i8", count=2 * n, offset=_RESULT_HEAD.size).reshape(n, 2)
    return runs_rows(runs), pending, held


def encode_put(iteration: int, ack: tuple[str, str] | None) -> bytes:
    """The binary put descriptor: the iteration and, with ``ack=(consumer, lease)``, the claim it acks
    (flagged ``_PUT_ACK``: an ack is one whatever its strings)."""
    if ack is None:
        return _PUT_HEAD.pack(_PUT_MAGIC, WIRE_VERSION, iteration, 0, 0, 0)
    consumer, lease = ack[0].encode(), ack[1].encode()
    return _PUT_HEAD.pack(_PUT_MAGIC, WIRE_VERSION, iteration, _PUT_ACK, len(consumer), len(lease)) + consumer + lease


def decode_put(command: bytes) -> tuple[int, tuple[str, str] | None]:
    """(iteration, ack) of a put descriptor: binary (``encode_put``) or JSON {iteration, ack?: {consumer, lease}}.

    Raises:
        DockError: another wire version, or a malformed binary descriptor.
        KeyError, TypeError, ValueError: a malformed JSON one.
    """
    if command[:3] != _PUT_MAGIC:
        req = json.loads(command)
        return req["iteration"], (req["ack"]["consumer"], req["ack"]["lease"]) if "ack" in req else None
    if len(command) > 3 and command[3] != WIRE_VERSION:  # the version first: another version may have another header
        raise _version_error("put", command[3])
    if len(command) < _PUT_HEAD.size:
        raise DockError(f"dock shard: malformed put descriptor ({len(command)} bytes)")
    _, _, iteration, flags, n_consumer, n_lease = _PUT_HEAD.unpack_from(command)
    if len(command) != _PUT_HEAD.size + n_consumer + n_lease:
        raise DockError(f"dock shard: malformed put descriptor ({len(command)} bytes)")
    if not flags & _PUT_ACK:
        return iteration, None
    start = _PUT_HEAD.size + n_consumer
    return iteration, (command[_PUT_HEAD.size:start].decode(), command[start:].decode())


def encode_exchange(put: bytes, claim: bytes) -> bytes:
    """The descriptor command of a put that carries a claim: ``put`` (``encode_put``) and ``claim`` (``encode_claim``)."""
    return _EXCHANGE_HEAD.pack(_EXCHANGE_MAGIC, WIRE_VERSION, len(put)) + put + claim


def decode_exchange(command: bytes) -> tuple[bytes, bytes]:
    """(put descriptor, claim ticket) of ``encode_exchange``; each is checked by its own decoder.

    Raises:
        DockError: another wire version, or a malformed command.
    """
    if len(command) > 3 and command[3] != WIRE_VERSION:  # the version first: another version may have another header
        raise _version_error("put", command[3])
    if command[:3] != _EXCHANGE_MAGIC or len(command) < _EXCHANGE_HEAD.size:
        raise DockError(f"dock shard: malformed exchange descriptor ({len(command)} bytes; expected a put that carries a claim)")
    (n_put,) = _EXCHANGE_HEAD.unpack_from(command)[2:]
    end = _EXCHANGE_HEAD.size + n_put
    if len(command) < end:
        raise DockError(f"dock shard: malformed exchange descriptor ({len(command)} bytes; the header says more than {end})")
    return command[_EXCHANGE_HEAD.size:end], command[end:]


def encode_claim_failed(e: DockError) -> bytes:
    """The ``app_metadata`` of an exchange whose put landed and whose claim failed with ``e``."""
    return bytes([_CLAIM_FAILED]) + f"{type(e).__name__}: {e}".encode()


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
        self._fixed_parts: dict[bytes, tuple[str, str, tuple[str, ...]]] = {}  # of claim tickets (decode_claim)
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
        command = descriptor.command

        def put() -> None:
            iteration, ack = decode_put(command)
            self.service.write(iteration, reader.read_all(), ack, from_ipc=True)
            self._count(len(command))  # the descriptor is metadata: it counts as controller bytes

        _guard("put", put)

    def do_get(self, context: flight.ServerCallContext, ticket: flight.Ticket) -> flight.FlightDataStream:
        """A read (JSON ticket ``{iteration, columns, rows}``), or with a binary claim ticket
        (``encode_claim``) a claim and the read of its rows in one round trip (``ShardService.claim_cells``)."""
        data = ticket.ticket
        if data[:3] == _CLAIM_MAGIC:
            return _guard("claim", lambda: self._claim_stream(data, context))

        def get() -> pa.Table:
            req = json.loads(data)
            if "claim" in req:  # the JSON claim ticket of wire version 1
                raise _version_error("claim", 1)
            batch = self.service.get(req)
            return pa.Table.from_batches([batch], schema=batch.schema)

        return flight.RecordBatchStream(_guard("get", get), options=self._ipc)

    def do_exchange(
        self,
        context: flight.ServerCallContext,
        descriptor: flight.FlightDescriptor,
        reader: flight.MetadataRecordBatchReader,
        writer: flight.MetadataRecordBatchWriter,
    ) -> None:
        """A put that carries the next claim (``encode_exchange``): the put's batch in, the claim's cells out."""
        command = descriptor.command

        def exchange() -> tuple[np.ndarray, int, int, pa.RecordBatch] | DockError:
            put, ticket = decode_exchange(command)
            iteration, ack = decode_put(put)
            req = decode_claim(ticket, self._fixed_parts)
            return self.service.put_claim(iteration, reader.read_all(), ack, req, from_ipc=True)

        result = _guard("put", exchange)
        if isinstance(result, DockError):  # the put landed; the claim did not
            meta = encode_claim_failed(result)
            writer.write_metadata(pa.py_buffer(meta))
        else:
            rows, pending, held, batch = result
            meta = encode_claim_result(rows, pending, held)
            writer.begin(batch.schema, options=self._ipc)
            writer.write_with_metadata(batch, pa.py_buffer(meta))
        self._count(len(command) + len(meta))

    def _claim_stream(self, data: bytes, context: flight.ServerCallContext) -> flight.GeneratorStream:
        rows, pending, held, batch = self.service.claim_cells(decode_claim(data, self._fixed_parts), context.is_cancelled)
        meta = encode_claim_result(rows, pending, held)
        self._count(len(data) + len(meta))
        # the result as the batch's app_metadata: the batch keeps its (cached) schema, and a stream of a
        # schema object seen before costs the server less than one with per-claim schema metadata
        return flight.GeneratorStream(batch.schema, iter([(batch, pa.py_buffer(meta))]), options=self._ipc)


class FlightTransport:
    """The front end's side of one ``DockShardServer``: ``ShardTransport`` over Arrow Flight.

    Args:
        location: ``grpc://host:port`` of the shard.
        token: the shard's bearer token; None when it runs without auth.

    Flight errors (unreachable shard, ``FlightUnauthenticatedError`` for a wrong token) are
    annotated with the shard and the call; dock errors come back as their own type.

    The first time a put or claim fails (other than by timing out, an unreachable shard or a wrong
    token), the transport asks the shard its wire version (``describe``; a shard of version 1
    answers none) and, when it is not ``WIRE_VERSION``, raises a ``DockError`` naming both versions
    instead: a shard of another release fails such calls with errors that name no version. Calls
    that succeed cost nothing more.
    """

    mode: Literal["inprocess", "distributed"] = "distributed"

    def __init__(self, location: str, *, token: str | None = None) -> None:
        self.location = location
        self._headers = [(b"authorization", f"Bearer {token}".encode())] if token else []
        self._client = flight.connect(location)
        self._lock = threading.Lock()
        self._call_options: dict[float | None, flight.FlightCallOptions] = {}
        self._fixed_parts: dict[tuple[str, str, tuple[str, ...]], bytes] = {}  # claim_fixed_part by consumer, owner, columns
        self._ipc = pa.ipc.IpcWriteOptions()  # once: the default options read the environment on every stream
        self._shard_wire: object = _UNASKED  # the shard's wire version, once asked (_check_wire)
        self.controller_bytes = 0
        """Bytes of action bodies and results, put descriptors and claim tickets and results sent and received."""

    def _options(self, timeout: float | None) -> flight.FlightCallOptions:
        options = self._call_options.get(timeout)
        if options is None:
            options = flight.FlightCallOptions(headers=self._headers, timeout=timeout, write_options=self._ipc)
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

    def _check_wire(self, what: str, error: BaseException) -> None:
        """After ``what`` failed with ``error``: refuse a shard of another wire version, by name (asked once).

        Raises:
            DockError: the shard's ``describe`` names another wire version, or none (version 1).
        """
        if self._shard_wire is _UNASKED:
            try:
                desc = self.action("describe", {}, _WIRE_CHECK_TIMEOUT_S)
            except (DockError, flight.FlightError, pa.ArrowException, ValueError):
                return  # the shard cannot say: the call's own error tells more
            self._shard_wire = desc.get("wire_version", 1) if isinstance(desc, dict) else None
        if self._shard_wire != WIRE_VERSION:
            raise _version_error(what, self._shard_wire, self.location) from error

    def action(self, name: str, body: dict[str, Any], timeout: float | None) -> Any:
        data = json.dumps(body).encode()
        results = self._call(name, lambda: list(self._client.do_action(flight.Action(name, data), self._options(timeout))))
        out = results[0].body.to_pybytes() if results else b"null"
        self._count(len(data) + len(out))
        return json.loads(out)

    def _checked(self, what: str, fn: Callable[[], T]) -> T:
        """``_call`` of a put or claim: a failure that may come from a shard of another release is checked (``_check_wire``)."""
        try:
            return self._call(what, fn)
        except _NOT_A_VERSION_ERROR:
            raise
        except (DockError, flight.FlightError, pa.ArrowException) as e:
            self._check_wire(what, e)
            raise

    def put(self, body: dict[str, Any], batch: pa.RecordBatch, timeout: float | None) -> None:
        command = encode_put(body["iteration"], ack_of(body))
        self._count(len(command))

        def send() -> None:
            writer, _ = self._client.do_put(flight.FlightDescriptor.for_command(command), batch.schema, self._options(timeout))
            writer.write_batch(batch)
            writer.close()

        self._checked("put", send)

    def get(self, body: dict[str, Any], timeout: float | None) -> pa.Table:
        ticket = flight.Ticket(json.dumps(body).encode())
        return self._call("get", lambda: self._client.do_get(ticket, self._options(timeout)).read_all())

    def _fixed_part(self, req: ClaimRequest) -> bytes:
        key = (req.consumer, req.owner, req.columns)
        fixed = self._fixed_parts.get(key)
        if fixed is None:
            fixed = self._fixed_parts[key] = claim_fixed_part(*key)
        return fixed

    def claim_cells(self, req: ClaimRequest, timeout: float | None) -> tuple[np.ndarray, int, int, pa.RecordBatch]:
        data = encode_claim(req, self._fixed_part(req))

        def claim() -> tuple[np.ndarray, int, int, pa.RecordBatch]:
            chunk = _one_batch(self._client.do_get(flight.Ticket(data), self._options(timeout)), self.location)
            if chunk.app_metadata is None:
                raise DockError(f"claim: the dock shard at {self.location} answered without the claim's result: "
                                f"{_SAME_RELEASE} (wire version {WIRE_VERSION})")
            meta = chunk.app_metadata.to_pybytes()
            self._count(len(data) + len(meta))
            return (*decode_claim_result(meta, self.location), chunk.data)

        return self._checked("claim", claim)

    def put_claim(
        self, body: dict[str, Any], batch: pa.RecordBatch, req: ClaimRequest, timeout: float | None,
    ) -> tuple[np.ndarray, int, int, pa.RecordBatch] | DockError:
        command = encode_exchange(encode_put(body["iteration"], ack_of(body)), encode_claim(req, self._fixed_part(req)))

        def exchange() -> flight.FlightStreamChunk:
            writer, reader = self._client.do_exchange(flight.FlightDescriptor.for_command(command), self._options(timeout))
            with writer:
                writer.begin(batch.schema, options=self._ipc)
                writer.write_batch(batch)
                writer.done_writing()
                return _one_batch(reader, self.location, "put")

        chunk = self._checked("put", exchange)  # raises: the put did not land (or it is unknown whether it did)
        meta = chunk.app_metadata.to_pybytes() if chunk.app_metadata is not None else b""
        self._count(len(command) + len(meta))
        what = f"claim carried by a put to the dock shard at {self.location}"
        if meta[:1] == bytes([_CLAIM_FAILED]):
            return DockError(f"{what}: {meta[1:].decode(errors='replace')}")
        try:  # the put landed: what is wrong from here on concerns the claim alone
            rows, pending, held = decode_claim_result(meta, self.location)
        except DockError as e:
            return e
        if chunk.data is None:
            return DockError(f"{what}: the shard answered the claim's result without its cells")
        return rows, pending, held, chunk.data

    def close(self) -> None:
        self._client.close()


def _one_batch(reader: flight.FlightStreamReader, location: str, what: str = "claim") -> flight.FlightStreamChunk:
    """The one record batch (and its app_metadata) of a ``what`` stream from the shard at ``location``, read to its end.

    Raises:
        DockError: the stream holds no batch or more than one.
    """
    try:
        chunk = reader.read_chunk()
    except StopIteration:
        raise DockError(f"{what}: the dock shard at {location} answered no record batch") from None
    try:
        reader.read_chunk()
    except StopIteration:
        return chunk
    raise DockError(f"{what}: the dock shard at {location} answered more than one record batch")


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
    except (KeyError, TypeError, json.JSONDecodeError, UnicodeDecodeError, struct.error) as e:
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
