"""The leases of one iteration table: granting, holding, acking, ending and renewing them.

A take is a lease: for each (row, consumer) it took, the controller records the ``lease`` id,
its ``owner`` (the claiming client; ``DEFAULT_OWNER`` of ``dockrl.dock.shard.controller`` if
none) and an expiry ``lease_s`` seconds ahead. The consumer acks (``ack``) after its put, which
ends the lease for good. ``renew`` pushes the expiry of every lease of an owner ahead (the
networked client does it from a heartbeat thread); the controller's ``release_owner`` ends them
at once (a launcher that saw the owner's process die). A lease that ends without an ack
(``end_lease``: expiry, ``release_owner``, ``restore``) returns its rows to the ready pool,
except rows whose output columns for that consumer (schema columns whose producer is the
consumer) are all written: the put is the commit, so those rows count as acked and are not
computed twice.

The rows other owners hold are counted as leases change (``Lease.undone``, ``recount``), never
recounted per take. Every function changes the ``IterationTable`` it is given and nothing else:
the caller (``ShardController``) holds its lock, reads the clock (``now``, ``time.monotonic``),
counts and wakes the blocked takes.
"""

from __future__ import annotations

import heapq
import logging
from typing import Mapping, Sequence

import numpy as np

from dockrl.dock.errors import DockError
from dockrl.dock.shard.iteration import IterationTable
from dockrl.dock.shard.records import Lease

logger = logging.getLogger(__name__)


def grant(
    it: IterationTable, ci: int, rows: np.ndarray, owner: str, lease_id: str, term: float, whole_groups: bool, now: float,
    run: tuple[int, int] | None = None,
) -> None:
    """Lease ``rows`` (local, ascending; ``run``: they are the range ``[start, stop)``) to ``owner`` under ``lease_id``
    until ``now + term``; taking again under a live id adds the rows to it and renews it."""
    idx = rows if run is None else slice(*run)
    lease = it.leases.get(lease_id)
    new = lease is None
    if lease is None:
        num = it.lease_num.setdefault(lease_id, len(it.lease_num))
        lease = it.leases[lease_id] = it.live[num] = Lease(lease_id, num, owner, ci, term, 0.0, rows, whole_groups)
        it.by_owner.setdefault(owner, set()).add(lease_id)
    elif len(lease.rows) and rows[0] > lease.rows[-1]:  # rows are new to it (taken now): keep them ascending
        lease.rows = np.concatenate([lease.rows, rows])
    else:
        lease.rows = np.sort(np.concatenate([lease.rows, rows]))
    lease.whole_groups |= whole_groups
    lease.expiry = now + term
    heapq.heappush(it.expiries, (lease.expiry, lease.num))
    it.lease_at[idx, ci] = lease.num
    # a new lease of rows none of which is finished (the usual take) holds all of them: no recount
    recount(it, lease, len(rows) if new and not it.fin[idx, ci].any() else None)


def recount(it: IterationTable, lease: Lease, undone: int | None = None) -> None:
    """Set ``lease.undone`` (default: count it now) and the held totals with it."""
    if undone is None:
        undone = len(lease.rows) - int(np.count_nonzero(lease_done(it, lease)[1]))
    delta, lease.undone = undone - lease.undone, undone
    if delta:
        it.undone[lease.consumer] += delta
        by = it.undone_by[lease.consumer]
        by[lease.owner] = by.get(lease.owner, 0) + delta


def drop_lease(it: IterationTable, lease: Lease) -> None:
    """Remove a lease from the live ones (its rows were detached or are being handled by the caller)."""
    recount(it, lease, 0)
    del it.leases[lease.id], it.live[lease.num]
    ids = it.by_owner[lease.owner]
    ids.discard(lease.id)
    if not ids:
        del it.by_owner[lease.owner]


def unlease(it: IterationTable, ci: int, local: np.ndarray, num: int | None = None, idx: np.ndarray | slice | None = None) -> None:
    """Detach rows from their leases (an ack or a release); drop leases left empty.

    ``num``: every row is held under that lease number (the caller checked); ``idx``: the rows as an index.
    """
    if num is not None and len(local):
        it.lease_at[local if idx is None else idx, ci] = -1
        lease = it.live[num]
        if len(local) == len(lease.rows):  # every row of the lease (its rows are distinct): it is over
            drop_lease(it, lease)
        else:
            lease.rows = np.setdiff1d(lease.rows, local, assume_unique=True)
            recount(it, lease)
        return
    nums = it.lease_at[local, ci]
    leased = nums >= 0
    local, nums = local[leased], nums[leased]
    if not len(local):
        return
    it.lease_at[local, ci] = -1
    same = bool((nums == nums[0]).all())  # the usual ack: the rows of one lease
    for num in ([int(nums[0])] if same else np.unique(nums).tolist()):
        lease = it.live[num]
        mine = local if same else local[nums == num]
        if len(mine) == len(lease.rows):  # every row of the lease (its rows are distinct): it is over
            drop_lease(it, lease)
        else:
            lease.rows = np.setdiff1d(lease.rows, mine, assume_unique=True)
            recount(it, lease)


def release(it: IterationTable, ci: int, local: np.ndarray, lease: str | None, what: str) -> bool:
    """Hand local rows taken by consumer ``ci`` back, as if never taken; with ``lease``, only those
    still held under it (the caller ended the expired leases first). Returns whether any went back.

    Raises:
        DockError: without ``lease``, a row not taken by the consumer or already acked.
    """
    if lease is not None:
        local = local[it.lease_at[local, ci] == it.lease_num.get(lease, -2)]  # -2: an id never seen matches no row
        if not len(local):
            return False
    not_taken = ~it.consumed[local, ci]
    if not_taken.any():
        raise DockError(f"{what}: rows {(local[not_taken] + it.first_row)[:10].tolist()} were not taken by it")
    acked = it.acked[local, ci]
    if acked.any():
        raise DockError(f"{what}: rows {(local[acked] + it.first_row)[:10].tolist()} are already acked")
    unlease(it, ci, local)
    it.set_consumed(ci, local, False)
    return True


def lease_done(it: IterationTable, lease: Lease) -> tuple[np.ndarray, np.ndarray]:
    """The lease's rows (local, ascending) and which count as finished if it ended now.

    A whole-group lease finishes group by group (a group with any row unfinished goes
    back whole), so whole-group claims never meet a partial group.
    """
    rows = lease.rows
    done = it.fin[rows, lease.consumer]
    if lease.whole_groups and len(rows) and done.any() and not done.all():
        groups = rows // it.group_size
        unfinished = np.unique(groups[~done])
        done &= ~np.isin(groups, unfinished)
    return rows, done


def end_lease(it: IterationTable, lease: Lease, why: str) -> int:
    """End an un-acked lease (``why``: for the warning it logs): finished rows count as acked, the
    others go back to the ready pool. Returns the rows returned to the pool."""
    rows, done = lease_done(it, lease)
    drop_lease(it, lease)
    # an id can end more than once (a sharded claim takes rows under its id again after an
    # expiry): a late ack must still find the rows of every end
    ended_ci, ended = it.ended.get(lease.id, (lease.consumer, np.zeros(0, dtype=np.int64)))
    it.ended[lease.id] = (lease.consumer, np.union1d(ended, rows) if ended_ci == lease.consumer else rows)
    it.lease_at[rows, lease.consumer] = -1
    it.acked[rows[done], lease.consumer] = True
    it.acked_by[rows[done], lease.consumer] = lease.num
    it.set_consumed(lease.consumer, rows[~done], False)
    logger.warning(
        "lease %s of owner %r (consumer %r, iteration %d) %s: %d rows back to the ready pool, %d finished",
        lease.id, lease.owner, it.consumers[lease.consumer], it.iteration, why, int((~done).sum()), int(done.sum()),
    )
    return int((~done).sum())


def pop_expired(it: IterationTable, now: float) -> list[Lease]:
    """The live leases past their expiry at ``now``, by lease number, taken off the expiry heap
    (with the stale entries of leases ended or renewed since); the caller ends them."""
    heap = it.expiries
    expired: dict[int, Lease] = {}
    while heap:
        expiry, num = heap[0]
        lease = it.live.get(num)
        if lease is None or lease.expiry != expiry:  # ended, or renewed since: a stale entry
            heapq.heappop(heap)
        elif expiry <= now:
            heapq.heappop(heap)
            expired[num] = lease
        else:
            break
    return [expired[num] for num in sorted(expired)]


def renew(it: IterationTable, owner: str, now: float) -> int:
    """Push the expiry of every lease of ``owner`` a full term past ``now``; returns how many."""
    ids = it.by_owner.get(owner, ())
    for lease_id in ids:
        lease = it.leases[lease_id]
        lease.expiry = now + lease.term_s
        heapq.heappush(it.expiries, (lease.expiry, lease.num))
    return len(ids)


def mark_written(
    it: IterationTable, rows: np.ndarray, names: Sequence[str] | Mapping[str, object], acking: tuple[int, int] | None = None,
    run: tuple[int, int] | None = None,
) -> tuple[set[int], bool]:
    """Cells of ``names`` written for ``rows`` (local; ``run``: they are the range ``[start, stop)``, ascending):
    readiness, and the leases whose rows finished (they no longer count as held: ``recount``).

    ``acking=(consumer, lease number)``: the caller acks ``rows`` under that lease next (no recount for
    it). Returns the consumers whose takes may proceed now, and whether every row is held under
    that lease (False without ``acking``).
    """
    woken: set[int] = set()
    finishing: set[int] = set()
    held_all = False
    for name in names:
        col = it.col_index[name]
        if name in it.rewritable:  # once per cell
            woken |= it.set_ready(col, rows[~it.ready[rows, col]])
        else:
            woken |= it.set_ready(col, rows, run)
        finishing.update(it.output_of[col])
    for ci in finishing:  # rows a consumer's outputs finished no longer count as held by its lease
        nums = it.lease_at[rows if run is None else slice(*run), ci]
        if acking is not None and acking[0] == ci and (nums == acking[1]).all():
            held_all = True
            continue  # the ack that follows ends the lease's hold on them
        for num in np.unique(nums[nums >= 0]).tolist():
            recount(it, it.live[num])
        woken.add(ci)
    return woken, held_all


def ack(
    it: IterationTable, consumer: str, lease: str, local: np.ndarray, held_all: bool = False, run: tuple[int, int] | None = None,
) -> str | None:
    """Ack checked local rows of ``consumer`` taken under ``lease``; returns what was refused, or None.

    ``held_all``: the caller saw every row held under ``lease`` and no lease ended since; ``run``:
    the rows are the range ``[start, stop)``, ascending. A lease that already ended (expired, or
    its owner released) is still accepted for rows it finished or that nobody re-claimed since;
    the other rows are acked even when some are refused.
    """
    ci = it.consumer_index[consumer]
    num = it.lease_num.get(lease, -2)  # -2: an id never seen here matches no row
    if held_all:
        idx = local if run is None else slice(*run)
        unlease(it, ci, local, num, idx)
        it.acked[idx, ci] = True
        it.acked_by[idx, ci] = num
        return None
    held = it.lease_at[local, ci] == num
    if held.all():  # the usual ack: every row still held under the lease
        unlease(it, ci, local, num)
        it.acked[local, ci] = True
        it.acked_by[local, ci] = num
        return None
    done = it.acked_by[local, ci] == num  # acked before, or finished when the lease ended
    ended_ci, ended = it.ended.get(lease, (ci, None))
    was_leased = np.isin(local, ended) if ended is not None and ended_ci == ci else np.zeros(len(local), dtype=bool)
    late = was_leased & ~it.consumed[local, ci]  # back in the pool and not re-claimed: a late ack still counts
    bad = ~(held | done | late)
    unlease(it, ci, local[held])
    ok = local[~bad]
    it.set_consumed(ci, ok[~it.consumed[ok, ci]], True)
    it.acked[ok, ci] = True
    it.acked_by[ok, ci] = num
    errors = []
    if (bad & was_leased).any():
        errors.append(
            f"lease {lease!r} ended before this ack (it expired or its owner was released) and rows "
            f"{(local[bad & was_leased] + it.first_row)[:10].tolist()} were re-delivered to another claim of "
            f"{consumer!r}; keep workers renewing their leases (DockClient does, while its process lives) "
            "or raise lease_s"
        )
    if (bad & ~was_leased).any():
        errors.append(
            f"rows {(local[bad & ~was_leased] + it.first_row)[:10].tolist()} are not leased to {consumer!r} under "
            f"lease {lease!r} in iteration {it.iteration} (never granted here, or granted before a restore, which "
            "returned its rows to the pool to be re-delivered)"
        )
    return "; ".join(errors) or None
