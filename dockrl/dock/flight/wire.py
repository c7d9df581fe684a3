"""The dock's Flight messages (``dockrl.dock.flight.shards`` maps the shard's requests onto Flight): the claim
cycle's binary messages, and the dock errors carried by Flight errors.

The binary messages (little-endian ``struct`` headers) carry ``WIRE_VERSION``
(``dockrl.dock.shard.requests``; a shard's ``describe`` answers it): a claim ticket (``encode_claim``: a
``ClaimRequest``), a claim's result (``encode_claim_result``: pending, held and the rows as
ascending runs), a put descriptor (``encode_put``), the descriptor of a put that carries a claim
(``encode_exchange``), and the answer of such a put whose claim failed (``encode_claim_failed``).
A decoder refuses another version, naming both versions.

``DockError`` and ``DockTimeoutError`` raised in the shard travel as ``FlightServerError``
whose message starts with ``dockrl.<type>:`` and whose ``extra_info`` is JSON {type, message}
(``dock_error_to_flight``); ``raise_dock_error`` turns them back into the same exception on the client side.
"""

from __future__ import annotations

import json
import math
import struct

import numpy as np
import pyarrow.flight as flight

from dockrl.dock.errors import DockError, DockTimeoutError
from dockrl.dock.rows import one_run, row_runs, runs_rows
from dockrl.dock.shard.requests import WIRE_VERSION, ClaimRequest  # WIRE_VERSION: of these messages; describe answers it

_ERRORS: dict[str, type[DockError]] = {"DockError": DockError, "DockTimeoutError": DockTimeoutError}

# --- the claim cycle's binary messages ---------------------------------------------------------
# A claim ticket: header, then the lease id, then the request's fixed part (JSON [consumer, owner,
# columns]: the same bytes claim after claim, parsed once per shard). Little-endian throughout.
CLAIM_MAGIC, _PUT_MAGIC = b"dkc", b"dkp"
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
CLAIM_FAILED = 0
"""First byte of the ``app_metadata`` of an exchange whose put landed and whose claim failed (no wire version is 0)."""
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
        CLAIM_MAGIC, WIRE_VERSION, req.iteration, req.limit, req.at_least, math.nan if req.timeout_s is None else req.timeout_s,
        math.nan if req.lease_s is None else req.lease_s, flags, len(lease), len(fixed),
    )
    return head + lease + fixed


SAME_RELEASE = "run clients and shards of the same dockrl release"


def version_error(what: str, version: object, location: str | None = None) -> DockError:
    """The refusal of a message of another wire version, naming both versions.

    ``location`` None: raised by the shard, ``version`` the client's; else raised by the client,
    ``version`` that of the shard at ``location``.
    """
    if location is None:
        return DockError(f"{what}: the client speaks dock wire version {version}; this shard speaks {WIRE_VERSION}: "
                         f"{SAME_RELEASE}")
    return DockError(f"{what}: the dock shard at {location} speaks wire version {version}; this client speaks "
                     f"{WIRE_VERSION}: {SAME_RELEASE}")


def decode_claim(data: bytes, fixed_parts: dict[bytes, tuple[str, str, tuple[str, ...]]]) -> ClaimRequest:
    """The ``ClaimRequest`` of a binary claim ticket; ``fixed_parts`` caches the parsed fixed parts.

    Raises:
        DockError: another wire version, or a malformed ticket.
    """
    if len(data) > 3 and data[3] != WIRE_VERSION:  # the version first: another version may have another header
        raise version_error("claim", data[3])
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
        raise version_error("claim", meta[0], location)
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
        raise version_error("put", command[3])
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
        raise version_error("put", command[3])
    if command[:3] != _EXCHANGE_MAGIC or len(command) < _EXCHANGE_HEAD.size:
        raise DockError(f"dock shard: malformed exchange descriptor ({len(command)} bytes; expected a put that carries a claim)")
    (n_put,) = _EXCHANGE_HEAD.unpack_from(command)[2:]
    end = _EXCHANGE_HEAD.size + n_put
    if len(command) < end:
        raise DockError(f"dock shard: malformed exchange descriptor ({len(command)} bytes; the header says more than {end})")
    return command[_EXCHANGE_HEAD.size:end], command[end:]


def encode_claim_failed(e: DockError) -> bytes:
    """The ``app_metadata`` of an exchange whose put landed and whose claim failed with ``e``."""
    return bytes([CLAIM_FAILED]) + f"{type(e).__name__}: {e}".encode()


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

