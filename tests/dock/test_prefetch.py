"""Claims ride on puts: a put that acks a claim takes the consumer's next claim of the same shape
in the same round trip; rows are still claimed exactly once, and rows a put took that no claim
uses go back at once (a claim of another shape or iteration, ``close``)."""

from __future__ import annotations

import dataclasses
import threading
from collections.abc import Iterator

import pytest

from dockrl.dock import GRPO_SCHEMA, DockError, DockTimeoutError
from dockrl.dock.client.dock_client import DockClient
from dockrl.dock.flight.shards import start_local_shards
from dockrl.dock.shard.transport import LocalTransport, local_shards

ROWS = 16


@pytest.fixture(params=["flight", "local"])
def shards(request) -> Iterator[list]:
    """Two shards (Flight servers of this process, or in-process services), shared by the clients of a test."""
    if request.param == "flight":
        servers, locations = start_local_shards(2, GRPO_SCHEMA, timeout_s=5.0)
        yield locations
        for s in servers:
            s.close()
    else:
        services = local_shards(2, GRPO_SCHEMA, timeout_s=5.0)
        yield [LocalTransport(s) for s in services]
        for s in services:
            s.close()


def client(shards: list, **kw) -> DockClient:
    return DockClient(shards, GRPO_SCHEMA, **({"timeout_s": 5.0, "first_shard": 0} | kw))


def stage(shards: list, **kw) -> DockClient:
    """A stage's client: it learns the open iteration as a stage does (claims ride on puts only in it)."""
    dock = client(shards, **kw)
    assert dock.wait_iteration(-1, timeout_s=5.0) is not None
    return dock


def open_with_prompts(dock: DockClient, iteration: int = 0) -> None:
    dock.open_iteration(iteration, ROWS, 1)
    dock.put(range(ROWS), {"prompt_ids": [[iteration, r] for r in range(ROWS)]})


def cycle(dock: DockClient, count: int = 2) -> list[int]:
    """One stage cycle of the reward consumer: claim, check the cells, put the scores with the ack."""
    claim = dock.claim("reward", ["prompt_ids"], count)
    assert [c[1] for c in claim.batch.column(0).to_pylist()] == claim.rows  # the cells are the rows'
    if claim.rows:
        dock.put(claim.rows, {"rm_score": [float(r) for r in claim.rows]}, ack=claim)
    return claim.rows


class CountingCalls:
    """Counts the calls a client makes through its transports (wraps them; the calls still go through)."""

    def __init__(self, dock: DockClient, names: tuple[str, ...] = ("claim_cells", "put", "put_claim")) -> None:
        self.calls = dict.fromkeys(names, 0)
        for t in dock.transports:
            for name in names:
                setattr(t, name, self._counted(name, getattr(t, name)))

    def _counted(self, name, fn):
        def call(*args, **kw):
            self.calls[name] += 1
            return fn(*args, **kw)
        return call


def test_a_stage_cycle_costs_one_round_trip_once_claims_ride_on_puts(shards):
    driver = client(shards)
    open_with_prompts(driver)
    dock = stage(shards)
    counted = CountingCalls(dock)
    got = []
    while rows := cycle(dock):
        got += rows
    assert sorted(got) == list(range(ROWS))
    # every put carries the next claim; a claim is its own call only when the shard the put went to had
    # nothing left: the first claim (shard 0), the first of shard 1, the last (shard 0 again, empty)
    assert counted.calls["put_claim"] == ROWS // 2 and counted.calls["put"] == 0
    assert counted.calls["claim_cells"] == 3
    assert driver.get(["rm_score"], range(ROWS)).column(0).to_pylist() == [float(r) for r in range(ROWS)]


def test_without_prefetch_every_claim_is_its_own_call(shards):
    open_with_prompts(client(shards))
    dock = stage(shards, prefetch=False)
    counted = CountingCalls(dock)
    n = 0
    while cycle(dock):
        n += 1
    assert counted.calls["put_claim"] == 0 and counted.calls["put"] == n and counted.calls["claim_cells"] >= n + 1


def test_rows_a_put_took_go_back_when_the_client_closes(shards):
    open_with_prompts(client(shards))
    first = stage(shards, lease_s=300.0)
    taken = cycle(first, 2)
    other = client(shards)
    # the rest, less the rows first's put took for its next claim (leased for 300 s): a short wait, then a timeout
    rest = other.claim("reward", ["prompt_ids"], ROWS)
    assert len(rest.rows) == ROWS - 4 and not set(rest.rows) & set(taken)
    with pytest.raises(DockTimeoutError, match="leased by other owners"):
        other.claim("reward", ["prompt_ids"], 2, timeout_s=0.5)
    first.close()
    back = other.claim("reward", ["prompt_ids"], 2, timeout_s=2.0)  # at once, not after the 300 s lease
    assert sorted(taken + rest.rows + back.rows) == list(range(ROWS))


def test_a_claim_of_another_shape_releases_what_the_put_took(shards):
    open_with_prompts(client(shards))
    dock = stage(shards)
    got = cycle(dock, 2)
    got += cycle(dock, 3)  # another count: the two rows the put took go back, and this claim takes them again
    got += cycle(dock, ROWS)
    assert sorted(got) == list(range(ROWS))
    assert cycle(dock, ROWS) == []


def test_rows_a_put_took_in_a_closed_iteration_are_never_claimed_in_the_next(shards):
    driver = client(shards)
    open_with_prompts(driver, 0)
    dock = stage(shards)
    cycle(dock, 2)  # its put took two more rows of iteration 0
    driver.close_iteration(0)
    open_with_prompts(driver, 1)
    dock.wait_iteration(0, timeout_s=5.0)
    claim = dock.claim("reward", ["prompt_ids"], 2)
    assert claim.iteration == 1 and [c[0] for c in claim.batch.column(0).to_pylist()] == [1, 1]


def test_clients_of_one_consumer_claim_every_row_exactly_once(shards):
    open_with_prompts(client(shards))
    docks = [stage(shards, first_shard=k) for k in range(3)]
    got: list[list[int]] = [[] for _ in docks]
    errors: list[BaseException] = []

    def work(k: int) -> None:
        try:
            while rows := cycle(docks[k], 1 + k):
                got[k] += rows
        except BaseException as e:  # noqa: BLE001 - reported by the test
            errors.append(e)

    threads = [threading.Thread(target=work, args=(k,)) for k in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    assert not errors and not any(t.is_alive() for t in threads)
    assert sorted(r for rows in got for r in rows) == list(range(ROWS))


def test_the_put_lands_when_the_claim_it_carries_fails(shards):
    driver = client(shards)
    open_with_prompts(driver)
    dock = stage(shards)
    claim = dock.claim("reward", ["prompt_ids"], 2)
    bad = dataclasses.replace(claim, shape=(("no_such_column",), 2, False))
    dock.put(claim.rows, {"rm_score": [1.0, 2.0]}, ack=bad)  # the put and its ack land; the carried claim is refused
    assert driver.get(["rm_score"], claim.rows).column(0).to_pylist() == [1.0, 2.0]
    with pytest.raises(DockError, match="no_such_column"):
        dock.claim("reward", ["no_such_column"], 2)
    assert len(cycle(dock, ROWS)) == ROWS - 2  # the acked rows are done; nothing else is held


def test_with_a_locality_hint_only_the_local_shard_carries_claims(shards):
    driver = client(shards)
    open_with_prompts(driver)
    drain = stage(shards, prefetch=False)
    assert len(drain.claim("reward", ["prompt_ids"], ROWS // 2, timeout_s=1.0).rows) == ROWS // 2  # shard 0's rows
    dock = stage(shards, local_shard=1)
    counted = CountingCalls(dock)
    got = []
    for _ in range(ROWS // 4):  # shard 1's rows: local, each claim after the first carried by a put
        got += cycle(dock, 2)
    assert sorted(got) == list(range(ROWS // 2, ROWS)) and counted.calls["put_claim"] == ROWS // 4
    driver.release_owner(drain.owner)  # its rows go back (as if it died): the local client steals them from shard 0
    counted.calls["put_claim"] = 0
    while rows := cycle(dock, 2):
        got += rows
    assert sorted(got) == list(range(ROWS)) and counted.calls["put_claim"] == 0  # a put to another shard carries no claim


def test_a_late_release_never_hands_back_rows_another_claim_holds(shards):
    driver = client(shards)
    open_with_prompts(driver)
    first = stage(shards)
    cycle(first, 2)  # its put took rows 2, 3 for its next claim
    assert driver.release_owner(first.owner) == 2  # as if its process were gone: the rows go back
    second = stage(shards)
    held = second.claim("reward", ["prompt_ids"], 2)
    assert held.rows == [2, 3]
    first.close()  # hands back what its put took: nothing of it is still under its lease
    third = stage(shards)
    rest = third.claim("reward", ["prompt_ids"], ROWS)
    assert not set(rest.rows) & {2, 3}
    second.put(held.rows, {"rm_score": [2.0, 3.0]}, ack=held)  # the ack of the rows' holder is accepted


def test_a_client_that_did_not_learn_the_iteration_carries_no_claim(shards):
    open_with_prompts(client(shards))
    dock = client(shards)
    counted = CountingCalls(dock)
    while cycle(dock, 4):
        pass
    assert counted.calls["put_claim"] == 0 and counted.calls["put"] == ROWS // 4


def held_by_puts(dock: DockClient) -> list[str]:
    """The leases of rows ``dock``'s puts took and no claim used yet (what it renews and would hand back)."""
    return [t.lease for t in dock.core.prefetched.values() if t.lease in dock.heartbeat.held]


def test_a_client_that_closes_its_iteration_forgets_what_its_puts_took_and_claims_from_the_next(shards):
    dock = client(shards)  # opens the iterations itself, as the in-process dock of a run
    open_with_prompts(dock, 0)
    cycle(dock, 2)
    assert len(held_by_puts(dock)) == 1  # its put took two more rows of iteration 0
    dock.close_iteration(0)
    assert dock.core.prefetched == {} and dock.heartbeat.held == {}  # nothing left to renew or hand back
    open_with_prompts(dock, 1)
    claim = dock.claim("reward", ["prompt_ids"], 2)
    assert claim.iteration == 1 and [c[0] for c in claim.batch.column(0).to_pylist()] == [1, 1]


def test_a_restore_forgets_what_puts_took_and_those_rows_are_claimed_again(shards, tmp_path):
    driver, dock = client(shards), client(shards)
    open_with_prompts(dock, 0)
    got = cycle(dock, 2)  # rows 0, 1 acked; its put took 2, 3
    assert len(held_by_puts(dock)) == 1
    dock.snapshot(str(tmp_path / "snap"))
    driver.close_iteration()  # another client closes it: this one still holds what its put took
    dock.restore(str(tmp_path / "snap"))  # un-acked leases end: rows 2, 3 are back in the pool
    assert dock.core.prefetched == {} and dock.heartbeat.held == {}
    dock.announce(0)  # the restored iteration is this client's: its puts carry claims again
    counted = CountingCalls(dock)
    while rows := cycle(dock, 2):
        got += rows
    assert sorted(got) == list(range(ROWS)) and counted.calls["put_claim"] == (ROWS - 2) // 2


def test_the_shard_refuses_a_carried_claim_that_waits_or_is_for_another_iteration():
    import pyarrow as pa

    from dockrl.dock.shard.requests import ClaimRequest
    from dockrl.dock.shard.service import ShardService

    svc = ShardService(GRPO_SCHEMA, name="local://shard-0", timeout_s=5.0)
    dock = DockClient([LocalTransport(svc)], GRPO_SCHEMA)
    open_with_prompts(dock)
    batch = pa.record_batch([pa.array([0], type=pa.int64()), pa.array([1.0], type=pa.float32())], names=["row", "rm_score"])
    for bad in ({"iteration": 1}, {"at_least": 1}, {"wait_held": True}):
        req = ClaimRequest(0, "reward", ("prompt_ids",), 2, 0, False, 0.0, "o", "l", 60.0, False)._replace(**bad)
        with pytest.raises(DockError, match="the claim a put carries takes what is ready now in the put's iteration 0"):
            svc.put_claim(0, batch, None, req)
    assert dock.get(["prompt_ids"], [0]).num_rows == 1
    with pytest.raises(DockError, match="not yet written|not written"):
        dock.get(["rm_score"], [0])  # nothing of the refused put was written
    svc.close()


def test_dock_prefetch_false_turns_it_off_in_the_in_process_dock():
    from dockrl.config import load_config
    from dockrl.dock import open_dock

    for value, expected in (("true", True), ("false", False)):
        cfg = load_config(None, [f"dock.prefetch={value}"]).dock
        dock = open_dock(cfg, GRPO_SCHEMA, run="prefetch")
        assert dock.prefetch is expected
        dock.close()


def test_rows_the_claim_took_go_back_when_the_answer_of_the_put_is_lost(shards):
    open_with_prompts(client(shards))
    dock = stage(shards, lease_s=300.0)
    claim = dock.claim("reward", ["prompt_ids"], 2)
    transport = dock.transports[0]
    real = transport.put_claim

    def lost_answer(*args, **kw):  # a FAKE network failure: the shard did the put and the claim, the answer never came
        real(*args, **kw)
        raise ConnectionError("the answer was lost")

    transport.put_claim = lost_answer
    with pytest.raises(ConnectionError):
        dock.put(claim.rows, {"rm_score": [1.0, 2.0]}, ack=claim)
    assert dock.core.prefetched == {} and dock.heartbeat.held == {}
    other = stage(shards)
    rest = other.claim("reward", ["prompt_ids"], ROWS, timeout_s=2.0)  # at once: nothing is left leased to the first client
    assert sorted(rest.rows) == list(range(2, ROWS))
