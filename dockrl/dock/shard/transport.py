"""How a front end reaches a dock shard: the ``ShardTransport`` protocol, and ``LocalTransport``,
which calls a ``ShardService`` of this process directly (``dock.mode=inprocess``); ``local_shards``
builds such shards. Over Arrow Flight it is ``FlightTransport`` (``dockrl.dock.flight.transport``).
"""

from __future__ import annotations

from typing import Any, Literal, Protocol

import numpy as np
import pyarrow as pa

from dockrl.dock.errors import DockError
from dockrl.dock.schema import Schema
from dockrl.dock.shard.requests import ClaimRequest, Payload, ack_of
from dockrl.dock.shard.service import ShardService


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
