"""The shard's side of the dock over Arrow Flight: ``DockShardServer`` serves one
``dockrl.dock.shard.service.ShardService`` behind gRPC (``dockrl.dock.flight.shards`` maps its requests onto
Flight; ``dockrl.dock.flight.wire`` holds the messages), with bearer-token auth
(``BearerTokenMiddlewareFactory``): the token a call presents is the driver's or a stage's
(``dockrl.dock.roles``), and a call its role may not make (a driver's action, another stage's
consumer or columns) is refused (``FlightUnauthorizedError``).
"""

from __future__ import annotations

import json
import logging
import struct
import threading
from typing import Any, Callable, Iterator, NoReturn, Sequence

import numpy as np
import pyarrow as pa
import pyarrow.flight as flight

from dockrl.dock.errors import DockError
from dockrl.dock.flight.wire import (
    CLAIM_MAGIC,
    decode_claim,
    decode_exchange,
    decode_put,
    dock_error_to_flight,
    encode_claim_failed,
    encode_claim_result,
    version_error,
)
from dockrl.dock.roles import DRIVER, AccessDenied, ShardAccess, StageRights
from dockrl.dock.schema import Schema
from dockrl.dock.shard.controller import ShardController
from dockrl.dock.shard.requests import ROW, Payload
from dockrl.dock.shard.service import ShardService
from dockrl.dock.tls import DockTLS, scheme

logger = logging.getLogger(__name__)


class RoleMiddleware(flight.ServerMiddleware):
    """The role of one call's token (read by the handlers)."""

    def __init__(self, role: str) -> None:
        self.role = role


class BearerTokenMiddlewareFactory(flight.ServerMiddlewareFactory):
    """Rejects every call whose ``authorization`` header is not ``Bearer <token>`` of one of
    ``access``'s tokens; gives the others their role."""

    def __init__(self, access: ShardAccess) -> None:
        self.access = access

    def start_call(self, info: flight.CallInfo, headers: dict[str, list[str]]) -> RoleMiddleware:
        values = headers.get("authorization", [])
        role = self.access.role(str(values[0])) if len(values) == 1 else None
        if role is None:
            raise flight.FlightUnauthenticatedError(
                "dock shard: missing or wrong 'authorization: Bearer <token>' header; pass the token the shard was "
                "started with: its stage's DOCKRL_DOCK_TOKEN_<STAGE>, or DOCKRL_DOCK_TOKEN in the environment of "
                "`dockrl worker` (the launcher sets it), or DockClient(token=...) in code"
            )
        return RoleMiddleware(role)


class DockShardServer(flight.FlightServerBase):
    """One dock shard served over Arrow Flight: a ``ShardService`` behind gRPC.

    Args:
        schema: the column schema shared by every shard and client.
        location: where to listen; port 0 picks a free port (see ``location``).
        token: the driver's secret, every right (``authorization: Bearer <token>``); None
            accepts every call (single-machine runs).
        stages: (token, rights) of each stage process (``dockrl.dock.roles.StageRights``: its
            consumers and columns, no driver action); empty: the driver's token is the only one.
        snapshot_places: folders or ``s3://`` prefixes snapshots may go to and come from; empty: anywhere.
        tls: the run's mutual TLS, server end (``dockrl.dock.tls``): the shard serves ``grpc+tls://``
            and takes connections only from clients with a certificate of the run's authority.
        timeout_s: default claim timeout of the shard, seconds.
        payload: ``memory`` (cells in this process, Flight ``do_put``/``do_get``) or ``store``
            (cells in a warehouse that clients read and write; this shard keeps object keys).
        lease_s: default lease term of the shard, seconds (clients send their own).

    Serving starts in the constructor (gRPC threads); ``serve()`` only blocks. ``close()``
    wakes blocked claims (they fail with "no iteration is open") and shuts the server down.
    """

    def __init__(
        self, schema: Schema, location: str = "grpc://127.0.0.1:0", *, token: str | None = None, timeout_s: float = 600.0,
        payload: Payload = "memory", lease_s: float = 300.0, stages: Sequence[tuple[str, StageRights]] = (),
        snapshot_places: Sequence[str] = (), tls: DockTLS | None = None,
    ) -> None:
        if payload not in ("memory", "store"):
            raise ValueError(f"DockShardServer payload: got {payload!r}; expected 'memory' or 'store'")
        if stages and not token:
            raise ValueError("DockShardServer: stage tokens need the driver's token too")
        self.access = ShardAccess(token or "", schema, tuple(stages), snapshot_places=tuple(snapshot_places))
        middleware = {"auth": BearerTokenMiddlewareFactory(self.access)} if token else {}
        address = location.split("://", 1)[-1]
        mutual = {"tls_certificates": [flight.CertKeyPair(cert=tls.cert, key=tls.key)], "verify_client": True,
                  "root_certificates": tls.ca} if tls else {}
        super().__init__(f"{scheme(tls)}://{address}", middleware=middleware, **mutual)
        self._location = f"{scheme(tls)}://{address.rsplit(':', 1)[0]}:{self.port}"
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
        """``grpc://host:port`` (``grpc+tls://`` with TLS) a client connects to (the real port when started with port 0)."""
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
        return [(name, "see dockrl.dock.shard.service") for name in self.service.actions]

    def _role(self, context: flight.ServerCallContext) -> str:
        """The role of the call's token; the driver's when the shard takes calls without one."""
        middleware = context.get_middleware("auth")
        return middleware.role if isinstance(middleware, RoleMiddleware) else DRIVER

    def do_action(self, context: flight.ServerCallContext, action: flight.Action) -> Iterator[bytes]:
        body = action.body.to_pybytes()
        role = self._role(context)

        def run() -> Any:
            req = json.loads(body or b"{}")
            self.access.check_action(role, action.type, req)
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
        role = self._role(context)

        def put() -> None:
            iteration, ack = decode_put(command)
            self._check_put(role, reader.schema.names, ack)
            self.service.write(iteration, reader.read_all(), ack, from_ipc=True)
            self._count(len(command))  # the descriptor is metadata: it counts as controller bytes

        _guard("put", put)

    def do_get(self, context: flight.ServerCallContext, ticket: flight.Ticket) -> flight.FlightDataStream:
        """A read (JSON ticket ``{iteration, columns, rows}``), or with a binary claim ticket
        (``encode_claim``) a claim and the read of its rows in one round trip (``ShardService.claim_cells``)."""
        data, role = ticket.ticket, self._role(context)
        if data[:3] == CLAIM_MAGIC:
            return _guard("claim", lambda: self._claim_stream(data, context, role))

        def get() -> pa.Table:
            req = json.loads(data)
            if "claim" in req:  # the JSON claim ticket of wire version 1
                raise version_error("claim", 1)
            self.access.check(role, reads=req["columns"])
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
        role = self._role(context)

        def exchange() -> tuple[np.ndarray, int, int, pa.RecordBatch] | DockError:
            put, ticket = decode_exchange(command)
            iteration, ack = decode_put(put)
            req = decode_claim(ticket, self._fixed_parts)
            self._check_put(role, reader.schema.names, ack)
            self.access.check(role, consumer=req.consumer, reads=req.columns)
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

    def _check_put(self, role: str, names: Sequence[str], ack: tuple[str, str] | None) -> None:
        """Raises ``AccessDenied`` unless ``role`` may put the columns ``names`` (and the ``row`` column) and ack as ``ack``'s consumer."""
        self.access.check(role, consumer=None if ack is None else ack[0], writes=[n for n in names if n != ROW])

    def _claim_stream(self, data: bytes, context: flight.ServerCallContext, role: str) -> flight.GeneratorStream:
        req = decode_claim(data, self._fixed_parts)
        self.access.check(role, consumer=req.consumer, reads=req.columns)
        rows, pending, held, batch = self.service.claim_cells(req, context.is_cancelled)
        meta = encode_claim_result(rows, pending, held)
        self._count(len(data) + len(meta))
        # the result as the batch's app_metadata: the batch keeps its (cached) schema, and a stream of a
        # schema object seen before costs the server less than one with per-claim schema metadata
        return flight.GeneratorStream(batch.schema, iter([(batch, pa.py_buffer(meta))]), options=self._ipc)


def _fail(e: DockError) -> NoReturn:
    raise dock_error_to_flight(e)


def _guard(what: str, fn: Callable[[], Any]) -> Any:
    """Run a request; dock errors become their Flight form, malformed requests a DockError."""
    try:
        return fn()
    except AccessDenied as e:
        raise flight.FlightUnauthorizedError(str(e)) from None
    except DockError as e:
        _fail(e)
    except (KeyError, TypeError, json.JSONDecodeError, UnicodeDecodeError, struct.error) as e:
        _fail(DockError(f"dock shard: malformed {what} request ({type(e).__name__}: {e})"))

