"""Several iterations open in the dock at once (``dock.max_inflight``): each stage claims from the
iteration it waits for, every row of every iteration is handed out once per consumer, closing one
leaves the other, and a snapshot holds both."""

from __future__ import annotations

import threading
from collections.abc import Iterator

import pytest

from dockrl.dock import GRPO_SCHEMA, DockError
from dockrl.dock.client.dock_client import DockClient
from dockrl.dock.flight.shards import start_local_shards
from dockrl.dock.shard.transport import LocalTransport, local_shards

TOKEN = "inflight-token"
ROWS, GROUP = 8, 2


@pytest.fixture(params=["inprocess", "flight"])
def shards(request: pytest.FixtureRequest) -> Iterator[list]:
    """Two shards, in this process or as Flight servers; each test connects its own clients."""
    if request.param == "inprocess":
        services = local_shards(2, GRPO_SCHEMA, timeout_s=5.0)
        yield [LocalTransport(s) for s in services]
        for s in services:
            s.close()
        return
    servers, locations = start_local_shards(2, GRPO_SCHEMA, token=TOKEN)
    yield locations
    for server in servers:
        server.close()


def connect(shards: list, **kw) -> DockClient:
    return DockClient(shards, GRPO_SCHEMA, token=TOKEN, timeout_s=5.0, rpc_timeout_s=10.0, **kw)


def prompt(iteration: int, row: int) -> list[int]:
    return [iteration, row]


def open_filled(driver: DockClient, iteration: int) -> None:
    driver.open_iteration(iteration, ROWS, GROUP)
    driver.put(range(ROWS), {"prompt_ids": [prompt(iteration, r) for r in range(ROWS)]}, iteration=iteration)


def test_two_open_iterations_each_row_once_per_consumer_in_its_own_iteration(shards):
    driver = connect(shards, max_inflight=2)
    rollout, reward = connect(shards), connect(shards)
    try:
        open_filled(driver, 0)
        open_filled(driver, 1)
        with pytest.raises(DockError, match=r"iterations \[0, 1\] are still open \(at most 2: dock.max_inflight\)"):
            driver.open_iteration(2, ROWS, GROUP)
        # the rollout generates iteration 1 while the reward stage still scores iteration 0, claim by claim
        assert reward.wait_iteration(-1) == 0
        assert rollout.wait_iteration(0) == 1
        seen: dict[tuple[str, int], list[int]] = {}
        for client, consumer, columns in [(rollout, "rollout", ["prompt_ids"]), (reward, "reward", ["prompt_ids"])]:
            while claim := client.claim(consumer, columns, 2 * GROUP, whole_groups=True):
                prompts = claim.batch.column("prompt_ids").to_pylist()
                assert prompts == [prompt(claim.iteration, r) for r in claim.rows]  # the cells of its own iteration
                client.put(claim.rows, {"truncated": [False] * len(claim)} if consumer == "rollout" else
                           {"rm_score": [1.0] * len(claim), "correct": [True] * len(claim)}, ack=claim)
                seen.setdefault((consumer, claim.iteration), []).extend(claim.rows)
        assert {k: sorted(v) for k, v in seen.items()} == {("rollout", 1): list(range(ROWS)), ("reward", 0): list(range(ROWS))}
        assert driver.get(["truncated"], range(ROWS), iteration=1).column(0).to_pylist() == [False] * ROWS
        with pytest.raises(DockError, match="not yet written"):
            driver.get(["truncated"], [0], iteration=0)  # iteration 0's rollout column is its own
        driver.close_iteration(0)
        with pytest.raises(DockError, match="iteration 0 is not open; the open iteration is 1"):
            reward.claim("reward", ["prompt_ids"], GROUP)  # its iteration closed: never another iteration's rows
        assert reward.wait_iteration(0) == 1
        rows = []
        while claim := reward.claim("reward", ["prompt_ids"], GROUP):
            rows += claim.rows
            reward.ack(claim)
        assert sorted(rows) == list(range(ROWS))
        open_filled(driver, 2)  # one closed: room for the next
    finally:
        for client in (rollout, reward, driver):
            client.close_iteration() if client is driver else None
            client.close()


def test_claims_blocked_in_each_iteration_wake_for_their_own_rows(shards):
    driver = connect(shards, max_inflight=2)
    stages = [connect(shards), connect(shards)]
    try:
        for it in (0, 1):
            driver.open_iteration(it, ROWS, GROUP)
        for it, stage in enumerate(stages):
            assert stage.wait_iteration(it - 1) == it
        got: dict[int, list[int]] = {}

        def claim(it: int) -> None:
            got[it] = stages[it].claim("reward", ["prompt_ids"], ROWS).rows

        threads = [threading.Thread(target=claim, args=(it,)) for it in (1, 0)]
        for t in threads:
            t.start()
        for it in (1, 0):  # iteration 1's prompts first: only its claim may return
            driver.put(range(ROWS), {"prompt_ids": [prompt(it, r) for r in range(ROWS)]}, iteration=it)
        for t in threads:
            t.join(10)
        assert got == {0: list(range(ROWS)), 1: list(range(ROWS))}
    finally:
        driver.close_iteration()
        for c in (*stages, driver):
            c.close()


def test_a_snapshot_with_two_open_iterations_restores_both(shards, tmp_path):
    driver = connect(shards, max_inflight=2)
    stage = connect(shards)
    try:
        open_filled(driver, 4)
        open_filled(driver, 5)
        assert stage.wait_iteration(4) == 5
        claim = stage.claim("rollout", ["prompt_ids"], 2 * GROUP, whole_groups=True)
        stage.put(claim.rows, {"truncated": [True] * len(claim)}, ack=claim)
        driver.snapshot(str(tmp_path / "snap"))
        driver.close_iteration()
        driver.restore(str(tmp_path / "snap"))
        for it in (4, 5):
            assert driver.get(["prompt_ids"], range(ROWS), iteration=it).column(0).to_pylist() == [prompt(it, r) for r in range(ROWS)]
        assert driver.get(["truncated"], claim.rows, iteration=5).column(0).to_pylist() == [True] * len(claim)
        driver.announce(4)
        driver.announce(5)
        assert stage.wait_iteration(4) == 5
        left = stage.claim("rollout", ["prompt_ids"], ROWS, whole_groups=True)
        assert sorted(left.rows) == sorted(set(range(ROWS)) - set(claim.rows))  # acked rows stay taken after the restore
    finally:
        driver.close_iteration()
        stage.close()
        driver.close()
