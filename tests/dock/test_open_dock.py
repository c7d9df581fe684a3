"""Tests of ``open_dock``: the dock of ``dock.mode=inprocess`` is the sharded dock over shards of this process."""

from __future__ import annotations

import time
from collections.abc import Iterator

import pytest

from dockrl.config import DockConfig
from dockrl.dock import GRPO_SCHEMA, Dock, open_dock
from dockrl.dock.client.dock_client import DockClient


@pytest.fixture
def two_shards() -> Iterator[DockClient]:
    dock = open_dock(DockConfig(timeout_s=2.0, shards=2), GRPO_SCHEMA, run="test")
    assert isinstance(dock, DockClient)
    yield dock
    dock.close()


def shard_stats(dock: DockClient) -> list[dict[str, float]]:
    """Each shard's own counters, asked of the shard itself."""
    return [t.action("stats", {}, None) for t in dock.transports]


def test_dock_shards_2_in_process_holds_two_shards(two_shards):
    dock = two_shards
    dock.open_iteration(0, 8, 2)
    dock.put(range(8), {"prompt_ids": [[r] for r in range(8)]})
    assert dock.stats()["dock/shards"] == 2
    layouts = [t.action("describe", {}, None)["layout"] for t in dock.transports]
    assert [(lay["first_row"], lay["stop_row"]) for lay in layouts] == [(0, 4), (4, 8)]
    per_shard = [s["dock/bytes_put"] for s in shard_stats(dock)]
    assert all(b > 0 for b in per_shard) and sum(per_shard) == dock.stats()["dock/bytes_put"]  # both hold rows
    claim = dock.claim("reward", ["prompt_ids"], 8)
    assert sorted(claim.rows) == list(range(8))
    assert claim.batch.column("prompt_ids").to_pylist() == [[r] for r in claim.rows]
    dock.put(claim.rows, {"rm_score": [1.0] * 8, "correct": [True] * 8}, ack=claim)
    assert all(s["dock/bytes_read"] > 0 for s in shard_stats(dock))
    assert dock.claim("reward", ["prompt_ids"], 8).rows == []  # every row acked on both shards
    assert dock.controller_bytes == 0  # nothing was serialized: the shards are called directly


def test_every_stage_loop_gets_every_row_once_over_two_in_process_shards(two_shards):
    dock = two_shards
    dock.open_iteration(3, 12, 4)
    dock.put(range(12), {"prompt_ids": [[r] for r in range(12)]})
    seen = []
    while claim := dock.claim("rollout", ["prompt_ids"], 4, whole_groups=True):
        assert claim.iteration == 3 and len(claim) == 4 and claim.rows[0] % 4 == 0
        dock.put(claim.rows, {"response_ids": [[r, r] for r in claim.rows], "truncated": [False] * 4,
                              "rollout_log_prob": [[-1.0, -1.0]] * 4}, ack=claim)
        seen += claim.rows
    assert sorted(seen) == list(range(12))
    assert dock.get(["response_ids"], [11, 0], iteration=3).column(0).to_pylist() == [[11, 11], [0, 0]]


def test_dock_warehouse_in_process_keeps_the_payload_in_the_store(tmp_path):
    dock: Dock = open_dock(DockConfig(timeout_s=2.0, shards=2, warehouse="directory", directory=str(tmp_path)),
                           GRPO_SCHEMA, run="run-1")
    try:
        dock.open_iteration(0, 4, 2)
        dock.put(range(4), {"prompt_ids": [[r] for r in range(4)]})
        assert sorted(p.parent.name for p in (tmp_path / "run-1").rglob("*.arrow")) == ["prompt_ids", "prompt_ids"]  # one per shard
        claim = dock.claim("reward", ["prompt_ids"], 4)
        assert claim.batch.column(0).to_pylist() == [[r] for r in claim.rows]
        stats = dock.stats()
        assert stats["dock/bytes_put"] == 0 and stats["dock/store_bytes_written"] > 0  # no cell in a shard
        dock.close_iteration()
        assert not list((tmp_path / "run-1").rglob("*.arrow"))  # the iteration's objects die with it
    finally:
        dock.close()


def test_close_fails_a_claim_blocked_in_an_in_process_shard(two_shards):
    import threading

    from dockrl.dock import DockError

    dock = two_shards
    dock.open_iteration(0, 4, 2)
    errors: list[BaseException] = []

    def wait() -> None:
        try:
            dock.claim("reward", ["prompt_ids"], 4, timeout_s=10.0)
        except BaseException as e:  # noqa: BLE001 - checked below
            errors.append(e)

    thread = threading.Thread(target=wait)
    thread.start()
    thread.join(0.2)
    dock.close_iteration()
    thread.join(5.0)
    assert not thread.is_alive() and isinstance(errors[0], DockError) and "no iteration is open" in str(errors[0])


def test_an_idle_lease_heartbeat_sleeps(two_shards):
    """Once every lease is acked the heartbeat thread skips its beats, waiting a period between
    them: the process spends next to no CPU while the stage computes (a spinning heartbeat held
    the GIL and slowed every stage several-fold)."""
    dock = open_dock(DockConfig(timeout_s=2.0, lease_s=0.3, shards=2), GRPO_SCHEMA, run="test")  # a beat every 0.1 s
    try:
        dock.open_iteration(0, 4, 2)
        dock.put(range(4), {"prompt_ids": [[r] for r in range(4)]})
        claim = dock.claim("reward", ["prompt_ids"], 4)  # starts the heartbeat
        dock.put(claim.rows, {"rm_score": [1.0] * 4, "correct": [True] * 4}, ack=claim)  # nothing held now
        cpu, wall = time.process_time(), time.monotonic()
        time.sleep(1.0)
        assert time.monotonic() - wall >= 1.0 and time.process_time() - cpu < 0.3
    finally:
        dock.close()
