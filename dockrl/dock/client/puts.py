"""``DockClient.put`` (``dockrl.dock.client.dock_client``), and the claims that ride on its puts.

``put(..., ack=claim)`` acks with the put, one round trip per shard.
**Claims ride on puts** (``prefetch``, memory payload, in the iteration the client opened or
waited for): that put also takes the consumer's next claim of the same shape (columns, count,
whole groups) on one shard it goes to (with a locality hint the local one only), what is ready
now, under a fresh lease, and brings its cells back in the same round trip (a Flight
``do_exchange``); the stage's next ``claim`` of that shape starts from those rows, so a stage's
claim cycle (claim, compute, put with the ack) costs one round trip, not two. The rows are
leased (and renewed) from the put on until this client claims again; a claim of another shape by
the same consumer or in another iteration, or ``close()``, hands back those still under that
lease at once.
"""

from __future__ import annotations

import logging
import os
from typing import Any, Sequence

import numpy as np
import pyarrow as pa

from dockrl.dock.api import Claim, Columns
from dockrl.dock.cells import arrow_columns
from dockrl.dock.client.cells import Cells, part
from dockrl.dock.client.core import ClientCore, Prefetched
from dockrl.dock.errors import DockError
from dockrl.dock.shard.layout import ShardLayout
from dockrl.dock.shard.requests import ClaimRequest

logger = logging.getLogger(__name__)


_RELEASE_TIMEOUT_S = 10.0
"""Longest wait, seconds, for a shard to take back rows a put took for a claim that will not use them (``close``
must not hang on a shard that is gone: the rows' lease ends at its term anyway)."""


class Puts:
    """``DockClient``'s puts, and the rows a put takes for the consumer's next claim."""

    def __init__(self, core: ClientCore, cells: Cells) -> None:
        self.core, self.cells = core, cells

    # --- writes ----------------------------------------------------------------------------------
    def put(self, rows: Sequence[int], columns: Columns, *, iteration: int | None = None, ack: Claim | None = None) -> None:
        """Write cells, sending each shard the rows it owns (``ShardController.put`` semantics).

        With ``iteration`` the put is refused unless that iteration is the open one. With
        ``ack`` the claim is acked once the put succeeded: when the put covers exactly the
        claim's rows each shard acks its part with the put itself (one call per shard instead
        of two), else ``put`` then ``ack``.

        Raises:
            DockError: as ``ShardController.put`` and ``ack_rows``, or the iteration was closed since
                this client learnt it; atomic per shard only.
        """
        kept = ack.row_array if ack is not None and rows is ack.rows else None  # put(claim.rows, ..., ack=claim)
        rows_arr = kept if kept is not None and len(kept) == len(rows) else np.asarray(rows, dtype=np.int64)
        arrays = arrow_columns(self.core.schema, columns, len(rows_arr))
        layout = self.core.layout_for("put", iteration)
        fused = (ack is not None and len(ack.rows) > 0 and ack.iteration == layout.iteration
                 and (rows is ack.rows or np.array_equal(rows_arr, ack.rows)
                      or np.array_equal(np.sort(rows_arr), np.sort(np.asarray(ack.rows, dtype=np.int64)))))
        lease = ack.lease if ack is not None else ""
        extra = {"ack": {"consumer": ack.consumer, "lease": lease}} if fused and ack is not None else {}
        try:
            if self.core.warehouse is not None:
                self.cells.put_objects(self.core.warehouse, layout, rows_arr, arrays, extra)
            else:
                schema = self.cells.put_schema(tuple(arrays))
                parts: dict[int, np.ndarray | None] = {}  # no rows: no call
                if len(rows_arr):  # positions each shard owns; None: every row (one shard: no split)
                    parts = {0: None} if layout.num_shards == 1 else dict(layout.split(rows_arr))
                # the shard whose put carries the next claim: with a locality hint the local one only (a claim
                # steals from the others only for what the local one lacks), else the last one the put goes to
                carrier = None
                if fused and self.core.prefetch and ack is not None and ack.shape is not None and parts and layout.iteration == self.core.confirmed:
                    carrier = list(parts)[-1] if self.core.local_shard is None else self.core.local_shard if self.core.local_shard in parts else None
                if carrier is not None:
                    parts[carrier] = parts.pop(carrier)  # last: a put refused by another shard carries no claim
                for s, pos in parts.items():
                    if pos is None or len(pos) == len(rows_arr):  # one shard owns every row: the arrays as they are
                        columns_out = [pa.array(rows_arr), *arrays.values()]
                    else:
                        columns_out = [pa.array(rows_arr[pos]), *(part(a, pos) for a in arrays.values())]
                    batch = pa.RecordBatch.from_arrays(columns_out, schema=schema)
                    body = {"iteration": layout.iteration} | extra
                    if s == carrier and ack is not None and ack.shape is not None:
                        self.put_claim(s, body, batch, layout, ack.consumer, ack.shape)
                    else:
                        self.core.transports[s].put(body, batch, self.core.rpc_timeout_s)
        finally:
            if fused:  # acked with the put (or failed as an ack fails): stop renewing its lease
                self.core.heartbeat.drop(lease)
        if ack is not None and not fused:
            self.core.ack(ack)

    def put_claim(
        self, s: int, body: dict[str, Any], batch: pa.RecordBatch, layout: ShardLayout, consumer: str,
        shape: tuple[tuple[str, ...], int, bool],
    ) -> None:
        """Put ``batch`` on shard ``s`` carrying the next claim of ``shape`` for ``consumer``; keep what it took.

        Raises:
            as the put (when it did not land, or its answer was lost: rows the claim may have taken go back).
        """
        names, count, whole_groups = shape
        iteration, lease = layout.iteration, os.urandom(16).hex()
        req = ClaimRequest(iteration, consumer, names, count, 0, whole_groups, 0.0, self.core.owner, lease, self.core.lease_s, False)

        def give_back() -> None:  # rows the claim took that this client does not know of: all of the shard's under the lease
            self.core.release(iteration, consumer, {s: list(range(*layout.ranges[s]))}, lease, min(self.core.rpc_timeout_s, _RELEASE_TIMEOUT_S))

        try:
            result = self.core.transports[s].put_claim(body, batch, req, self.core.rpc_timeout_s)
        except BaseException:  # the put did not land, or its answer was lost after it did
            give_back()
            raise
        if isinstance(result, DockError):  # the put landed, the claim did not (or its answer was incomplete)
            logger.debug("the claim a put carried failed (the next claim is its own call): %s", result)
            give_back()
            return
        rows, pending, held, cells = result
        taken = Prefetched(shape, iteration, s, lease, rows, pending, held, cells)
        if len(rows):
            self.core.hold(lease, iteration)
        with self.core.lock:
            left = [self.core.prefetched.pop(consumer, None)]  # put twice without a claim between: the older rows go back
            if self.core.closed:  # closed meanwhile: these too
                left.append(taken)
            else:
                self.core.prefetched[consumer] = taken
        for t in left:
            if t is not None:
                self.drop_prefetched(consumer, t)

    def prefetched_for(self, consumer: str, shape: tuple[tuple[str, ...], int, bool], layout: ShardLayout) -> Prefetched | None:
        """The rows a put took for ``consumer``'s claim of ``shape`` in ``layout``'s iteration, if any: only in the
        iteration this client opened or waited for (another may have opened since); other rows go back."""
        with self.core.lock:
            taken = self.core.prefetched.pop(consumer, None)
        if taken is not None and (taken.shape != shape or taken.iteration != layout.iteration or layout.iteration != self.core.confirmed):
            self.drop_prefetched(consumer, taken)
            taken = None
        return taken

    def drop_prefetched(self, consumer: str, taken: Prefetched) -> None:
        """Hand rows a put took for a claim that will not use them back to their shard (best effort: else at lease expiry)."""
        self.core.heartbeat.drop(taken.lease)
        if len(taken.rows):
            self.core.release(taken.iteration, consumer, {taken.shard: taken.rows.tolist()}, taken.lease,
                          min(self.core.rpc_timeout_s, _RELEASE_TIMEOUT_S))

    def forget_prefetched(self, iteration: int | None) -> None:
        """Forget what puts took in ``iteration`` (None: in every one): it was closed or replaced, its leases are gone."""
        with self.core.lock:
            gone = {c: t for c, t in self.core.prefetched.items() if iteration is None or t.iteration == iteration}
            for c in gone:
                del self.core.prefetched[c]
        self.core.heartbeat.drop(*(t.lease for t in gone.values()))

