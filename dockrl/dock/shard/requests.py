"""The requests of a dock shard as records: what a claim asks (``ClaimRequest``), the ack a put
carries (``ack_of``), the row column of a put's table (``ROW``), where a shard keeps the payload
(``Payload``), and the version of their binary forms over Flight (``WIRE_VERSION``).

``dockrl.dock.shard.service`` documents every request; the front end builds these records, a transport
carries them (``dockrl.dock.shard.transport``, ``dockrl.dock.flight.transport``), and
``ShardService`` answers them.
"""

from __future__ import annotations

from typing import Any, Literal, NamedTuple

from dockrl.dock.shard.controller import DEFAULT_OWNER

ROW = "row"
"""Name of the int64 column of global row indexes in every put table."""
Payload = Literal["memory", "store"]

WIRE_VERSION = 3
"""Version of the binary claim ticket, claim result and put descriptor over Flight (1: the JSON forms before
them; 3: a put may carry the next claim, ``do_exchange``); ``describe`` answers it as ``wire_version`` (a shard of
version 1 leaves it out)."""


class ClaimRequest(NamedTuple):
    """One take on one shard (the ``claim`` request's fields, ``ShardController.take``'s arguments).

    Built by the front end, carried as is in this process (``LocalTransport``), in the binary
    claim ticket over Flight (``dockrl.dock.flight.wire.encode_claim``), or as the JSON body of the
    ``claim`` action (``to_json``/``from_json``).
    """

    iteration: int
    """The iteration the take is for (refused unless it is open on the shard)."""
    consumer: str
    """The consuming stage (one of the schema's consumers); its rows are marked consumed."""
    columns: tuple[str, ...]
    """Columns that must be written for a row to be ready, and that a claim with cells reads."""
    limit: int
    """Rows to take at most (the body's ``count``)."""
    at_least: int
    """Ready rows to wait for: the take blocks until ``min(at_least, rows pending)`` are ready; 0: take what is ready now."""
    whole_groups: bool
    """Take whole groups of ``group_size`` consecutive rows only (``limit`` then a multiple of it)."""
    timeout_s: float | None
    """Seconds the take may block; None: no limit."""
    owner: str
    """Who holds the lease (a worker's id): its heartbeat renews it, ``release_owner`` ends it."""
    lease: str | None
    """Lease id of the rows taken; None: a fresh one."""
    lease_s: float | None
    """Lease term, seconds; None: the shard's default."""
    wait_held: bool
    """With no row pending and ``at_least > 0``, block while other owners hold rows (leased, not acked: they come
    back if their leases end); False: answer at once."""

    @classmethod
    def from_json(cls, req: dict[str, Any]) -> ClaimRequest:
        """From a ``claim`` action body.

        Raises:
            KeyError, TypeError: a required field is missing or not a list of columns.
        """
        return cls(req["iteration"], req["consumer"], tuple(req["columns"]), req["count"], req["at_least"], req["whole_groups"],
                   req["timeout_s"], req.get("owner", DEFAULT_OWNER), req.get("lease"), req.get("lease_s"),
                   req.get("wait_held", True))

    def to_json(self) -> dict[str, Any]:
        """The ``claim`` action body."""
        body = self._asdict() | {"columns": list(self.columns), "count": self.limit}
        del body["limit"]
        return body


def ack_of(body: dict[str, Any]) -> tuple[str, str] | None:
    """The (consumer, lease) of a put body's ``ack`` ({consumer, lease}), or None without one."""
    ack = body.get("ack")
    return None if ack is None else (ack["consumer"], ack["lease"])
