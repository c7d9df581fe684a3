"""Tests of claim leases: ack, expiry, renewal, release of a dead owner, and when a consumer is done."""

from __future__ import annotations

import dataclasses
import threading
import time
from collections.abc import Iterator

import lease_helpers as lh
import pytest

from dockrl.dock import GRPO_SCHEMA, DockError, DockTimeoutError
from dockrl.dock.client.dock_client import DockClient
from dockrl.dock.flight.server import DockShardServer
from dockrl.dock.flight.shards import start_local_shards
from dockrl.dock.shard.controller import ShardController

TOKEN = "lease-token"


@pytest.fixture(autouse=True, scope="module")
def warm_arrow() -> None:
    """Load Arrow's compute kernels once: the first ``take`` costs ~0.4 s, longer than the short leases here."""
    lh.claim(make_dock(), "reward", ["prompt_ids"], 4)


def prompt_cell(row: int) -> list[int]:
    return [row, row + 100]


def make_dock(num_rows: int = 4, group_size: int = 2, lease_s: float = 300.0) -> ShardController:
    dock = ShardController(GRPO_SCHEMA, timeout_s=5.0, lease_s=lease_s)
    dock.open_iteration(0, num_rows, group_size)
    dock.put(range(num_rows), {"prompt_ids": [prompt_cell(r) for r in range(num_rows)]})
    return dock


def in_thread(fn) -> tuple[threading.Thread, list]:
    out: list = []

    def run() -> None:
        try:
            out.append(fn())
        except BaseException as e:  # noqa: BLE001 - handed to the main thread
            out.append(e)

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    return thread, out


# --- in-process dock ---------------------------------------------------------------------------


def test_claim_carries_a_lease_and_ack_ends_it_for_good():
    dock = make_dock()
    claim = lh.claim(dock, "reward", ["prompt_ids"], 4, owner="a")
    assert claim.lease and claim.consumer == "reward"
    lh.ack(dock, claim)
    lh.ack(dock, claim)  # idempotent
    empty = lh.claim(dock, "reward", ["prompt_ids"], 4, owner="b", timeout_s=0.1)  # would wait if a still held rows
    assert empty.rows == [] and empty.lease == ""
    lh.ack(dock, empty)  # no rows, no lease: a no-op
    assert dock.release_owner("a") == 0  # nothing left to return


def test_expired_lease_returns_rows_and_a_late_ack_names_the_re_delivered_rows():
    dock = make_dock(lease_s=0.2)
    first = lh.claim(dock, "reward", ["prompt_ids"], 3, owner="slow")
    time.sleep(0.3)
    again = lh.claim(dock, "reward", ["prompt_ids"], 4, owner="fresh")
    assert again.rows == [0, 1, 2, 3]  # the expired rows are back in the ready pool
    with pytest.raises(DockError) as info:
        lh.ack(dock, first)
    msg = str(info.value)
    assert "ack by 'reward'" in msg and "[0, 1, 2]" in msg and "re-delivered" in msg
    lh.ack(dock, again)
    assert dock.stats()["dock/leases_expired"] == 1 and dock.stats()["dock/rows_returned"] == 3


def test_a_late_ack_finds_the_rows_of_every_end_of_its_lease():
    """Regression: a lease id that ended, was taken up again and ended again kept only the rows
    of its last end, so a late ack of a row of the first one (nobody re-claimed it) was refused."""
    dock = make_dock(lease_s=0.2)
    assert dock.take("reward", ["prompt_ids"], 2, at_least=0, owner="a", lease="L").rows == [0, 1]
    time.sleep(0.3)
    assert dock.take("reward", ["prompt_ids"], 1, at_least=0, owner="a", lease="L").rows == [0]  # after L's expiry
    time.sleep(0.3)
    dock.ack_rows("reward", "L", [0, 1])  # both back in the pool, re-claimed by nobody: the work stands
    assert lh.claim(dock, "reward", ["prompt_ids"], 2, owner="b").rows == [2, 3]


def test_ack_of_rows_never_leased_under_the_lease_is_refused():
    dock = make_dock()
    claim = lh.claim(dock, "reward", ["prompt_ids"], 2)
    forged = dataclasses.replace(claim, rows=[1, 2, 3])
    with pytest.raises(DockError, match=r"rows \[2, 3\] are not leased to 'reward' under lease '[0-9a-f]+' in iteration 0"):
        lh.ack(dock, forged)
    assert lh.claim(dock, "reward", ["prompt_ids"], 2, owner="b").rows == [2, 3]  # the refused rows stay free


def test_late_ack_is_accepted_when_nobody_re_claimed_the_rows():
    dock = make_dock(lease_s=0.2)
    claim = lh.claim(dock, "reward", ["prompt_ids"], 4)
    time.sleep(0.3)
    lh.ack(dock, claim)  # expired, but nobody took the rows since: the work stands
    assert lh.claim(dock, "reward", ["prompt_ids"], 4, owner="other", timeout_s=0.1).rows == []


def test_rows_whose_outputs_are_written_are_not_re_delivered_when_the_lease_ends():
    dock = make_dock()
    claim = lh.claim(dock, "reward", ["prompt_ids"], 4, owner="dies-after-put")
    dock.put([0, 1], {"rm_score": [1.0, 2.0], "correct": [True, False]})  # every column reward produces
    dock.put([2], {"rm_score": [3.0]})  # one output of two: not finished
    assert dock.release_owner("dies-after-put") == 2  # ends the lease as an expiry would, without a clock
    assert lh.claim(dock, "reward", ["prompt_ids"], 4, owner="replacement").rows == [2, 3]
    with pytest.raises(DockError, match=r"rows \[2, 3\] were re-delivered"):
        lh.ack(dock, claim)  # rows 0 and 1 are accepted, the others were handed on


def test_a_whole_group_lease_returns_a_partly_finished_group_whole():
    dock = make_dock(num_rows=4, group_size=2)
    dock.put(range(4), {"rm_score": [0.0] * 4})
    claim = lh.claim(dock, "advantage", ["rm_score"], 4, whole_groups=True, owner="a")
    # every output of the advantage stage (advantages and returns): group 0 finished, group 1 half
    dock.put([0, 1, 2], {"advantages": [[0.5], [-0.5], [0.1]], "returns": [[0.5], [-0.5], [0.1]]})
    assert dock.release_owner("a") == 2
    again = lh.claim(dock, "advantage", ["rm_score"], 4, whole_groups=True, owner="b")
    assert again.rows == [2, 3]
    with pytest.raises(DockError, match=r"rows \[2, 3\]"):
        lh.ack(dock, claim)


def test_empty_claim_waits_for_rows_other_owners_hold_then_returns_at_their_ack():
    dock = make_dock()
    held = lh.claim(dock, "reward", ["prompt_ids"], 4, owner="a")
    assert lh.claim(dock, "reward", ["prompt_ids"], 4, owner="a").rows == []  # its own leases: done at once
    with pytest.raises(DockTimeoutError) as info:
        lh.claim(dock, "reward", ["prompt_ids"], 4, owner="b", timeout_s=0.2)
    assert "4 rows are leased by other owners" in str(info.value)
    thread, out = in_thread(lambda: lh.claim(dock, "reward", ["prompt_ids"], 4, owner="b"))
    time.sleep(0.1)
    assert thread.is_alive()
    lh.ack(dock, held)
    thread.join(2)
    assert out[0].rows == []


def test_a_blocked_claim_wakes_at_the_expiry_of_another_owners_lease():
    dock = make_dock(lease_s=0.3)
    lh.claim(dock, "reward", ["prompt_ids"], 4, owner="dead")
    start = time.monotonic()
    claim = lh.claim(dock, "reward", ["prompt_ids"], 4, owner="b", timeout_s=30.0)  # woken by the expiry, not a poll
    assert claim.rows == [0, 1, 2, 3]
    assert 0.25 <= time.monotonic() - start < 10.0  # far below the claim's timeout


def test_renew_keeps_a_slow_owners_rows():
    dock = make_dock(lease_s=1.0)
    claim = lh.claim(dock, "reward", ["prompt_ids"], 4, owner="slow")
    thread, out = in_thread(lambda: lh.claim(dock, "reward", ["prompt_ids"], 4, owner="b", timeout_s=1.6))
    for _ in range(8):
        time.sleep(0.25)
        assert dock.renew("slow") == 1
    thread.join(3)
    assert isinstance(out[0], DockTimeoutError)
    lh.ack(dock, claim)
    assert dock.renew("slow") == 0


def test_release_owner_returns_its_rows_at_once():
    dock = make_dock()
    lh.claim(dock, "reward", ["prompt_ids"], 3, owner="dead")
    lh.claim(dock, "reference", ["prompt_ids"], 2, owner="dead")
    acked = lh.claim(dock, "reward", ["prompt_ids"], 1, owner="alive")
    lh.ack(dock, acked)
    thread, out = in_thread(lambda: lh.claim(dock, "reward", ["prompt_ids"], 4, owner="b"))
    time.sleep(0.1)
    assert dock.release_owner("dead") == 5
    thread.join(2)
    assert out[0].rows == [0, 1, 2]
    assert dock.release_owner("dead") == 0
    assert lh.claim(dock, "reference", ["prompt_ids"], 4, owner="b").rows == [0, 1, 2, 3]


def test_lease_misuse_is_refused():
    with pytest.raises(ValueError, match="lease_s=0"):
        ShardController(GRPO_SCHEMA, lease_s=0)
    dock = make_dock()
    taken = dock.take("reward", ["prompt_ids"], 2, owner="a", lease="L1")
    assert taken.rows == [0, 1] and taken.lease == "L1" and taken.pending == 2 and taken.held == 0
    with pytest.raises(DockError, match="lease 'L1' belongs to owner 'a'"):
        dock.take("reward", ["prompt_ids"], 2, owner="b", lease="L1")
    with pytest.raises(DockError, match="lease_s=-1"):
        lh.claim(dock, "reward", ["prompt_ids"], 1, lease_s=-1)
    dock.ack_rows("reward", "L1", [0])
    with pytest.raises(DockError, match=r"rows \[0\] are already acked"):
        dock.release("reward", [0, 1])
    assert dock.take("reward", ["prompt_ids"], 2, owner="c").held == 1  # row 1 is still a's
    with pytest.raises(DockError, match="iteration 3 is not open"):
        dock.ack_rows("reward", "L1", [1], iteration=3)


def test_no_open_iteration_renew_and_release_owner_are_no_ops():
    dock = ShardController(GRPO_SCHEMA)
    assert dock.renew("x") == 0 and dock.release_owner("x") == 0


# --- over Flight ---------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def shards() -> Iterator[list[str]]:
    servers, locations = start_local_shards(3, GRPO_SCHEMA, token=TOKEN)
    yield locations
    for server in servers:
        server.close()


def connect(locations: list[str], **kw) -> DockClient:
    return DockClient(locations, GRPO_SCHEMA, token=TOKEN, timeout_s=5.0, rpc_timeout_s=10.0, first_shard=0, **kw)


@pytest.fixture
def opened(shards: list[str]) -> Iterator[DockClient]:
    driver = connect(shards)
    driver.open_iteration(0, 12, 2)  # shards own rows 0..3, 4..7, 8..11
    driver.put(range(12), {"prompt_ids": [prompt_cell(r) for r in range(12)]})
    yield driver
    driver.close_iteration()
    driver.close()


def test_client_ack_reaches_every_shard_of_the_claim(opened, shards):
    a, b = connect(shards), connect(shards)
    assert a.owner != b.owner
    claim = a.claim("reward", ["prompt_ids"], 12)
    assert claim.rows == list(range(12)) and claim.consumer == "reward" and claim.lease
    thread, out = in_thread(lambda: b.claim("reward", ["prompt_ids"], 4))
    time.sleep(0.2)
    assert thread.is_alive()  # a holds every row on every shard
    a.ack(claim)
    thread.join(3)
    assert out[0].rows == []
    a.close(), b.close()


@pytest.mark.parametrize("rows", [None, [0, 5, 9]])  # the claim's rows: acked with the put; others: put, then ack
def test_client_put_with_ack_ends_the_lease_on_every_shard(opened, shards, rows):
    a = connect(shards)
    claim = a.claim("reward", ["prompt_ids"], 12)
    put_rows = claim.rows if rows is None else rows
    before = a.controller_bytes
    a.put(put_rows, {"rm_score": [float(r) for r in put_rows], "correct": [True] * len(put_rows)}, ack=claim)
    assert (a.controller_bytes - before > 0) and not a.heartbeat.held  # the ack's metadata counted; nothing left to renew
    assert a.release_owner(a.owner) == 0  # every row acked
    assert opened.get(["rm_score"], put_rows).column(0).to_pylist() == [float(r) for r in put_rows]
    assert connect(shards).claim("reward", ["prompt_ids"], 4, timeout_s=0.2).rows == []
    a.close()


def test_client_put_with_a_stale_ack_still_writes_then_fails(opened, shards):
    a = connect(shards)
    claim = a.claim("reward", ["prompt_ids"], 12)
    a.release_owner(a.owner)  # the lease ended: its rows went back to the pool
    b = connect(shards)
    again = b.claim("reward", ["prompt_ids"], 12)  # and were re-delivered
    with pytest.raises(DockError, match="re-delivered"):
        a.put(claim.rows, {"rm_score": [0.0] * 12, "correct": [False] * 12}, ack=claim)
    assert opened.get(["rm_score"], [0]).column(0).to_pylist() == [0.0]  # the put itself landed, as put-then-ack would
    b.ack(again)
    a.close(), b.close()


def test_client_heartbeat_keeps_a_slow_workers_rows(opened, shards):
    slow, other = connect(shards, lease_s=0.9), connect(shards)
    claim = slow.claim("reward", ["prompt_ids"], 12)
    with pytest.raises(DockTimeoutError, match="12 rows are leased by other owners"):
        other.claim("reward", ["prompt_ids"], 4, timeout_s=2.0)  # > 2 lease terms: the heartbeat renewed them
    slow.ack(claim)
    assert other.claim("reward", ["prompt_ids"], 4).rows == []
    slow.close(), other.close()


def test_rows_of_a_client_that_stopped_renewing_come_back(opened, shards):
    dead = connect(shards, lease_s=0.3)
    claim = dead.claim("reward", ["prompt_ids"], 6)
    dead.close()  # stops the heartbeat, as the death of its process would
    survivor = connect(shards)
    start = time.monotonic()
    assert survivor.claim("reward", ["prompt_ids"], 12).rows == list(range(6, 12))  # the rows nobody held
    got = []
    while len(got) < 6:  # nothing free: waits for the dead owner's rows on shards 0, 1 (they expire within ms)
        claim_back = survivor.claim("reward", ["prompt_ids"], 12)
        assert claim_back.rows
        got += claim_back.rows
        survivor.ack(claim_back)
    assert sorted(got) == list(range(6)) and time.monotonic() - start < 4.0  # the claims' timeout is 5 s
    lost = connect(shards)
    with pytest.raises(DockError) as info:
        lost.ack(claim)
    msg = str(info.value)
    assert "re-delivered" in msg and "'reward'" in msg and "[0, 1, 2, 3]" in msg and "[4, 5]" in msg
    assert survivor.claim("reward", ["prompt_ids"], 12).rows == []  # the first survivor claim is its own
    survivor.close(), lost.close()


def test_rows_a_claim_took_stay_leased_while_it_waits_on_another_shard(shards):
    """Regression: rows the sweep took on shard 0 expired while the claim waited on shard 1 for
    longer than a lease term, and went to a second client too (both then computed them)."""
    driver = connect(shards)
    driver.open_iteration(0, 12, 2)  # shards own rows 0..3, 4..7, 8..11
    try:
        driver.put(range(4), {"prompt_ids": [prompt_cell(r) for r in range(4)]})
        waiting = connect(shards, lease_s=0.6)
        thread, out = in_thread(lambda: waiting.claim("reward", ["prompt_ids"], 6))  # takes 0..3, waits for 2 more
        time.sleep(2.0)  # three lease terms
        other = connect(shards)
        with pytest.raises(DockTimeoutError, match="4 rows are leased by other owners"):
            other.claim("reward", ["prompt_ids"], 2, timeout_s=0.5)
        driver.put(range(4, 12), {"prompt_ids": [prompt_cell(r) for r in range(4, 12)]})
        thread.join(5)
        assert out[0].rows == list(range(6))
        assert other.claim("reward", ["prompt_ids"], 12).rows == list(range(6, 12))
        waiting.ack(out[0])
        waiting.close(), other.close()
    finally:
        driver.close_iteration()
        driver.close()


def test_a_shard_slow_to_answer_renewals_costs_no_other_shard_its_leases(monkeypatch):
    """Regression: the heartbeat renewed shard after shard, so one shard answering slowly (a
    loaded machine) delayed every later shard's renewal past the lease term: live workers lost
    their rows, which went to a second worker too."""
    servers, locations = start_local_shards(2, GRPO_SCHEMA, token=TOKEN)
    renew = servers[0].service.actions["renew"]

    def slow_renew(req):  # renews at once, answers 3 s later: longer than the 1.5 s lease
        out = renew(req)
        time.sleep(3.0)
        return out

    monkeypatch.setitem(servers[0].service.actions, "renew", slow_renew)
    driver = connect(locations)
    try:
        driver.open_iteration(0, 8, 2)  # shard 0 owns rows 0..3, shard 1 rows 4..7
        driver.put(range(8), {"prompt_ids": [prompt_cell(r) for r in range(8)]})
        worker = connect(locations, lease_s=1.5)
        claim = worker.claim("reward", ["prompt_ids"], 8)
        time.sleep(3.0)  # two lease terms: shard 1 renewed meanwhile (shard 0 gets a renewal per answer)
        assert servers[1].dock.take("reward", ["prompt_ids"], 4, at_least=0, owner="other").rows == []
        assert servers[1].dock.stats()["dock/leases_expired"] == 0
        worker.ack(claim)
        worker.close()
    finally:
        driver.close_iteration()
        driver.close()
        for server in servers:
            server.close()


def test_a_renewal_answered_in_one_iteration_keeps_the_leases_of_the_next(shards):
    """Regression: the heartbeat read a renewal's answer a beat later; one sent in iteration 0
    and read in iteration 1 made it stop renewing the claims of iteration 1, which expired."""
    driver = connect(shards)
    worker = connect(shards, lease_s=0.9)
    try:
        driver.open_iteration(0, 6, 2)
        driver.put(range(6), {"prompt_ids": [prompt_cell(r) for r in range(6)]})
        claim = worker.claim("reward", ["prompt_ids"], 6)
        time.sleep(0.45)  # one beat (every 0.3 s): its answer says iteration 0
        worker.ack(claim)
        driver.close_iteration()
        driver.open_iteration(1, 6, 2)
        driver.put(range(6), {"prompt_ids": [prompt_cell(r) for r in range(6)]})
        claim = worker.claim("reward", ["prompt_ids"], 6)
        time.sleep(2.5)  # almost three lease terms
        other = connect(shards)
        with pytest.raises(DockTimeoutError, match="6 rows are leased by other owners"):
            other.claim("reward", ["prompt_ids"], 2, timeout_s=0.5)
        worker.ack(claim)
        other.close()
    finally:
        worker.close()
        driver.close_iteration()
        driver.close()


def test_release_owner_over_flight(opened, shards):
    worker = connect(shards, owner="rollout-0")
    assert worker.owner == "rollout-0"
    worker.claim("rollout", ["prompt_ids"], 8, whole_groups=True)
    worker.close()
    launcher = connect(shards)
    assert launcher.release_owner("rollout-0") == 8
    assert launcher.claim("rollout", ["prompt_ids"], 12, whole_groups=True).rows == list(range(12))
    launcher.close()


def test_renew_over_flight_counts_leases_on_every_shard(opened, shards):
    worker = connect(shards)
    worker.claim("reward", ["prompt_ids"], 12)  # one lease id, on three shards
    worker.claim("reference", ["prompt_ids"], 2)
    assert worker.renew() == 4
    worker.close()


def test_client_refuses_a_bad_lease_term(shards):
    with pytest.raises(ValueError, match="lease_s=0"):
        connect(shards, lease_s=0)


def test_heartbeat_thread_stops_on_close(opened, shards):
    worker = connect(shards, lease_s=0.3)
    worker.claim("reward", ["prompt_ids"], 2)
    beat = worker.heartbeat.thread
    assert beat is not None and beat.is_alive()
    worker.close()
    assert not beat.is_alive()


def test_shard_cli_refuses_a_bad_lease_term(capsys):
    from dockrl.dock.flight.shards import serve_shard

    with pytest.raises(SystemExit):
        serve_shard(["--lease-s", "0"])
    assert "--lease-s" in capsys.readouterr().err


def test_server_default_lease_applies_to_claims_without_a_term():
    server = DockShardServer(GRPO_SCHEMA, lease_s=0.2)
    try:
        assert server.dock.lease_s == 0.2
    finally:
        server.close()
