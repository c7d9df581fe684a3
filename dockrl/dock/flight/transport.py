"""The front end's side of the dock over Arrow Flight: ``FlightTransport``, the ``ShardTransport``
(``dockrl.dock.shard.service``) of one ``DockShardServer`` (``dockrl.dock.client.dock_client.DockClient`` given
``grpc://`` locations builds one per shard; ``dockrl.dock.flight.shards`` maps the requests onto Flight,
``dockrl.dock.flight.wire`` holds the messages).
"""

from __future__ import annotations

import json
import threading
from typing import Any, Callable, Literal, TypeVar

import numpy as np
import pyarrow as pa
import pyarrow.flight as flight

from dockrl.dock.errors import DockError, DockTimeoutError
from dockrl.dock.flight.wire import (
    CLAIM_FAILED,
    SAME_RELEASE,
    claim_fixed_part,
    decode_claim_result,
    encode_claim,
    encode_exchange,
    encode_put,
    raise_dock_error,
    version_error,
)
from dockrl.dock.shard.requests import WIRE_VERSION, ClaimRequest, ack_of
from dockrl.dock.tls import DockTLS, connect

T = TypeVar("T")
_UNASKED = object()
_NOT_A_VERSION_ERROR = (DockTimeoutError, flight.FlightTimedOutError, flight.FlightUnavailableError,
                        flight.FlightUnauthenticatedError, flight.FlightCancelledError)
"""Failures of a put or claim that say nothing of the shard's wire version: no ``describe`` after them."""
_WIRE_CHECK_TIMEOUT_S = 10.0
"""Seconds a client waits for a shard's ``describe`` when it checks the shard's wire version."""


class FlightTransport:
    """The front end's side of one ``DockShardServer``: ``ShardTransport`` over Arrow Flight.

    Args:
        location: ``grpc://host:port`` of the shard.
        token: the shard's bearer token; None when it runs without auth.
        tls: the run's mutual TLS, client end (``dockrl.dock.tls``), for a ``grpc+tls://`` shard; None: plain.

    Flight errors (unreachable shard, ``FlightUnauthenticatedError`` for a wrong token) are
    annotated with the shard and the call; dock errors come back as their own type.

    The first time a put or claim fails (other than by timing out, an unreachable shard or a wrong
    token), the transport asks the shard its wire version (``describe``; a shard of version 1
    answers none) and, when it is not ``WIRE_VERSION``, raises a ``DockError`` naming both versions
    instead: a shard of another release fails such calls with errors that name no version. Calls
    that succeed cost nothing more.
    """

    mode: Literal["inprocess", "distributed"] = "distributed"

    def __init__(self, location: str, *, token: str | None = None, tls: DockTLS | None = None) -> None:
        self.location = location
        self._headers = [(b"authorization", f"Bearer {token}".encode())] if token else []
        self._client = connect(location, tls)
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
            raise version_error(what, self._shard_wire, self.location) from error

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
                                f"{SAME_RELEASE} (wire version {WIRE_VERSION})")
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
        if meta[:1] == bytes([CLAIM_FAILED]):
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

