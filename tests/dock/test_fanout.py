"""The driver's calls to every shard (open, stats, close) go out at once, and an open that fails on one shard leaves
no shard with the iteration open (docs/dock.md "The scaling model": one after the other they grow with the shards)."""

from __future__ import annotations

import threading
import time

import pytest

from dockrl.dock import GRPO_SCHEMA, DockError
from dockrl.dock.client.dock_client import DockClient
from dockrl.dock.shard.transport import LocalTransport, local_shards

DELAY_S = 0.3


class SlowFakeTransport(LocalTransport):
    """A fake of a far shard: every action waits ``DELAY_S`` first (a round trip), and counts the calls in flight."""

    in_flight = 0
    most = 0
    lock = threading.Lock()

    def action(self, name, body, timeout):
        with SlowFakeTransport.lock:
            SlowFakeTransport.in_flight += 1
            SlowFakeTransport.most = max(SlowFakeTransport.most, SlowFakeTransport.in_flight)
        try:
            time.sleep(DELAY_S)
            return super().action(name, body, timeout)
        finally:
            with SlowFakeTransport.lock:
                SlowFakeTransport.in_flight -= 1


def test_open_stats_and_close_wait_one_round_trip_not_one_per_shard():
    shards = [SlowFakeTransport(s, owned=True) for s in local_shards(6, GRPO_SCHEMA)]
    SlowFakeTransport.most = 0
    with DockClient(shards, GRPO_SCHEMA, timeout_s=30) as dock:
        for call in (lambda: dock.open_iteration(1, 48, 8, announce=False), dock.stats, lambda: dock.close_iteration(1)):
            start = time.perf_counter()
            call()
            assert time.perf_counter() - start < 3 * DELAY_S  # one after the other: 6 round trips, 1.8 s
    assert SlowFakeTransport.most == 6


def test_an_open_refused_by_one_shard_is_closed_on_every_other():
    services = local_shards(4, GRPO_SCHEMA)
    with DockClient([LocalTransport(services[2])], GRPO_SCHEMA, timeout_s=30) as other:  # shard 2 has an iteration open already
        other.open_iteration(7, 8, 8, announce=False)
    with DockClient([LocalTransport(s) for s in services], GRPO_SCHEMA, timeout_s=30) as dock:
        with pytest.raises(DockError, match="open"):
            dock.open_iteration(1, 32, 8, announce=False)
        assert [dock.core.describe(s) for s in (0, 1, 3)] == [None, None, None]
        assert dock.core.describe(2)["iteration"] == 7
