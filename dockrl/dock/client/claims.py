"""``DockClient.claim`` (``dockrl.dock.client.dock_client``): the sweep over the shards, and ``drop``.

**Claims.** The controller path is metadata only: a claim takes row indexes on a shard and,
with the payload in the shards' memory, brings their cells in the same ``do_get`` (the indexes
travel as schema metadata); with a warehouse the ``claim`` action returns the indexes and the
client reads the objects (a put that acks a claim may take the next one: ``dockrl.dock.client.puts``).
A claim sweeps the shards from a rotating start (a random shard for a client's first claim, unless
``first_shard``), taking what is ready without waiting. A client with a locality hint
(``local_shard``: the shard on its own node or pod, whose cells do not cross a network link)
claims from that shard alone, blocking on it, while it has rows left for the consumer (ready or
not); once it has none (empty), the claim steals from the others as below, for what it still
lacks; while short
of ``min(count, rows the consumer has left)`` it blocks server-side on one shard (the one
with most rows left for the consumer; for at least the rows no other shard can cover, else
one row or group) with the remaining deadline, then sweeps the others again: no client
sleep loop. On a timeout or any error the rows taken are released: a failed claim consumes
nothing. Known limit: while blocked on one shard, rows that become ready only on another
are seen when that shard answers or at the deadline (a last sweep runs before timing out).
"""

from __future__ import annotations

import math
import os
import time
from typing import Sequence

import numpy as np
import pyarrow as pa

from dockrl.dock.api import Claim
from dockrl.dock.client.cells import Cells
from dockrl.dock.client.core import ClientCore, Prefetched
from dockrl.dock.client.puts import Puts
from dockrl.dock.errors import DockError, DockTimeoutError
from dockrl.dock.shard.layout import ShardLayout
from dockrl.dock.shard.requests import ClaimRequest


class Claims:
    """``DockClient``'s claims (which start from the rows a put took for them) and drops."""

    def __init__(self, core: ClientCore, cells: Cells, puts: Puts) -> None:
        self.core, self.cells, self.puts = core, cells, puts

    # --- claims -------------------------------------------------------------------------------
    def claim(
        self, consumer: str, columns: Sequence[str], count: int, *, whole_groups: bool = False, timeout_s: float | None = None
    ) -> Claim:
        """Take up to ``count`` rows over all shards, as ``ShardController.take`` does on one.

        Returns rows in ascending order with their cells; an empty claim once ``consumer``
        has taken every row of the iteration.

        Raises:
            DockError: unknown column or consumer, bad count, no open iteration.
            DockTimeoutError: not enough rows became ready in time; names the columns still
                missing on each shard. Nothing is consumed.
        """
        columns = list(columns)
        what = f"claim by {consumer!r}"
        timeout = self.core.timeout_s if timeout_s is None else timeout_s
        deadline = time.monotonic() + timeout
        layout = self.core.layout_for(what)
        shape = (tuple(columns), int(count), bool(whole_groups)) if self.core.prefetch else None
        taken = self.puts.prefetched_for(consumer, shape, layout) if shape is not None and self.core.prefetched else None
        try:
            claim = self._claim(layout, consumer, columns, count, whole_groups, timeout, deadline, taken, shape)
        except DockError as e:
            open_now = [] if isinstance(e, DockTimeoutError) or layout.iteration == self.core.confirmed else \
                [m["iteration"] for m in self.core.describe_all(0)]
            # closed (maybe still closing), still open, or the one this client opened or waited for: never another's rows
            if not open_now or layout.iteration in open_now:
                raise
            # the iteration this client knew was closed and another opened: claim from that one
            claim = self._claim(self.core.layout_for(what, fresh=True), consumer, columns, count, whole_groups, timeout, deadline,
                                None, shape)
        return claim  # held (renewed) since its first rows were taken

    def _claim(
        self, layout: ShardLayout, consumer: str, columns: list[str], count: int, whole_groups: bool,
        timeout: float, deadline: float, prefetched: Prefetched | None = None,
        shape: tuple[tuple[str, ...], int, bool] | None = None,
    ) -> Claim:
        unit = layout.group_size if whole_groups else 1
        active = layout.active
        with self.core.lock:
            first, self.core.next_shard = self.core.next_shard % len(active), self.core.next_shard + 1
        order = active[first:] + active[:first]
        local = self.core.local_shard if self.core.local_shard in active else None
        if local is not None:  # the co-located shard first: the others are swept (stolen from) only for what it lacks
            order.remove(local)
            order.insert(0, local)
        lease = os.urandom(16).hex() if prefetched is None else prefetched.lease  # as uuid4().hex, without building a UUID
        names = tuple(columns)
        taken: dict[int, list[np.ndarray]] = {}  # rows of each take (global, ascending), by shard
        pending: dict[int, int] = {}
        held: dict[int, int] = {}  # rows of the consumer other owners lease, by shard: they may come back
        cells: dict[int, list[pa.Table | pa.RecordBatch]] = {}  # memory payload: the cells each take brought along, by shard
        got = 0  # rows taken so far
        if prefetched is not None:  # the first take, done by the put that acked the previous claim
            p = prefetched.shard
            taken[p], pending[p], held[p], cells[p] = [prefetched.rows], prefetched.pending, prefetched.held, [prefetched.cells]
            got = len(prefetched.rows)

        def take(s: int, limit: int, at_least: int, wait_s: float = 0.0, wait_held: bool = False) -> None:
            nonlocal got
            finite = math.isfinite(wait_s)
            req = ClaimRequest(layout.iteration, consumer, names, int(limit), at_least, whole_groups, wait_s if finite else None,
                               self.core.owner, lease, self.core.lease_s, wait_held)
            rpc = wait_s + self.core.rpc_timeout_s if finite else None
            if self.core.warehouse is None:  # claim and read in one call
                rows, pending[s], held[s], table = self.core.transports[s].claim_cells(req, rpc)
                cells.setdefault(s, []).append(table)
            else:
                res = self.core.action(s, "claim", req.to_json(), timeout=rpc)
                rows, pending[s], held[s] = np.asarray(res["rows"], dtype=np.int64), res["pending"], res.get("held", 0)
            taken.setdefault(s, []).append(rows)
            if len(rows):  # renewed from now on: the claim may still wait on other shards for longer than a term
                got += len(rows)
                self.core.hold(lease, layout.iteration)

        try:
            if local is not None:  # the co-located shard alone while it has rows left for the consumer, ready or not
                if local not in pending:  # (a put to it may have taken the first rows: then it was asked)
                    take(local, count - got, at_least=0)
                try:
                    while got < count and pending[local] > 0:
                        take(local, count - got, min(pending[local], count - got), max(deadline - time.monotonic(), 0.0))
                except DockTimeoutError:
                    pass  # the sweep below looks at every other shard once more, then raises the claim's timeout
            for i, s in enumerate(order):  # sweep: take what is ready now (the first shard checks the request)
                if s in pending:  # asked already: the local shard, or the one a put asked
                    continue
                if (i == 0 and not pending) or got < count:
                    take(s, count - got, at_least=0)
            want = min(count, got + sum(pending.values()))
            # block while short of rows the consumer still has pending, or, with nothing to take at all,
            # while other owners hold rows (an empty claim means the consumer is done)
            while got < want or (got == 0 and sum(held.values()) > 0):
                if got < want:
                    left = [s for s in order if pending.get(s, 0) > 0]
                    # the local shard while it has rows left for the consumer, else the first of the most loaded shards
                    s = local if local in left else max(left, key=lambda t: pending[t])
                    others = sum(pending[t] for t in left if t != s)
                    at_least, wait_held = max(unit, min(pending[s], want - got - others)), False
                else:
                    left = [s for s in order if held.get(s, 0) > 0]
                    s = max(left, key=lambda t: held[t])
                    at_least, wait_held = unit, True
                try:
                    take(s, count - got, at_least, max(deadline - time.monotonic(), 0.0), wait_held)
                except DockTimeoutError:
                    for t in order:  # a last look at the other shards before giving up
                        if t != s and got < count:
                            take(t, count - got, at_least=0)
                    if got < want or got == 0:
                        raise self._timeout(layout, consumer, columns, timeout, want, got, pending, held) from None
                    break
                for t in order:  # rows held elsewhere may have come back too (leases of one claim expire together)
                    if t != s and got < count and (pending.get(t, 0) > 0 or held.get(t, 0) > 0):
                        take(t, count - got, at_least=0)
                want = min(count, got + sum(pending.values()))  # other clients of this consumer may take rows too
            # shards hold ascending ranges, and one take's rows come ascending: rows come out ascending
            shards = [s for s in sorted(taken) if any(len(r) for r in taken[s])]
            parts = [taken[s][0] if len(taken[s]) == 1 else np.sort(np.concatenate(taken[s])) for s in shards]
            if self.core.warehouse is None:
                batches = [self.cells.batch(cells[s], columns, None if len(cells[s]) == 1 else np.concatenate(taken[s])) for s in shards]
                batch = batches[0] if len(batches) == 1 else self.cells.batch([pa.Table.from_batches([b]) for b in batches], columns)
            else:
                batch = self.cells.batch(self.cells.gather(layout, columns, {s: r.tolist() for s, r in zip(shards, parts)}), columns)
        except BaseException:
            self.core.release(layout.iteration, consumer, {s: np.concatenate(r).tolist() for s, r in taken.items()}, lease)
            self.core.heartbeat.drop(lease)
            raise
        row_array = parts[0] if len(parts) == 1 else np.concatenate([np.zeros(0, dtype=np.int64), *parts])
        claimed = row_array.tolist()
        # with ``shape``, the put that acks the claim carries the next claim of that shape
        return Claim(layout.iteration, claimed, batch, lease if claimed else "", consumer, row_array, shape if claimed else None)

    def _timeout(
        self, layout: ShardLayout, consumer: str, columns: list[str], timeout: float, want: int, ready: int,
        pending: dict[int, int], held: dict[int, int],
    ) -> DockTimeoutError:
        """The timeout error of a claim, with the columns each shard still lacks for ``consumer``."""
        missing = {}
        for s in sorted(t for t, n in pending.items() if n):
            lacking = self.core.action(s, "missing", {"iteration": layout.iteration, "consumer": consumer, "columns": columns})
            if lacking:
                missing[f"shard {s} at {self.core.locations[s]}"] = lacking
        held_note = (
            f"; {sum(held.values())} rows are leased by other owners and not yet acked (they come back if their "
            "leases expire or are released)" if sum(held.values()) else ""
        )
        return DockTimeoutError(
            f"claim by {consumer!r} timed out after {timeout:.1f}s in iteration {layout.iteration}: "
            f"wanted {want} rows ready in {columns}, {ready} ready; columns still missing (rows lacking) by shard: "
            f"{missing}{held_note}"
        )

    def drop(self, rows: Sequence[int], *, iteration: int | None = None) -> None:
        """Take ``rows`` out of the iteration for every consumer that has not taken them, on the
        shards owning them (``ShardController.drop``).

        Raises:
            DockError: row out of range or repeated, no open iteration, or another one open.
        """
        rows_arr = np.asarray(rows, dtype=np.int64)
        layout = self.core.layout_for("drop", iteration)
        for s, pos in layout.split(rows_arr).items():
            if len(pos):
                self.core.action(s, "drop", {"iteration": layout.iteration, "rows": rows_arr[pos].tolist()})
