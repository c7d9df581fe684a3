"""Tests of ``Dock.drop``: dropped rows count as done for every consumer that has not taken them.

Run on the in-process dock with one and two shards and on Flight shards (``dock.mode=distributed``).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator

import pytest

from dockrl.config import DockConfig
from dockrl.dock import GRPO_SCHEMA, Dock, DockError, open_dock
from dockrl.dock.client.dock_client import DockClient
from dockrl.dock.flight.shards import start_local_shards


@pytest.fixture(params=["inprocess", "inprocess-2shards", "flight-2shards"])
def dock(request: pytest.FixtureRequest) -> Iterator[Dock]:
    """A dock with iteration 0 open: 4 groups of 2 rows."""
    servers = []
    if request.param.startswith("flight"):
        servers, locations = start_local_shards(2, GRPO_SCHEMA, timeout_s=5.0)
        d: Dock = DockClient(locations, GRPO_SCHEMA, timeout_s=5.0, rpc_timeout_s=10.0)
    else:
        d = open_dock(DockConfig(timeout_s=5.0, shards=2 if "2shards" in request.param else 1), GRPO_SCHEMA, run="test")
    d.open_iteration(0, 8, 2)
    yield d
    d.close()
    for server in servers:
        server.close()


def put_prompts(dock: Dock, rows) -> None:
    rows = list(rows)
    dock.put(rows, {"prompt_ids": [[r] for r in rows]})


def test_dropped_rows_are_never_claimed_and_the_consumer_ends(dock):
    put_prompts(dock, range(8))
    dock.drop([2, 3, 6, 7])
    rows = []
    while claim := dock.claim("rollout", ["prompt_ids"], 2, whole_groups=True):
        rows += claim.rows
    assert sorted(rows) == [0, 1, 4, 5]
    # another consumer: the same rows are gone for it too
    assert sorted(dock.claim("reward", ["prompt_ids"], 8).rows) == [0, 1, 4, 5]


def test_rows_taken_before_the_drop_stay_with_their_consumer(dock):
    put_prompts(dock, range(8))
    taken = dock.claim("rollout", ["prompt_ids"], 8, whole_groups=True)
    dock.drop(range(8))
    dock.put(taken.rows, {"response_ids": [[1]] * 8}, ack=taken)  # its put and ack still succeed
    assert not dock.claim("rollout", ["prompt_ids"], 2)
    assert not dock.claim("reward", ["prompt_ids", "response_ids"], 8)  # reward had taken none of them


def test_a_blocked_claim_ends_empty_when_its_rows_are_dropped(dock):
    """Rows that will never be ready (a gate column never written) end a waiting claim once dropped."""
    put_prompts(dock, range(8))
    got: list = []
    waiter = threading.Thread(target=lambda: got.append(dock.claim("reward", ["prompt_ids", "response_ids"], 4)), daemon=True)
    start = time.monotonic()
    waiter.start()
    time.sleep(0.2)
    dock.drop(range(8))
    waiter.join(4)
    assert not waiter.is_alive() and time.monotonic() - start < 3.0
    assert got and got[0].rows == []


def test_drop_is_idempotent_and_checks_rows(dock):
    dock.drop([0, 1])
    dock.drop([0, 1])
    with pytest.raises(DockError, match="out of range"):
        dock.drop([8])
    with pytest.raises(DockError, match="iteration 3 is not open"):
        dock.drop([0], iteration=3)


def test_dropped_rows_stay_dropped_after_a_snapshot_and_restore(dock, tmp_path):
    put_prompts(dock, range(8))
    dock.drop([0, 1])
    dock.snapshot(str(tmp_path / "snap"))
    dock.close_iteration()
    dock.restore(str(tmp_path / "snap"))
    assert sorted(dock.claim("rollout", ["prompt_ids"], 6).rows) == [2, 3, 4, 5, 6, 7]
