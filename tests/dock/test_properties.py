"""Property tests of the distributed dock: shard processes, worker processes, SIGKILLs, snapshots.

Shards run as ``python -m dockrl.dock.flight.shards`` processes; stage-like workers (``dock_workers``)
run as spawned processes doing claim → put → ack loops for two consumers (reward: two
workers; advantage: one, whole groups, on reward's output). Hypothesis draws the shard count,
the table, the batch sizes, when prompts arrive, which workers are SIGKILLed at which point
(after a claim, a put or an ack; with or without ``release_owner``; a replacement takes over),
and when a snapshot is taken. Checked: each consumer acks every row exactly once, except rows
whose worker died between put and ack (finished by the put, never re-delivered); groups stay
whole; nothing is lost after leases expire; and restoring the snapshot into fresh shard
processes and carrying on gives the uninterrupted run's table.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import signal
import tempfile
import threading
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass, field
from multiprocessing.connection import Connection, wait

import pytest
from dock_workers import OUTPUTS, Job, expected_table, prompt_cell, start_shards, worker_main
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from dockrl.dock import GRPO_SCHEMA
from dockrl.dock.client.dock_client import DockClient

TOKEN = "property-token"
LEASE_S = 1.5  # short, so dead workers' rows come back fast; long enough for a loaded machine's heartbeats
WORKERS = [("reward", 0), ("reward", 1), ("advantage", 2)]  # (consumer, slot)
EVENT_TIMEOUT_S = 90.0


@dataclass
class Worker:
    proc: mp.Process
    jobs: mp.Queue
    events: Connection


@dataclass
class Cluster:
    ctx: mp.context.BaseContext
    run: list[str]
    fresh: list[str]
    idle: list[Worker] = field(default_factory=list)
    next_job: int = 0

    def spawn(self) -> Worker:
        jobs = self.ctx.Queue()
        events, send = self.ctx.Pipe(duplex=False)
        proc = self.ctx.Process(target=worker_main, args=(jobs, send), daemon=True)
        proc.start()
        send.close()  # the worker holds the only write end: its death shows as EOF here
        return Worker(proc, jobs, events)

    def worker(self) -> Worker:
        """An idle worker process; a spare is started in the background for the next one."""
        worker = self.idle.pop() if self.idle else self.spawn()
        if not self.idle:
            self.idle.append(self.spawn())
        return worker


def read_locations(procs) -> list[str]:
    watchdog = [threading.Timer(60.0, p.kill) for p in procs]  # a hung start fails instead of hanging
    for w in watchdog:
        w.start()
    try:
        locations = [p.stdout.readline().strip() for p in procs]
    finally:
        for w in watchdog:
            w.cancel()
    assert all(loc.startswith("grpc://") for loc in locations), f"shard processes did not start: {locations}"
    return locations


@pytest.fixture(scope="module")
def cluster() -> Iterator[Cluster]:
    """Two sets of 3 shard processes (the run, and fresh ones to restore into) and a pool of worker processes."""
    procs = start_shards(6, TOKEN, LEASE_S)
    ctx = mp.get_context("spawn")
    c = Cluster(ctx, [], [])
    c.idle = [c.spawn() for _ in range(len(WORKERS) + 1)]
    try:
        locations = read_locations(procs)
        c.run, c.fresh = locations[:3], locations[3:]
        yield c
    finally:
        for w in c.idle:
            w.jobs.put(None)
        for w in c.idle:
            w.proc.join(10)
            if w.proc.is_alive():
                w.proc.kill()
        for p in procs:
            p.terminate()
        for p in procs:
            p.wait(10)


def connect(locations: list[str]) -> DockClient:
    return DockClient(locations, GRPO_SCHEMA, token=TOKEN, timeout_s=30.0, rpc_timeout_s=20.0, lease_s=LEASE_S)


@dataclass
class Run:
    acks: dict[str, list[int]] = field(default_factory=lambda: {"reward": [], "advantage": []})
    finished_by_put: dict[str, list[int]] = field(default_factory=lambda: {"reward": [], "advantage": []})
    claims: dict[str, list[list[int]]] = field(default_factory=lambda: {"reward": [], "advantage": []})
    acked_before_snapshot: dict[str, set[int]] | None = None
    killed: int = 0


def run_stages(
    c: Cluster, locations: list[str], g: int, batch: dict[str, int], kills: dict[int, tuple[int, str, bool]],
    prompt_chunks: list[list[int]], snapshot: tuple[int, str] | None,
) -> Run:
    """Run the workers on the open iteration to the end, SIGKILLing and replacing as scheduled."""
    run = Run()
    driver = connect(locations)
    running: dict[int, tuple[Worker, Job, bool]] = {}  # job id → (worker, job, release its owner when killed)
    owners: dict[int, str] = {}

    def start(consumer: str, kill: tuple[int, str, bool] | None) -> None:
        c.next_job += 1
        job = Job(c.next_job, locations, TOKEN, consumer, batch[consumer], consumer == "advantage", g, LEASE_S,
                  None if kill is None else kill[:2])
        worker = c.worker()
        worker.jobs.put(job)
        running[job.job_id] = (worker, job, bool(kill and kill[2]))

    def maybe_snapshot(at_the_end: bool = False) -> None:
        acks = sum(map(len, run.acks.values()))
        if snapshot is not None and run.acked_before_snapshot is None and (acks >= snapshot[0] or at_the_end):
            run.acked_before_snapshot = {k: {r for rows in v for r in rows} for k, v in run.acks.items()}  # done before it starts
            driver.snapshot(snapshot[1])

    try:
        for consumer, slot in WORKERS:
            start(consumer, kills.get(slot))
        for rows in prompt_chunks:  # prompts arrive while the workers already wait
            driver.put(rows, {"prompt_ids": [prompt_cell(r) for r in rows]})
        maybe_snapshot()
        follow(c, run, driver, running, owners, start, maybe_snapshot)
        maybe_snapshot(at_the_end=True)
    finally:
        for worker, _, _ in running.values():  # a failed example: stop its workers, they are ours
            worker.proc.kill()
            worker.proc.join(10)
        driver.close()
    return run


def follow(c: Cluster, run: Run, driver: DockClient, running: dict, owners: dict, start, maybe_snapshot) -> None:
    """Handle worker events until every job is done."""
    while running:
        ready = wait([worker.events for worker, _, _ in running.values()], timeout=EVENT_TIMEOUT_S)
        if not ready:
            pytest.fail(f"no worker event in {EVENT_TIMEOUT_S}s; jobs still running: {[j for _, j, _ in running.values()]}")
        for conn in ready:
            try:
                event = conn.recv()
            except EOFError:
                pytest.fail(f"a worker process died outside the kill schedule; jobs running: {list(running)}")
            handle(c, run, driver, running, owners, start, maybe_snapshot, event)


def handle(c: Cluster, run: Run, driver: DockClient, running: dict, owners: dict, start, maybe_snapshot, event: tuple) -> None:
    """React to one worker event: record acks, SIGKILL at kill points and start a replacement."""
    kind, job_id = event[0], event[1]
    if kind == "error":
        pytest.fail(f"worker job {job_id} failed:\n{event[2]}")
    elif kind == "owner":
        owners[job_id] = event[2]
    elif kind == "acked":
        run.acks[event[2]].append(event[3])
        run.claims[event[2]].append(event[3])
        maybe_snapshot()
    elif kind == "kill_me":
        worker, job, release = running.pop(job_id)
        os.kill(worker.proc.pid, signal.SIGKILL)
        worker.proc.join(10)
        run.killed += 1
        phase, rows = event[2], event[3]
        if phase != "acked":  # an "acked" kill point was reported as acked before
            run.claims[job.consumer].append(rows)
        if phase == "put":
            run.finished_by_put[job.consumer].append(rows)
        if release:
            assert driver.release_owner(owners[job_id]) == (len(rows) if phase == "claimed" else 0)
        start(job.consumer, None)  # the launcher's replacement
    elif kind == "done":
        worker, _, _ = running.pop(job_id)
        c.idle.append(worker)


def check_run(locations: list[str], run: Run, num_rows: int, g: int) -> dict[str, list]:
    """Exactly-once acks, whole groups, nothing left held; returns the output table."""
    for consumer in run.acks:
        acked = [r for rows in run.acks[consumer] for r in rows]
        by_put = [r for rows in run.finished_by_put[consumer] for r in rows]
        assert not [r for r, n in Counter(acked).items() if n > 1], f"{consumer}: rows acked twice"
        assert sorted(acked + by_put) == list(range(num_rows)), f"{consumer}: acks {sorted(acked)} + put {sorted(by_put)}"
    for rows in run.claims["advantage"]:
        assert all(set(range(r - r % g, r - r % g + g)) <= set(rows) for r in rows), f"partial group in {rows}"
    return output_table(locations, num_rows)


def output_table(locations: list[str], num_rows: int) -> dict[str, list]:
    """The output columns, after checking that no consumer has a row left (none free, none held)."""
    probe = connect(locations)
    try:
        for consumer, columns in (("reward", ["prompt_ids"]), ("advantage", ["rm_score"])):
            assert probe.claim(consumer, columns, 1, timeout_s=5.0).rows == [], f"{consumer}: rows left over"
        columns = [c for consumer in ("reward", "advantage") for c in OUTPUTS[consumer]]
        batch = probe.get(columns, range(num_rows))
        return {c: batch.column(c).to_pylist() for c in columns}
    finally:
        probe.close()


kill_schedule = st.dictionaries(
    keys=st.sampled_from([slot for _, slot in WORKERS]),
    values=st.tuples(st.integers(1, 2), st.sampled_from(["claimed", "put", "acked"]), st.booleans()),
    min_size=1,
    max_size=2,
)


@pytest.mark.slow
@settings(max_examples=6, deadline=None, suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
@given(data=st.data())
def test_workers_killed_at_random_points_lose_and_repeat_nothing(cluster, data):
    n_shards = data.draw(st.integers(1, 3), label="shards")
    g = data.draw(st.integers(1, 3), label="group_size")
    num_rows = g * data.draw(st.integers(2, 6), label="groups")
    batch = {"reward": data.draw(st.integers(1, 4), label="reward batch"),
             "advantage": g * data.draw(st.integers(1, 2), label="advantage groups per claim")}
    kills = data.draw(kill_schedule, label="kills: slot -> (claim k, phase, release_owner)")
    cut = sorted(data.draw(st.sets(st.integers(1, num_rows - 1), max_size=2), label="prompt chunks"))
    bounds = [0, *cut, num_rows]
    chunks = [list(range(a, b)) for a, b in zip(bounds, bounds[1:])]
    snapshot_after = data.draw(st.integers(0, 6), label="snapshot after acks")

    run_at, fresh_at = cluster.run[:n_shards], cluster.fresh[:n_shards]
    with tempfile.TemporaryDirectory(prefix="dock-snapshot-") as uri:
        driver = connect(run_at)
        driver.open_iteration(0, num_rows, g)
        try:
            run = run_stages(cluster, run_at, g, batch, kills, chunks, (snapshot_after, uri))
            table = check_run(run_at, run, num_rows, g)
            expected = expected_table(num_rows, g)
            assert table == {column: expected[column] for column in table}
        finally:
            driver.close_iteration()
            driver.close()

        # restore the mid-run snapshot into fresh shard processes and carry on: the same table
        fresh = connect(fresh_at)
        try:
            fresh.restore(uri)
            again = run_stages(cluster, fresh_at, g, batch, {}, [], None)
            for consumer, before in run.acked_before_snapshot.items():
                acked = [r for rows in again.acks[consumer] for r in rows]
                assert not [r for r, n in Counter(acked).items() if n > 1], f"{consumer}: rows acked twice after restore"
                assert not set(acked) & before, f"{consumer}: rows acked before the snapshot were delivered again"
            assert output_table(fresh_at, num_rows) == table
        finally:
            fresh.close_iteration()
            fresh.close()
