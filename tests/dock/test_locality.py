"""Locality-aware claims: a client with ``local_shard`` claims from its co-located shard while that
has rows left and steals from the others only once it is empty; rows are still claimed exactly once."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator

import pytest

from dockrl.dock import GRPO_SCHEMA, DockTimeoutError
from dockrl.dock.client.dock_client import DockClient
from dockrl.dock.shard.service import ShardService
from dockrl.dock.shard.transport import LocalTransport, local_shards

SHARDS, ROWS = 3, 12  # groups of 1: shard s owns rows 4s .. 4s+3


@pytest.fixture
def services() -> Iterator[list[ShardService]]:
    """Three in-process shards shared by every client of a test, with iteration 0 of 12 rows open."""
    shards = local_shards(SHARDS, GRPO_SCHEMA, timeout_s=5.0)
    client(shards).open_iteration(0, ROWS, 1)
    yield shards
    for s in shards:
        s.close()


def client(shards: list[ShardService], **kw) -> DockClient:
    """A worker's client of ``shards`` (each its own owner); ``kw`` as ``DockClient``'s."""
    return DockClient([LocalTransport(s) for s in shards], GRPO_SCHEMA, timeout_s=5.0, **kw)


def put_prompts(dock: DockClient, rows) -> None:
    rows = list(rows)
    dock.put(rows, {"prompt_ids": [[r] for r in rows]})


def shard_of(row: int) -> int:
    return row // (ROWS // SHARDS)


@pytest.mark.parametrize("first_shard", [0, 1, 2])
def test_a_claim_takes_from_the_local_shard_first_whatever_the_rotation(services, first_shard):
    put_prompts(client(services), range(ROWS))
    dock = client(services, local_shard=2, first_shard=first_shard)
    for _ in range(2):
        claim = dock.claim("reward", ["prompt_ids"], 2)
        assert [shard_of(r) for r in claim.rows] == [2, 2]
        assert claim.batch.column(0).to_pylist() == [[r] for r in claim.rows]


def test_once_the_local_shard_is_empty_the_claim_steals_from_the_others(services):
    put_prompts(client(services), range(ROWS))
    dock = client(services, local_shard=1)
    first = dock.claim("reward", ["prompt_ids"], 6)  # 4 local rows, 2 stolen
    assert [r for r in first.rows if shard_of(r) == 1] == [4, 5, 6, 7]
    assert len(first.rows) == 6
    rest = dock.claim("reward", ["prompt_ids"], ROWS)
    assert sorted(first.rows + rest.rows) == list(range(ROWS))
    assert not dock.claim("reward", ["prompt_ids"], 1).rows  # every row taken: the consumer is done


def test_while_the_local_shard_has_rows_left_the_claim_waits_for_them_instead_of_stealing(services):
    put_prompts(client(services), [4, 5, 6, 7, 8, 9, 10])  # shard 1 all ready; the local shard 2 lacks row 11
    dock = client(services, local_shard=2)
    assert dock.claim("reward", ["prompt_ids"], 3).rows == [8, 9, 10]
    timer = threading.Timer(0.3, put_prompts, args=(client(services), [11]))
    timer.start()
    start = time.monotonic()
    claim = dock.claim("reward", ["prompt_ids"], 1, timeout_s=5.0)  # rows 4..7 are ready on shard 1: not taken
    timer.join()
    assert claim.rows == [11]
    assert time.monotonic() - start < 2.5  # woken by the put, not by the 5 s deadline
    assert dock.claim("reward", ["prompt_ids"], 2).rows == [4, 5]  # the local shard is empty now: it steals


def test_a_local_shard_whose_rows_never_come_fails_the_claim_at_its_timeout_consuming_nothing(services):
    put_prompts(client(services), [0, 1])
    dock = client(services, local_shard=2)
    with pytest.raises(DockTimeoutError, match="timed out"):
        dock.claim("reward", ["prompt_ids"], 4, timeout_s=0.5)  # 2 ready elsewhere, 4 wanted: rows 8..11 never come
    assert client(services).claim("reward", ["prompt_ids"], 2).rows == [0, 1]  # released by the failed claim


def test_clients_with_different_hints_claim_every_row_exactly_once(services):
    docks = [client(services, local_shard=s) for s in range(SHARDS)] + [client(services)]  # and one without a hint
    got: list[list[int]] = [[] for _ in docks]

    def consume(k: int) -> None:
        while claim := docks[k].claim("reward", ["prompt_ids"], 2, timeout_s=5.0):
            got[k] += claim.rows
            assert claim.batch.column(0).to_pylist() == [[r] for r in claim.rows]
            docks[k].ack(claim)

    threads = [threading.Thread(target=consume, args=(k,), daemon=True) for k in range(len(docks))]
    for t in threads:
        t.start()
    writer = client(services)
    for r in range(0, ROWS, 3):  # rows become ready a few at a time, across the shards
        put_prompts(writer, range(r, r + 3))
    for t in threads:
        t.join(10)
    assert not any(t.is_alive() for t in threads)
    assert sorted(r for rows in got for r in rows) == list(range(ROWS))


def test_without_a_hint_the_sweep_rotates_from_the_first_shard(services):
    put_prompts(client(services), range(ROWS))
    dock = client(services, first_shard=1)
    assert [shard_of(dock.claim("reward", ["prompt_ids"], 1).rows[0]) for _ in range(3)] == [1, 2, 0]


@pytest.mark.parametrize("bad", [-1, 3, 1.0, "0"])
def test_a_hint_outside_the_shards_is_refused_naming_it(services, bad):
    with pytest.raises(ValueError, match="local_shard="):
        client(services, local_shard=bad)
