"""A claim and its ack on one shard's controller, made of the calls its ``ShardService`` makes.

The controller tests drive a ``ShardController`` directly (no front end in between): a claim
is ``take(..., read=True)`` under a fresh lease id of ``owner``, and its ack is ``ack_rows``.
"""

from __future__ import annotations

import uuid
from collections.abc import Sequence

import pyarrow as pa

from dockrl.dock import Claim
from dockrl.dock.shard.controller import DEFAULT_OWNER, ShardController


def claim(
    ctl: ShardController, consumer: str, columns: Sequence[str], count: int, *, whole_groups: bool = False,
    timeout_s: float | None = None, owner: str = DEFAULT_OWNER, lease_s: float | None = None,
) -> Claim:
    """Take up to ``count`` rows of ``consumer`` and their cells of ``columns`` (blocks as the front end's claim)."""
    iteration = -1 if ctl._it is None else ctl._it.iteration  # take fails naming it when none is open
    taken = ctl.take(consumer, columns, count, whole_groups=whole_groups, timeout_s=timeout_s, owner=owner,
                     lease=uuid.uuid4().hex, lease_s=lease_s, read=True)
    assert isinstance(taken.batch, pa.RecordBatch)
    if not taken.rows:
        return Claim(iteration, [], taken.batch, consumer=consumer)
    return Claim(iteration, taken.rows, taken.batch, taken.lease, consumer)


def ack(ctl: ShardController, c: Claim) -> None:
    """End the claim's lease for good (after its put); an empty claim is a no-op."""
    if c.rows:
        ctl.ack_rows(c.consumer, c.lease, c.rows, iteration=c.iteration)
