"""Tests of the sharded transfer dock: DockClient over Arrow Flight shards behaves as the in-process dock.

Every test on the ``client`` fixture runs with the payload in the shards' memory (1 and 3
shards) and in a warehouse (2 metadata-only shards; an S3 server, a local directory).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.flight as flight
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from dockrl.config import DockConfig
from dockrl.dock import GRPO_SCHEMA, Claim, DockError, DockTimeoutError, open_dock
from dockrl.dock.client.dock_client import DockClient
from dockrl.dock.flight.server import DockShardServer
from dockrl.dock.flight.shards import serve_shard, start_local_shards
from dockrl.dock.flight.transport import FlightTransport
from dockrl.dock.flight.wire import (
    claim_fixed_part,
    decode_claim,
    decode_claim_result,
    decode_exchange,
    decode_put,
    dock_error_to_flight,
    encode_claim,
    encode_claim_result,
    encode_exchange,
    encode_put,
    raise_dock_error,
)
from dockrl.dock.shard.layout import shard_ranges
from dockrl.dock.shard.requests import WIRE_VERSION, ClaimRequest
from dockrl.dock.warehouse.base import Warehouse
from dockrl.dock.warehouse.stores import DirectoryWarehouse

TOKEN = "test-token"
TOKENS = pa.list_(pa.int32())
LOGPROBS = pa.list_(pa.float32())


@pytest.fixture(scope="module")
def shards() -> Iterator[dict[int, list[str]]]:
    """Shard servers for 1, 2 and 3-shard docks, started once for the module."""
    servers: list[DockShardServer] = []
    locations: dict[int, list[str]] = {}
    for n in (1, 2, 3):
        started, locations[n] = start_local_shards(n, GRPO_SCHEMA, token=TOKEN)
        servers += started
    yield locations
    for server in servers:
        server.close()


@pytest.fixture(scope="module")
def store_shards() -> Iterator[list[str]]:
    """Two metadata-only shards (payload in a warehouse), started once for the module."""
    servers, locations = start_local_shards(2, GRPO_SCHEMA, token=TOKEN, payload="store")
    yield locations
    for server in servers:
        server.close()


def connect(locations: list[str], timeout_s: float = 5.0, warehouse: Warehouse | None = None) -> DockClient:
    return DockClient(locations, GRPO_SCHEMA, token=TOKEN, timeout_s=timeout_s, rpc_timeout_s=10.0, warehouse=warehouse,
                      first_shard=0)  # these tests name the rows a claim over several shards gets


def another(dock: DockClient) -> DockClient:
    """A second client of the same dock (another worker)."""
    return connect(dock.locations, warehouse=dock.warehouse)


@pytest.fixture(params=["1shard", "3shards", "2shards-s3", "2shards-directory"])
def client(
    request: pytest.FixtureRequest, shards: dict[int, list[str]], store_shards: list[str], tmp_path
) -> Iterator[DockClient]:
    if request.param.endswith("s3"):
        dock = connect(store_shards, warehouse=request.getfixturevalue("s3_server").warehouse())
    elif request.param.endswith("directory"):
        dock = connect(store_shards, warehouse=DirectoryWarehouse(tmp_path / "warehouse"))
    else:
        dock = connect(shards[int(request.param[0])])
    yield dock
    dock.close_iteration()
    dock.close()


def prompt_cell(row: int) -> list[int]:
    return [row, row + 100, row + 200][: 1 + row % 3]


def put_prompts(dock: DockClient, rows) -> None:
    rows = list(rows)
    dock.put(rows, {"prompt_ids": [prompt_cell(r) for r in rows]})


def drain(dock: DockClient, consumer: str, columns: list[str], count: int, **kw) -> list[Claim]:
    claims = []
    while claim := dock.claim(consumer, columns, count, **kw):
        claims.append(claim)
        assert len(claims) <= dock.num_rows, "claims never ran dry"
    return claims


# --- delivery and grouping -------------------------------------------------------------------


def test_row_to_shard_mapping_is_contiguous_whole_groups():
    assert shard_ranges(12, 2, 3) == [(0, 4), (4, 8), (8, 12)]
    assert shard_ranges(10, 2, 3) == [(0, 2), (2, 6), (6, 10)]
    assert shard_ranges(2, 2, 3) == [(0, 0), (0, 0), (0, 2)]  # fewer groups than shards


def test_each_consumer_gets_every_row_exactly_once(client):
    client.open_iteration(0, 12, 2)
    put_prompts(client, range(12))
    client.put(range(12), {"ground_truth": [str(r) for r in range(12)]})
    for consumer in ("reward", "reference"):
        claims = drain(client, consumer, ["prompt_ids", "ground_truth"], 5)
        assert [len(c) for c in claims] == [5, 5, 2]
        assert sorted(r for c in claims for r in c.rows) == list(range(12))
        for c in claims:
            assert c.iteration == 0 and c.rows == sorted(c.rows)
            assert c.batch.column("prompt_ids").to_pylist() == [prompt_cell(r) for r in c.rows]
            assert c.batch.column("ground_truth").to_pylist() == [str(r) for r in c.rows]
    empty = client.claim("reward", ["prompt_ids", "response_ids"], 4)
    assert empty.rows == [] and empty.batch.num_rows == 0 and empty.batch.schema.names == ["prompt_ids", "response_ids"]
    stats = client.stats()
    assert stats["dock/controller_bytes"] > 0
    if client.warehouse is None:
        assert stats["dock/bytes_put"] > 0 and stats["dock/bytes_read"] > 0
    else:  # no payload through the shards: it went to the store and came back from it
        assert stats["dock/bytes_put"] == stats["dock/bytes_read"] == 0
        assert stats["dock/store_bytes_written"] > 0 and stats["dock/store_bytes_read"] > 0


def test_whole_groups_never_returns_a_partial_group(client):
    client.open_iteration(0, 12, 4)
    put_prompts(client, [0, 1, 2, 4, 5, 6, 7, 9, 10])  # only group 1 (rows 4..7) is complete
    assert client.claim("rollout", ["prompt_ids"], 4, whole_groups=True).rows == [4, 5, 6, 7]
    with pytest.raises(DockTimeoutError):
        client.claim("rollout", ["prompt_ids"], 4, whole_groups=True, timeout_s=0.2)
    put_prompts(client, [3, 8, 11])
    last = client.claim("rollout", ["prompt_ids"], 12, whole_groups=True)
    assert last.rows == [0, 1, 2, 3, 8, 9, 10, 11]  # min(count, rows left): the failed claim took nothing
    with pytest.raises(DockError, match="count=6 must be positive and a multiple of group_size=4"):
        client.claim("reward", ["prompt_ids"], 6, whole_groups=True)


def test_claim_draws_from_both_shards_when_both_have_ready_rows(shards):
    dock = connect(shards[2])
    try:
        dock.open_iteration(0, 8, 2)  # shard 0 owns rows 0..3, shard 1 rows 4..7
        put_prompts(dock, [0, 1, 4, 5])
        claim = dock.claim("reward", ["prompt_ids"], 4)
        assert claim.rows == [0, 1, 4, 5]
        assert claim.batch.column(0).to_pylist() == [prompt_cell(r) for r in [0, 1, 4, 5]]
        put_prompts(dock, [2, 3, 6, 7])
        firsts = {dock.claim("reference", ["prompt_ids"], 1).rows[0] // 4 for _ in range(2)}
        assert firsts == {0, 1}  # successive claims start at successive shards
    finally:
        dock.close_iteration()


def test_fewer_groups_than_shards(client):
    client.open_iteration(0, 2, 2)
    put_prompts(client, [1, 0])
    assert client.claim("actor", ["prompt_ids"], client.num_rows, whole_groups=True).rows == [0, 1]
    assert client.get(["prompt_ids"], [1, 0]).column(0).to_pylist() == [prompt_cell(1), prompt_cell(0)]


# --- blocking and timeouts ----------------------------------------------------------------


def test_blocking_claim_is_released_by_a_put_from_another_thread(client, shards):
    client.open_iteration(0, 6, 2)
    producer = another(client)

    def produce() -> None:
        time.sleep(0.2)
        producer.put([4, 5, 0, 1, 2, 3], {"prompt_ids": [prompt_cell(r) for r in [4, 5, 0, 1, 2, 3]]})

    thread = threading.Thread(target=produce, daemon=True)
    start = time.monotonic()
    thread.start()
    try:
        claim = client.claim("actor", ["prompt_ids"], 6, whole_groups=True)  # needs every shard's rows
    finally:
        thread.join(5)
    assert claim.rows == list(range(6))
    assert claim.batch.column(0).to_pylist() == [prompt_cell(r) for r in range(6)]
    assert 0.15 <= time.monotonic() - start < 3.0


def test_blocked_claim_fails_when_the_iteration_is_closed(client):
    client.open_iteration(0, 4, 2)
    errors: list[BaseException] = []
    worker = another(client)

    def consume() -> None:
        try:
            worker.claim("reward", ["prompt_ids"], 2)
        except BaseException as e:  # noqa: BLE001 - handed to the main thread
            errors.append(e)

    thread = threading.Thread(target=consume, daemon=True)
    thread.start()
    time.sleep(0.2)
    client.close_iteration()
    thread.join(5)
    assert not thread.is_alive()
    assert len(errors) == 1 and type(errors[0]) is DockError and "no iteration is open" in str(errors[0])


def test_timeout_names_missing_column_and_shard_and_consumes_nothing(client):
    client.open_iteration(0, 6, 2)
    put_prompts(client, range(6))
    client.put([0, 1], {"response_ids": [[0], [1]]})
    start = time.monotonic()
    with pytest.raises(DockTimeoutError) as info:
        client.claim("reward", ["prompt_ids", "response_ids"], 4, timeout_s=0.3)
    assert 0.25 <= time.monotonic() - start < 2.0
    msg = str(info.value)
    assert isinstance(info.value, TimeoutError) and "'reward'" in msg and "wanted 4 rows" in msg
    missing = msg.split("missing")[-1]
    assert "'response_ids': 4" in missing or "'response_ids': 2" in missing
    assert "prompt_ids" not in missing
    last = len(client.locations) - 1
    assert f"shard {last} at {client.locations[last]}" in missing  # rows 4, 5 live on the last shard
    client.put(range(2, 6), {"response_ids": [[r] for r in range(2, 6)]})
    assert client.claim("reward", ["prompt_ids", "response_ids"], 6).rows == list(range(6))


def test_rows_ready_only_on_another_shard_are_taken_before_a_timeout(shards):
    dock = connect(shards[2])
    try:
        dock.open_iteration(0, 8, 2)
        # the claim blocks on shard 0 (first in rotation, as loaded as shard 1); rows arrive on shard 1 only
        timer = threading.Timer(0.1, lambda: put_prompts(connect(shards[2]), [4, 5]))
        timer.start()
        start = time.monotonic()
        claim = dock.claim("reward", ["prompt_ids"], 2, timeout_s=0.5)
        timer.join(5)
        assert claim.rows == [4, 5]
        assert 0.4 <= time.monotonic() - start < 2.0  # seen by the last sweep at the deadline (documented limit)
    finally:
        dock.close_iteration()


def test_rows_taken_for_a_client_that_gave_up_are_handed_back(shards):
    dock = connect(shards[1])
    try:
        dock.open_iteration(0, 2, 2)
        raw = flight.connect(shards[1][0])
        body = b'{"iteration": 0, "consumer": "reward", "columns": ["prompt_ids"], "count": 2, "at_least": 1, ' \
            b'"whole_groups": false, "timeout_s": 1.0}'
        opts = flight.FlightCallOptions(headers=[(b"authorization", f"Bearer {TOKEN}".encode())], timeout=0.1)
        with pytest.raises(flight.FlightTimedOutError):
            list(raw.do_action(flight.Action("claim", body), opts))
        put_prompts(dock, [0, 1])  # wakes the abandoned server-side claim, which takes, sees the cancel, releases
        assert dock.claim("reward", ["prompt_ids"], 2).rows == [0, 1]
        raw.close()
    finally:
        dock.close_iteration()


def test_two_clients_of_one_consumer_share_the_rows_exactly_once(client):
    client.open_iteration(0, 24, 2)
    got: list[list[int]] = [[], []]

    def consume(k: int) -> None:
        worker = another(client)
        while claim := worker.claim("reward", ["prompt_ids"], 3):
            got[k] += claim.rows
            worker.ack(claim)  # the other worker's last claim returns empty only once every row is acked

    threads = [threading.Thread(target=consume, args=(k,), daemon=True) for k in range(2)]
    for t in threads:
        t.start()
    for r in range(0, 24, 4):
        put_prompts(client, range(r, r + 4))
    for t in threads:
        t.join(10)
    assert not any(t.is_alive() for t in threads)
    assert sorted(got[0] + got[1]) == list(range(24))


def test_a_waiting_claim_wakes_when_another_client_of_its_consumer_takes_the_last_row(client):
    client.open_iteration(0, 2, 1)
    put_prompts(client, [0])
    results: list[list[int]] = []

    def consume() -> None:
        worker = another(client)
        claim = worker.claim("reward", ["prompt_ids"], 2)
        results.append(claim.rows)
        worker.ack(claim)  # a loser left with nothing waits for this ack, then returns empty

    threads = [threading.Thread(target=consume, daemon=True) for _ in range(2)]
    start = time.monotonic()
    for t in threads:
        t.start()
    time.sleep(0.2)  # both wait for row 1
    put_prompts(client, [1])
    for t in threads:
        t.join(5)
    assert sorted(r for rows in results for r in rows) == [0, 1] and len(results) == 2
    assert time.monotonic() - start < 2.0  # the loser returned at the winner's ack, not at its 5 s timeout


# --- bad input ----------------------------------------------------------------------------


BAD_CALLS = {
    "put unknown column": (lambda d: d.put([0], {"promptids": [[1]]}), ["'promptids'"]),
    "claim unknown column": (lambda d: d.claim("reward", ["prompt_ids", "score"], 1), ["'score'"]),
    "get unknown column": (lambda d: d.get(["score"], [0]), ["'score'"]),
    "unknown consumer": (lambda d: d.claim("judge", ["prompt_ids"], 1), ["'judge'"]),
    "wrong arrow type": (
        lambda d: d.put([0, 1], {"prompt_ids": pa.array([1, 2], type=pa.int64())}),
        ["'prompt_ids'", "int64", "list<item: int32>"],
    ),
    "put row out of range": (lambda d: d.put([0, 8], {"ground_truth": ["a", "b"]}), ["[8]", "out of range", "[0, 8)"]),
    "get row out of range": (lambda d: d.get(["prompt_ids"], [-1]), ["[-1]", "out of range"]),
    "repeated row": (lambda d: d.put([1, 6, 1], {"ground_truth": ["a", "b", "c"]}), ["repeated"]),
    "too few values": (lambda d: d.put([0, 7], {"ground_truth": ["a"]}), ["1 values", "2 rows"]),
    "second write": (lambda d: d.put([5, 7], {"prompt_ids": [[1], [2]]}), ["'prompt_ids' is already written for rows [7]"]),
    "not yet written": (lambda d: d.get(["prompt_ids", "rm_score"], [7]), ["'rm_score' not yet written for rows [7]"]),
}


@pytest.mark.parametrize("name", list(BAD_CALLS))
def test_bad_input_raises_dock_error_naming_the_culprit(client, name):
    call, fragments = BAD_CALLS[name]
    client.open_iteration(0, 8, 2)
    client.put([7], {"prompt_ids": [[7]]})
    with pytest.raises(DockError) as info:
        call(client)
    assert type(info.value) is DockError
    for fragment in fragments:
        assert fragment in str(info.value)
    local = open_dock(DockConfig(timeout_s=0.1, shards=len(client.locations)), GRPO_SCHEMA, run="test")
    local.open_iteration(0, 8, 2)
    local.put([7], {"prompt_ids": [[7]]})
    with pytest.raises(DockError) as expected:
        call(local)
    local.close()
    assert str(info.value) == str(expected.value)  # the shard's message, in either dock.mode


@pytest.mark.parametrize("error", [DockError("put: bad"), DockTimeoutError("claim by 'x' timed out")])
def test_dock_errors_cross_flight_with_their_type_and_message(error):
    carried = dock_error_to_flight(error)
    assert str(carried).startswith(f"dockrl.{type(error).__name__}: ")
    with pytest.raises(type(error)) as info:
        raise_dock_error(carried)
    assert type(info.value) is type(error) and str(info.value) == str(error)
    raise_dock_error(flight.FlightServerError("not a dock error"))  # returns: the caller re-raises it as is


def test_write_after_close_and_to_a_stale_iteration(client):
    client.open_iteration(0, 4, 2)
    client.close_iteration()
    with pytest.raises(DockError, match="put: no iteration is open"):
        put_prompts(client, [0])
    worker = another(client)
    client.open_iteration(1, 4, 2)
    assert worker.num_rows == 4  # the worker learns the open iteration from the shards
    client.close_iteration()
    client.open_iteration(2, 6, 2)
    with pytest.raises(DockError, match="put: iteration 1 is not open; the open iteration is 2"):
        put_prompts(worker, [0])
    put_prompts(client, range(6))
    claim = worker.claim("reward", ["prompt_ids"], 6)  # a claim follows the newly opened iteration
    assert claim.iteration == 2 and claim.rows == list(range(6)) and worker.num_rows == 6


def test_open_iteration_twice_leaves_the_open_one_untouched(client):
    client.open_iteration(0, 6, 2)
    put_prompts(client, range(6))
    with pytest.raises(DockError, match=r"open_iteration\(1\): iteration 0 is still open"):
        client.open_iteration(1, 4, 2)
    with pytest.raises(DockError, match="num_rows=5 must be a positive multiple of group_size=2"):
        client.open_iteration(1, 5, 2)
    assert client.claim("reward", ["prompt_ids"], 6).rows == list(range(6))


def raw_call(location: str, fn, token: str | None = TOKEN):
    """Run ``fn(flight_client, call_options)`` against a shard directly, bypassing DockClient's own checks;
    a dock error the shard raised comes back as its own type."""
    raw = flight.connect(location)
    headers = [(b"authorization", f"Bearer {token}".encode())] if token else []
    try:
        return fn(raw, flight.FlightCallOptions(headers=headers, timeout=10.0))
    except flight.FlightError as e:
        raise_dock_error(e)
        raise
    finally:
        raw.close()


def raw_put(iteration, columns: dict[str, pa.Array], command: bytes | None = None):
    def call(raw, opts):
        batch = pa.RecordBatch.from_pydict(columns)
        descriptor = flight.FlightDescriptor.for_command(command or f'{{"iteration": {iteration}}}'.encode())
        writer, _ = raw.do_put(descriptor, batch.schema, opts)
        writer.write_batch(batch)
        writer.close()

    return call


def raw_action(name: str, body: bytes):
    return lambda raw, opts: [r.body.to_pybytes() for r in raw.do_action(flight.Action(name, body), opts)]


def raw_get(ticket: bytes):
    return lambda raw, opts: raw.do_get(flight.Ticket(ticket), opts).read_all()


ROWS = pa.array([2, 3], type=pa.int64())  # shard 1 of 2 owns rows 2..3 of a 4-row iteration
CLAIM_TICKET = encode_claim(ClaimRequest(0, "reward", ("prompt_ids",), 1, 0, False, 0.0, "raw", "lease", 60.0, False),
                            claim_fixed_part("reward", "raw", ("prompt_ids",)))
PUT_DESCRIPTOR = encode_put(0, None)
RAW_BAD_CALLS = {
    "unknown column": (raw_put(0, {"row": ROWS, "promptids": pa.array([[1], [2]])}), ["unknown column 'promptids'"]),
    "wrong arrow type": (
        raw_put(0, {"row": ROWS, "prompt_ids": pa.array([1, 2], type=pa.int64())}),
        ["'prompt_ids' has Arrow type int64; schema says list<item: int32>"],
    ),
    "row out of range": (
        raw_put(0, {"row": pa.array([1, 2], type=pa.int64()), "rm_score": pa.array([1.0, 2.0], type=pa.float32())}),
        ["rows [1] belong to another dock shard; this one holds [2, 4) of iteration 0"],
    ),
    "second write": (
        raw_put(0, {"row": ROWS, "prompt_ids": pa.array([[1], [2]], type=pa.list_(pa.int32()))}),
        ["'prompt_ids' is already written for rows [3]"],
    ),
    "stale iteration": (
        raw_put(5, {"row": ROWS, "rm_score": pa.array([1.0, 2.0], type=pa.float32())}),
        ["iteration 5 is not open; the open iteration is 0"],
    ),
    "no row column": (raw_put(0, {"rm_score": pa.array([1.0, 2.0], type=pa.float32())}), ["no 'row' column"]),
    "descriptor not json": (
        raw_put(0, {"row": ROWS, "rm_score": pa.array([1.0, 2.0], type=pa.float32())}, command=b"iteration=0"),
        ["malformed put request"],
    ),
    "get unknown column": (raw_get(b'{"iteration": 0, "columns": ["score"], "rows": [2]}'), ["unknown column 'score'"]),
    "get row out of range": (raw_get(b'{"iteration": 0, "columns": ["prompt_ids"], "rows": [0]}'), ["rows [0] belong to another dock shard"]),
    "unknown action": (raw_action("steal", b"{}"), ["unknown action 'steal'"]),
    "claim ticket in JSON (wire version 1)": (
        raw_get(b'{"claim": {"iteration": 0, "consumer": "reward", "columns": ["prompt_ids"], "count": 1}}'),
        [f"claim: the client speaks dock wire version 1; this shard speaks {WIRE_VERSION}", "same dockrl release"],
    ),
    "claim ticket of another wire version": (
        raw_get(CLAIM_TICKET[:3] + bytes([WIRE_VERSION + 1]) + CLAIM_TICKET[4:]),
        [f"claim: the client speaks dock wire version {WIRE_VERSION + 1}; this shard speaks {WIRE_VERSION}"],
    ),
    "claim ticket cut short": (raw_get(CLAIM_TICKET[:-3]), ["malformed claim ticket"]),
    "put descriptor of another wire version": (
        raw_put(0, {"row": ROWS, "rm_score": pa.array([1.0, 2.0], type=pa.float32())},
                command=PUT_DESCRIPTOR[:3] + bytes([WIRE_VERSION + 1]) + PUT_DESCRIPTOR[4:]),
        [f"put: the client speaks dock wire version {WIRE_VERSION + 1}; this shard speaks {WIRE_VERSION}"],
    ),
    "action missing a field": (raw_action("ack", b'{"iteration": 0, "consumer": "reward", "rows": [2]}'), ["malformed ack request", "lease"]),
    "ack of a lease never granted": (
        raw_action("ack", b'{"iteration": 0, "consumer": "reward", "lease": "nope", "rows": [2]}'),
        ["ack by 'reward'", "rows [2] are not leased to 'reward' under lease 'nope' in iteration 0"],
    ),
    "restore without snapshot": (raw_action("restore", b'{"uri": "/nonexistent/dock-snapshot", "layout": null}'), ["iteration 0 is open"]),
}


@pytest.mark.parametrize("name", list(RAW_BAD_CALLS))
def test_shard_refuses_bad_input_sent_around_the_client(shards, name):
    call, fragments = RAW_BAD_CALLS[name]
    dock = connect(shards[2])
    dock.open_iteration(0, 4, 2)
    try:
        dock.put([3], {"prompt_ids": [[3]]})
        other = connect(shards[2])
        other.claim("reward", ["prompt_ids"], 1)  # row 3, leased by another owner
        with pytest.raises(DockError) as info:
            raw_call(shards[2][1], call)
        assert type(info.value) is DockError
        for fragment in fragments:
            assert fragment in str(info.value)
        other.close()
    finally:
        dock.close_iteration()


def test_write_after_the_iteration_closed_is_refused_by_the_shard(shards):
    dock = connect(shards[1])
    dock.open_iteration(0, 2, 2)
    dock.close_iteration()
    with pytest.raises(DockError, match="put: no iteration is open"):
        raw_call(shards[1][0], raw_put(0, {"row": pa.array([0], type=pa.int64()), "rm_score": pa.array([1.0], type=pa.float32())}))
    with pytest.raises(DockError, match="ack by 'reward': no iteration is open"):
        raw_call(shards[1][0], raw_action("ack", b'{"iteration": 0, "consumer": "reward", "lease": "x", "rows": [0]}'))


NEVER_WRITTEN = str(Path(tempfile.gettempdir()) / "dockrl-never-written")
"""Where a refused snapshot or restore would have gone."""


@pytest.mark.parametrize("token", [None, "wrong"], ids=["missing", "wrong"])
@pytest.mark.parametrize(
    "call",
    [
        raw_put(0, {"row": pa.array([0], type=pa.int64()), "rm_score": pa.array([1.0], type=pa.float32())}),
        raw_get(b'{"iteration": 0, "columns": ["prompt_ids"], "rows": [0]}'),
        raw_action("ack", b'{"iteration": 0, "consumer": "reward", "lease": "x", "rows": [0]}'),
        raw_action("renew", b'{"owner": "x"}'),
        raw_action("release_owner", b'{"owner": "x"}'),
        raw_action("snapshot", json.dumps({"uri": NEVER_WRITTEN}).encode()),
        raw_action("restore", json.dumps({"uri": NEVER_WRITTEN, "layout": None}).encode()),
    ],
    ids=["put", "get", "ack", "renew", "release_owner", "snapshot", "restore"],
)
def test_every_call_needs_the_token(shards, token, call):
    with pytest.raises(flight.FlightUnauthenticatedError, match="Bearer <token>"):
        raw_call(shards[1][0], call, token=token)


# --- auth ---------------------------------------------------------------------------------


@pytest.mark.parametrize("token", [None, "wrong"], ids=["missing", "wrong"])
def test_calls_without_the_right_token_are_rejected(shards, token):
    dock = DockClient(shards[2], GRPO_SCHEMA, token=token, rpc_timeout_s=10.0)
    for call in (lambda: dock.open_iteration(0, 4, 2), lambda: dock.stats(), lambda: dock.num_rows):
        with pytest.raises(flight.FlightUnauthenticatedError, match="Bearer <token>") as info:
            call()
        assert any("dock shard at grpc://127.0.0.1:" in note for note in info.value.__notes__)
        assert "DOCKRL_DOCK_TOKEN in the environment of `dockrl worker`" in str(info.value)  # what a CLI user sets


def test_shard_without_token_accepts_every_call(caplog):
    with caplog.at_level("WARNING", logger="dockrl.dock.flight.server"):
        servers, locations = start_local_shards(1, GRPO_SCHEMA)
    assert "WITHOUT authentication" in caplog.text and "--token-env DOCKRL_DOCK_TOKEN" in caplog.text
    try:
        dock = DockClient(locations, GRPO_SCHEMA, token="ignored")
        dock.open_iteration(0, 2, 2)
        put_prompts(dock, range(2))
        assert dock.get(["prompt_ids"], [0]).column(0).to_pylist() == [prompt_cell(0)]
    finally:
        servers[0].close()


# --- Arrow round trip ---------------------------------------------------------------------


def test_arrow_round_trip_is_bit_exact(client):
    rng = np.random.default_rng(0)
    lengths = [0, 1, 5, 3, 7, 2]
    tokens = [rng.integers(-(2**31), 2**31 - 1, n, dtype=np.int32) for n in lengths]
    logp = [(rng.standard_normal(n) * 10).astype(np.float32) for n in lengths]
    logp[3][:3] = np.array([np.nan, -0.0, -np.inf], dtype=np.float32)
    response, log_prob = pa.array(tokens, type=TOKENS), pa.array(logp, type=LOGPROBS)
    client.open_iteration(0, 6, 2)
    rows = [5, 0, 3, 1, 4, 2]
    client.put(rows, {"response_ids": response, "rollout_log_prob": log_prob, "truncated": [r % 2 == 0 for r in rows]})
    got = client.get(["response_ids", "rollout_log_prob", "truncated"], rows)
    assert got.schema == GRPO_SCHEMA.arrow_schema(["response_ids", "rollout_log_prob", "truncated"])
    assert got.column("response_ids").equals(response)
    np.testing.assert_array_equal(got.column("rollout_log_prob").offsets.to_numpy(), log_prob.offsets.to_numpy())
    bits = got.column("rollout_log_prob").flatten().to_numpy(zero_copy_only=False).view(np.uint32)
    np.testing.assert_array_equal(bits, np.concatenate(logp).view(np.uint32))
    claim = client.claim("actor", ["response_ids"], 6)
    by_row = dict(zip(rows, tokens))
    for r, cell in zip(claim.rows, claim.batch.column(0).to_pylist()):
        np.testing.assert_array_equal(np.asarray(cell, dtype=np.int32), by_row[r])


# --- property: exactly-once delivery with whole groups, over 2-3 shards ------------------------

CONSUMERS = {"reward": ["prompt_ids", "response_ids"], "advantage": ["rm_score"]}
PUT_COLUMNS = {"prompt_ids": prompt_cell, "response_ids": lambda r: [r % 7] * (r % 4), "rm_score": lambda r: float(r)}


@settings(max_examples=20, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(data=st.data())
def test_property_every_consumer_gets_every_row_once(shards, store_shards, tmp_path_factory, data):
    mode = data.draw(st.sampled_from(["2 shards", "3 shards", "2 shards, directory warehouse"]), label="mode")
    g = data.draw(st.integers(1, 3), label="group_size")
    num_rows = g * data.draw(st.integers(1, 6), label="groups")
    whole = {c: data.draw(st.booleans(), label=f"whole_groups[{c}]") for c in CONSUMERS}
    if "warehouse" in mode:
        dock = connect(store_shards, timeout_s=2.0, warehouse=DirectoryWarehouse(tmp_path_factory.mktemp("warehouse")))
    else:
        dock = connect(shards[int(mode[0])], timeout_s=2.0)
    dock.open_iteration(0, num_rows, g)
    written: dict[str, set[int]] = {c: set() for c in PUT_COLUMNS}
    received: dict[str, list[int]] = {c: [] for c in CONSUMERS}

    def available(consumer: str) -> list[int]:
        taken = set(received[consumer])
        ok = [r not in taken and all(r in written[c] for c in CONSUMERS[consumer]) for r in range(num_rows)]
        if whole[consumer]:
            ok = [all(ok[r - r % g : r - r % g + g]) for r in range(num_rows)]
        return [r for r in range(num_rows) if ok[r]]

    def claim_and_check(consumer: str, count: int, expect: int) -> None:
        ready = available(consumer)
        claim = dock.claim(consumer, CONSUMERS[consumer], count, whole_groups=whole[consumer])
        assert len(claim) == expect and set(claim.rows) <= set(ready)
        assert not set(claim.rows) & set(received[consumer]) and len(set(claim.rows)) == len(claim.rows)
        if whole[consumer]:
            for r in claim.rows:
                assert set(range(r - r % g, r - r % g + g)) <= set(claim.rows), f"partial group in {claim.rows}"
        for column in CONSUMERS[consumer]:
            assert claim.batch.column(column).to_pylist() == [PUT_COLUMNS[column](r) for r in claim.rows]
        received[consumer] += claim.rows

    try:
        for _ in range(data.draw(st.integers(0, 12), label="steps")):
            if data.draw(st.booleans(), label="put?"):
                open_cols = [c for c in PUT_COLUMNS if len(written[c]) < num_rows]
                if not open_cols:
                    continue
                column = data.draw(st.sampled_from(open_cols), label="column")
                free = data.draw(st.permutations(sorted(set(range(num_rows)) - written[column])), label="order")
                rows = free[: data.draw(st.integers(1, len(free)), label="how many")]
                dock.put(rows, {column: [PUT_COLUMNS[column](r) for r in rows]})
                written[column] |= set(rows)
            else:
                consumer = data.draw(st.sampled_from(sorted(CONSUMERS)), label="consumer")
                ready = available(consumer)
                if ready:
                    unit = g if whole[consumer] else 1
                    count = unit * data.draw(st.integers(1, len(ready) // unit), label="count")
                    claim_and_check(consumer, count, count)
        for column, fn in PUT_COLUMNS.items():
            rest = sorted(set(range(num_rows)) - written[column])
            if rest:
                dock.put(rest, {column: [fn(r) for r in rest]})
                written[column] |= set(rest)
        for consumer in CONSUMERS:
            while left := num_rows - len(received[consumer]):
                claim_and_check(consumer, 2 * g, min(left, 2 * g))
            assert len(dock.claim(consumer, CONSUMERS[consumer], g, whole_groups=whole[consumer])) == 0
            assert sorted(received[consumer]) == list(range(num_rows))
    finally:
        dock.close_iteration()
        dock.close()


# --- a shard in its own process -------------------------------------------------------------


def test_shard_runs_as_a_separate_process(shards):
    env = {**os.environ, "DOCKRL_DOCK_TOKEN": TOKEN}
    cmd = [sys.executable, "-m", "dockrl.dock.flight.shards", "--host", "127.0.0.1", "--port", "0", "--token-env", "DOCKRL_DOCK_TOKEN"]
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    watchdog = threading.Timer(30.0, proc.kill)  # a hung start fails the test instead of hanging it
    watchdog.start()
    try:
        location = proc.stdout.readline().strip()
        assert location.startswith("grpc://127.0.0.1:"), proc.stderr.read() if proc.poll() is not None else location
        dock = connect([shards[1][0], location])  # one in-process shard, one in another process
        dock.open_iteration(0, 8, 2)
        put_prompts(dock, range(8))
        claim = dock.claim("rollout", ["prompt_ids"], 8, whole_groups=True)
        assert claim.rows == list(range(8)) and claim.batch.column(0).to_pylist() == [prompt_cell(r) for r in range(8)]
        with pytest.raises(DockError, match=r"'prompt_ids' is already written for rows \[6\]"):
            put_prompts(dock, [6])  # raised in the other process, same type and message here
        dock.close_iteration()
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=10)
        finally:
            watchdog.cancel()
    assert proc.returncode == 0, proc.stderr.read()


def test_cli_refuses_an_unset_token_variable(monkeypatch, capsys):
    monkeypatch.delenv("DOCKRL_TEST_UNSET_TOKEN", raising=False)
    with pytest.raises(SystemExit) as info:
        serve_shard(["--token-env", "DOCKRL_TEST_UNSET_TOKEN"])
    assert info.value.code == 2
    assert "DOCKRL_TEST_UNSET_TOKEN" in capsys.readouterr().err


@pytest.mark.parametrize("host", ["0.0.0.0", "10.1.2.3", "dock.example", "::"])
def test_cli_refuses_a_bind_beyond_loopback_without_a_token(host, capsys):
    with pytest.raises(SystemExit) as info:
        serve_shard(["--host", host])
    assert info.value.code == 2
    assert f"--host {host}: a shard reachable from other machines must require a bearer token" in capsys.readouterr().err


def test_a_put_table_chunked_unevenly_writes_every_row():
    """A shard's put of a table whose columns are chunked differently writes all its rows, not the first batch's."""
    from dockrl.dock.rows import row_runs, runs_rows
    from dockrl.dock.shard.service import ShardService

    svc = ShardService(GRPO_SCHEMA, name="local://test")
    svc.action("open_iteration", {"iteration": 0, "num_rows": 8, "group_size": 4, "first_row": 0, "stop_row": 8,
                                  "shard": 0, "num_shards": 1})
    cells = pa.chunked_array([[[1]] * 3, [[2]] * 5], type=pa.list_(pa.int32()))
    svc.put({"iteration": 0}, pa.Table.from_arrays([pa.chunked_array([np.arange(8)]), cells], names=["row", "prompt_ids"]))
    assert svc.get({"iteration": 0, "columns": ["prompt_ids"], "rows": list(range(8))}).column(0).to_pylist() == [[1]] * 3 + [[2]] * 5
    rows = np.array([0, 1, 2, 5, 7, 8], dtype=np.int64)
    assert row_runs(rows).tolist() == [[0, 3], [5, 6], [7, 9]] and runs_rows(row_runs(rows)).tolist() == rows.tolist()
    assert row_runs(rows[:0]).tolist() == [] and row_runs(rows[:3]).tolist() == [[0, 3]]
    assert runs_rows(row_runs(rows[:0])).tolist() == [] and runs_rows(row_runs(rows[:3])).tolist() == [0, 1, 2]


def test_the_claim_cycle_messages_round_trip():
    """The binary claim ticket, claim result and put descriptor decode to what was encoded."""

    req = ClaimRequest(3, "actor", ("prompt_ids", "advantages"), 32, 16, True, None, "host:1:ab", "l" * 32, 90.0, True)
    cache: dict = {}
    fixed = claim_fixed_part(req.consumer, req.owner, req.columns)
    assert decode_claim(encode_claim(req, fixed), cache) == req
    assert decode_claim(encode_claim(req._replace(timeout_s=2.5, lease_s=None, whole_groups=False), fixed), cache) == \
        req._replace(timeout_s=2.5, lease_s=None, whole_groups=False)
    assert len(cache) == 1  # the fixed part is parsed once
    for rows in ([], [4, 5, 6], [0, 1, 2, 5, 7, 8], [9]):
        got, pending, held = decode_claim_result(encode_claim_result(np.array(rows, dtype=np.int64), 7, 2))
        assert got.dtype == np.int64 and got.tolist() == rows and (pending, held) == (7, 2)
    assert decode_put(encode_put(4, None)) == (4, None)
    assert decode_put(encode_put(4, ("reward", "lease-1"))) == (4, ("reward", "lease-1"))
    assert decode_put(b'{"iteration": 4, "ack": {"consumer": "reward", "lease": "x"}}') == (4, ("reward", "x"))

    put, ticket = decode_exchange(encode_exchange(encode_put(4, ("reward", "lease-1")), encode_claim(req, fixed)))
    assert decode_put(put) == (4, ("reward", "lease-1")) and decode_claim(ticket, cache) == req


def test_the_decoders_read_the_version_before_the_length():
    """A message of another version is refused by name even when shorter than this version's header; a short or
    empty claim answer is a DockError naming the shard, not a struct.error."""

    other = bytes([WIRE_VERSION + 1])
    with pytest.raises(DockError, match=f"claim: the client speaks dock wire version {WIRE_VERSION + 1}; this shard"):
        decode_claim(CLAIM_TICKET[:3] + other, {})
    with pytest.raises(DockError, match=f"put: the client speaks dock wire version {WIRE_VERSION + 1}; this shard"):
        decode_put(PUT_DESCRIPTOR[:3] + other)
    with pytest.raises(DockError, match="malformed claim ticket"):
        decode_claim(CLAIM_TICKET[:10], {})
    with pytest.raises(DockError, match="malformed put descriptor"):
        decode_put(PUT_DESCRIPTOR[:6])

    exchange = encode_exchange(PUT_DESCRIPTOR, CLAIM_TICKET)
    with pytest.raises(DockError, match=f"put: the client speaks dock wire version {WIRE_VERSION + 1}; this shard"):
        decode_exchange(exchange[:3] + other)
    for cut in (exchange[:6], exchange[:10], PUT_DESCRIPTOR):
        with pytest.raises(DockError, match="malformed exchange descriptor"):
            decode_exchange(cut)
    answer = encode_claim_result(np.arange(4, 9, dtype=np.int64), 7, 2)
    where = "grpc://shard-a:1"
    with pytest.raises(DockError, match=f"dock shard at {where} speaks wire version {WIRE_VERSION + 1}; this client"):
        decode_claim_result(other + answer[1:3], where)
    for cut in (b"", answer[:1], answer[:10], answer[:-1]):
        with pytest.raises(DockError, match=f"claim: malformed answer of the dock shard at {where}"):
            decode_claim_result(cut, where)


def test_an_ack_is_flagged_whatever_its_consumer():
    """The put descriptor flags an ack: an ack with an empty consumer is kept (and refused by the shard by name)."""

    assert decode_put(encode_put(1, ("", "lease-1"))) == (1, ("", "lease-1"))
    assert decode_put(encode_put(1, ("", ""))) == (1, ("", ""))


class FakeShard(flight.FlightServerBase):
    """A FAKE dock shard (not dockrl's): answers ``describe`` with ``wire_version`` (None: without it, as the
    shards of wire version 1 did) and fails puts and claims as a shard of that release does: it parses the put
    descriptor and the ticket as JSON. With ``answer`` it answers a claim ticket with that many record batches."""

    def __init__(self, wire_version: int | None, answer: int | None = None) -> None:
        super().__init__("grpc://127.0.0.1:0")
        self.wire_version, self.answer, self.describes = wire_version, answer, 0
        self.location = f"grpc://127.0.0.1:{self.port}"

    def do_action(self, context, action):
        assert action.type == "describe"
        self.describes += 1
        desc = {"schema_version": 1, "columns": [], "layout": None, "layouts": [], "payload": "memory"}
        if self.wire_version is not None:
            desc["wire_version"] = self.wire_version
        return iter([json.dumps(desc).encode()])

    def do_put(self, context, descriptor, reader, writer):
        try:
            json.loads(descriptor.command)
        except json.JSONDecodeError as e:  # what the shard of wire version 1 answered
            raise dock_error_to_flight(DockError(f"dock shard: malformed put request (JSONDecodeError: {e})")) from None

    def do_get(self, context, ticket):
        if self.answer is not None:
            schema = pa.schema([("prompt_ids", TOKENS)])
            batch = pa.record_batch([pa.array([[1]], type=TOKENS)], schema=schema)
            return flight.GeneratorStream(schema, iter([batch] * self.answer))
        json.loads(ticket.ticket)  # the binary ticket: UnicodeDecodeError, as in the shard of wire version 1
        raise AssertionError("unreachable")


def transport_calls(transport):
    assert isinstance(transport, FlightTransport)
    req = ClaimRequest(0, "reward", ("prompt_ids",), 1, 0, False, 0.0, "raw", None, 60.0, False)
    batch = pa.record_batch([pa.array([0], type=pa.int64())], names=["row"])
    return {"put": lambda: transport.put({"iteration": 0}, batch, 5.0), "claim": lambda: transport.claim_cells(req, 5.0),
            "put_claim": lambda: transport.put_claim({"iteration": 0}, batch, req, 5.0)}


@pytest.mark.parametrize("version", [None, WIRE_VERSION + 1])
@pytest.mark.parametrize("call", ["put", "claim", "put_claim"])
def test_a_shard_of_another_wire_version_is_refused_by_name(version, call):
    """A client whose put or claim fails on a shard of another release (a fake one here: wire version 1 answers no
    ``wire_version`` in ``describe``) raises a DockError naming the shard and both versions."""

    shard = FakeShard(version)
    transport = FlightTransport(shard.location)
    try:
        with pytest.raises(DockError) as raised:
            transport_calls(transport)[call]()
        message = str(raised.value)
        assert f"{call.split('_')[0]}: the dock shard at {shard.location} speaks wire version {version or 1}; this client speaks " \
            f"{WIRE_VERSION}" in message and "same dockrl release" in message
        assert raised.value.__cause__ is not None  # the call's own error comes with it
        for other in ("put", "claim"):  # and every later failing call says so too (asked once)
            with pytest.raises(DockError, match=f"{other}: the dock shard at .* speaks wire version {version or 1}"):
                transport_calls(transport)[other]()
        assert shard.describes == 1
    finally:
        transport.close()
        shard.shutdown()


def test_the_wire_version_is_asked_once_and_errors_of_a_shard_of_this_version_pass_unchanged():
    shard = FakeShard(WIRE_VERSION)
    transport = FlightTransport(shard.location)
    try:
        for _ in range(2):
            with pytest.raises(DockError, match="malformed put request") as raised:
                transport_calls(transport)["put"]()
            assert "speaks wire version" not in str(raised.value)
        assert shard.describes == 1
    finally:
        transport.close()
        shard.shutdown()


@pytest.mark.parametrize("batches, what", [(0, "no record batch"), (2, "more than one record batch")])
def test_a_claim_answer_that_is_not_one_batch_names_the_shard(batches, what):
    shard = FakeShard(WIRE_VERSION, answer=batches)
    transport = FlightTransport(shard.location)
    try:
        with pytest.raises(DockError, match=f"claim: the dock shard at {shard.location} answered {what}"):
            transport_calls(transport)["claim"]()
    finally:
        transport.close()
        shard.shutdown()


def test_a_put_of_no_rows_sends_nothing(shards):
    for n in (1, 3):
        dock = connect(shards[n])
        try:
            dock.open_iteration(0, 4 * n, group_size=2)
            before = dock.controller_bytes
            dock.put([], {"prompt_ids": []})
            assert dock.controller_bytes == before
            dock.close_iteration()
        finally:
            dock.close()


def test_an_unreachable_shard_fails_as_itself_without_a_version_check():
    shard = FakeShard(WIRE_VERSION)
    location = shard.location
    shard.shutdown()
    transport = FlightTransport(location)
    try:
        with pytest.raises(flight.FlightUnavailableError) as raised:
            transport_calls(transport)["put"]()
        assert any(location in note for note in raised.value.__notes__)
        assert shard.describes == 0
    finally:
        transport.close()
