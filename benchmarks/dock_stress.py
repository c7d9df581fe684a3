"""The dock under load: many client processes, 4 shards, killed clients, a shard restored from a snapshot.

``--clients`` client processes claim, put and ack through ``--shards`` dock shard processes
(``python -m dockrl.dock.flight.shards``) for ``--iterations`` iterations of ``--rows`` rows in prompt
groups of ``--group-size``. Each client serves one consumer of the GRPO schema per iteration
(drawn per iteration, in proportion to the bytes each moves), with a random claim size per
claim (up to ``--max-claim`` rows; whole groups for rollout, advantage and actor)::

    rollout    reads prompt_ids                                   writes response_ids, rollout_log_prob, truncated
    reward     reads response_ids                                 writes rm_score, correct
    reference  reads response_ids                                 writes ref_log_prob
    advantage  reads rm_score (whole groups)                      writes advantages
    actor      reads prompt_ids, response_ids, rollout_log_prob,  writes old_log_prob
               ref_log_prob, advantages (whole groups)

so claims also wait for the rows other stages have not written yet. Every cell is a
deterministic function of (iteration, row, column): each client checks every cell it reads,
and the driver reads back the cells nobody reads (old_log_prob, correct, truncated). Stage
compute is not run; clients only build and check cells.

**Faults.** A fault injector in the driver kills ``--kills`` random clients per iteration at
random points of its progress, each one of: *before put* (the client claimed and stops before
its put), *after put* (put done, ack not sent), *anywhere* (SIGKILL at once, whatever the
client is doing: inside a claim call, a put, an ack, or idle). The first two stop at the point
and are then SIGKILLed by PID. For half the kills the driver calls ``release_owner`` (a
launcher that saw the process die); the others' rows come back when their lease expires
(``--lease-s``; ``--release-share`` sets the half). A replacement client takes the dead one's place. In iteration
``--snapshot-iteration`` the driver holds every client at a claim boundary (as a checkpoint
does), snapshots shard 1, SIGKILLs its process, starts a fresh shard process on the same port,
restores the snapshot there and lets the clients go on. (Shard 0 carries the run's control
channel, which is not part of a shard snapshot; a snapshot restored while clients keep acking
on that shard would roll their acks back by design.)

**Accounting** (from every client's events: claimed, put, acked, killed, and the dock's
final state): for every iteration, consumer and row, exactly one ack, or one put by a client
killed after it; no cell written twice (the dock refuses a second put; a refusal counts as a
duplicate) and every cell present and equal to its function; rows claimed by a client that
died before its put came back and were acked by another; no consumer has a row left (a
probe claim is empty); and afterwards no client or shard process is alive (by PID and start
time).

Run::

    python benchmarks/dock_stress.py                 # 64 clients, 4 shards, 6 iterations, ~10 GB: ~6 min on 2 cores
    python benchmarks/dock_stress.py --clients 16 --rows 2048 --tokens 256 --iterations 3
"""

from __future__ import annotations

import argparse
import json
import logging
import multiprocessing as mp
import os
import random
import secrets
import select
import signal
import subprocess
import sys
import tempfile
import time
import traceback
from dataclasses import dataclass, field
from multiprocessing.connection import Connection, wait
from typing import IO, Any

import numpy as np
import psutil
import pyarrow as pa
import pyarrow.flight as flight

from dockrl.dock.client.dock_client import DockClient
from dockrl.dock.errors import DockError, DockTimeoutError
from dockrl.dock.schema import GRPO_SCHEMA
from dockrl.dock.shard.layout import ShardLayout

logger = logging.getLogger("benchmarks.dock_stress")

STAGES = ("rollout", "reward", "reference", "advantage", "actor")
READS = {
    "rollout": ("prompt_ids",), "reward": ("response_ids",), "reference": ("response_ids",), "advantage": ("rm_score",),
    "actor": ("prompt_ids", "response_ids", "rollout_log_prob", "ref_log_prob", "advantages"),
}
WRITES = {  # every output column of the stage in the schema: a row is finished (not computed twice) once all are written
    "rollout": ("response_ids", "rollout_log_prob", "truncated"), "reward": ("rm_score", "correct"),
    "reference": ("ref_log_prob",), "advantage": ("advantages", "returns"), "actor": ("old_log_prob",),
}
WHOLE_GROUPS = {"rollout": True, "reward": False, "reference": False, "advantage": True, "actor": True}
SHARE = {"rollout": 0.22, "reward": 0.14, "reference": 0.18, "advantage": 0.10, "actor": 0.36}
"""Share of the clients serving each consumer in an iteration (about the bytes each moves)."""
UNREAD = ("old_log_prob", "correct", "truncated")
"""Columns no consumer reads: the driver reads them back."""
FAULTS = ("before_put", "after_put", "anywhere")
TOKEN_ENV = "DOCKRL_DOCK_TOKEN"
SNAPSHOT_SHARD = 1
_GOLDEN = 0.6180339887498949
_POOL = 1 << 18


# --- cells: a deterministic function of (iteration, row, column) ---------------------------------------


@dataclass(frozen=True)
class Shape:
    """Sizes of one iteration: rows, group size, prompt tokens, mean response tokens."""

    rows: int
    group_size: int
    prompt_tokens: int
    tokens: int


class Cells:
    """Builds and checks cells; every process builds the same pools from the same seed."""

    def __init__(self, shape: Shape) -> None:
        self.shape = shape
        longest = max(shape.prompt_tokens, 3 * shape.tokens // 2 + 1)
        rng = np.random.default_rng(12345)
        self.ints = rng.integers(0, 151_936, _POOL + longest, dtype=np.int32)
        self.floats = -rng.exponential(1.0, _POOL + longest).astype(np.float32)

    def lengths(self, column: str, it: int, rows: np.ndarray) -> np.ndarray:
        if column == "prompt_ids":
            return np.full(len(rows), self.shape.prompt_tokens, dtype=np.int64)
        frac = np.mod((rows + 7919 * it).astype(np.float64) * _GOLDEN, 1.0)
        return np.maximum(1, (self.shape.tokens * (0.5 + frac)).astype(np.int64))

    def values(self, column: str, it: int, rows: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """(lengths, flat values) of the list cells of ``column`` at ``rows``."""
        lengths = self.lengths(column, it, rows)
        salt = sum(map(ord, column))
        start = (rows.astype(np.int64) * 2_654_435_761 + it * 40_503 + salt * 9_973) % _POOL
        ends = np.cumsum(lengths)
        index = np.repeat(start - (ends - lengths), lengths) + np.arange(int(ends[-1]) if len(ends) else 0)
        pool = self.ints if GRPO_SCHEMA.column(column).type == pa.list_(pa.int32()) else self.floats
        return lengths, pool[index]

    def scalar(self, column: str, it: int, rows: np.ndarray) -> np.ndarray:
        if column == "rm_score":
            return ((rows.astype(np.int64) * (2 * it + 3) * 2_654_435_761 % 1_009) / 1_009).astype(np.float32)
        if column == "correct":
            return (rows + it) % 3 == 0
        if column == "truncated":
            return (rows + 2 * it) % 5 == 0
        raise ValueError(f"no scalar cells for column {column!r}")

    def column(self, column: str, it: int, rows: np.ndarray) -> pa.Array:
        if pa.types.is_list(GRPO_SCHEMA.column(column).type):
            lengths, flat = self.values(column, it, rows)
            offsets = np.zeros(len(rows) + 1, dtype=np.int32)
            np.cumsum(lengths, out=offsets[1:])
            return pa.ListArray.from_arrays(pa.array(offsets), pa.array(flat))
        return pa.array(self.scalar(column, it, rows))

    def check(self, column: str, it: int, rows: np.ndarray, got: pa.Array | pa.ChunkedArray) -> None:
        """Raises ValueError naming the first rows whose cells differ from their function."""
        if isinstance(got, pa.ChunkedArray):
            got = got.combine_chunks()
        if len(got) != len(rows) or got.null_count:
            raise ValueError(f"column {column!r}: {len(got)} cells ({got.null_count} null) for {len(rows)} rows")
        if pa.types.is_list(got.type):
            lengths, flat = self.values(column, it, rows)
            have = got.value_lengths().to_numpy(zero_copy_only=False)
            bad = np.flatnonzero(have != lengths)
            if not len(bad) and not np.array_equal(got.flatten().to_numpy(zero_copy_only=False), flat):
                ends = np.cumsum(lengths)
                diff = np.flatnonzero(got.flatten().to_numpy(zero_copy_only=False) != flat)
                bad = np.searchsorted(ends, diff, side="right")
        else:
            bad = np.flatnonzero(got.to_numpy(zero_copy_only=False) != self.scalar(column, it, rows))
        if len(bad):
            raise ValueError(f"iteration {it}: column {column!r} of rows {rows[bad[:5]].tolist()} differs from its function")


def runs(rows: list[int]) -> list[tuple[int, int]]:
    """Sorted rows as [start, stop) runs (keeps events small)."""
    out: list[list[int]] = []
    for r in rows:
        if out and out[-1][1] == r:
            out[-1][1] += 1
        else:
            out.append([r, r + 1])
    return [tuple(x) for x in out]


def unrun(spans: list[tuple[int, int]]) -> np.ndarray:
    return np.concatenate([np.arange(a, b) for a, b in spans]) if spans else np.zeros(0, dtype=np.int64)


def roles(iteration: int, clients: int, seed: int) -> list[str]:
    """The consumer each client index serves in ``iteration``: every consumer gets at least one."""
    counts = {s: max(1, round(SHARE[s] * clients)) for s in STAGES}
    while sum(counts.values()) > clients:
        counts[max(counts, key=counts.get)] -= 1
    while sum(counts.values()) < clients:
        counts["actor"] += 1
    out = [s for s in STAGES for _ in range(counts[s])]
    random.Random(seed * 1_000_003 + iteration).shuffle(out)
    return out


# --- client processes ----------------------------------------------------------------------------------


@dataclass(frozen=True)
class ClientSpec:
    index: int
    generation: int
    locations: tuple[str, ...]
    token: str
    shape: Shape
    clients: int
    seed: int
    max_claim: int
    lease_s: float
    claim_wait_s: float
    timeout_s: float
    after: int
    """Join the first iteration after this one (a replacement joins the open one)."""


def client_main(conn: Connection, spec: ClientSpec) -> None:
    """A client process: serves one consumer per iteration until the driver finishes the run.

    Events to the driver (each one small, so a SIGKILL never cuts one short): hello, claimed,
    put, acked, put_acked, timeout, kill_me, paused, done, error, bye. Commands from it:
    ("die", fault), ("pause", id), ("resume", id).
    """
    rng = random.Random(spec.seed * 7_919 + spec.index * 104_729 + spec.generation)
    cells = Cells(spec.shape)
    dock = DockClient(list(spec.locations), GRPO_SCHEMA, token=spec.token, timeout_s=spec.claim_wait_s,
                      rpc_timeout_s=spec.timeout_s, lease_s=spec.lease_s)
    conn.send(("hello", os.getpid(), dock.owner))
    armed: list[str | None] = [None]

    def commands() -> None:
        while conn.poll():
            cmd = conn.recv()
            if cmd[0] == "die":
                armed[0] = cmd[1]
            elif cmd[0] == "pause":
                conn.send(("paused", cmd[1]))
                while (nxt := conn.recv())[0] != "resume":
                    if nxt[0] == "die":
                        armed[0] = nxt[1]

    def stop_here(fault: str, it: int, spans: list) -> None:
        if armed[0] == fault:
            conn.send(("kill_me", fault, it, spans))
            while True:  # until the SIGKILL
                conn.recv()

    try:
        after = spec.after
        while (it := dock.wait_iteration(after, timeout_s=spec.timeout_s)) is not None:
            after = it
            consumer = roles(it, spec.clients, spec.seed)[spec.index]
            unit = spec.shape.group_size if WHOLE_GROUPS[consumer] else 1
            while True:
                commands()
                count = unit * rng.randint(1, max(1, spec.max_claim // unit))
                start = time.perf_counter()
                try:
                    claim = dock.claim(consumer, READS[consumer], count, whole_groups=WHOLE_GROUPS[consumer],
                                       timeout_s=spec.claim_wait_s)
                except DockTimeoutError:
                    conn.send(("timeout", it))
                    continue
                latency = time.perf_counter() - start
                if not claim.rows:
                    break
                rows = np.asarray(claim.rows, dtype=np.int64)
                spans = runs(claim.rows)
                conn.send(("claimed", it, consumer, spans, latency, claim.batch.nbytes))
                stop_here("before_put", it, spans)
                for column in READS[consumer]:
                    cells.check(column, it, rows, claim.batch.column(column))
                out = {column: cells.column(column, it, rows) for column in WRITES[consumer]}
                nbytes = sum(a.nbytes for a in out.values())
                if armed[0] != "after_put" and rng.random() < 0.5:
                    dock.put(claim.rows, out, ack=claim)  # put and ack in one round trip per shard
                    conn.send(("put_acked", it, consumer, spans, nbytes))
                else:
                    dock.put(claim.rows, out)
                    conn.send(("put", it, consumer, spans, nbytes))
                    stop_here("after_put", it, spans)
                    dock.ack(claim)
                    conn.send(("acked", it, consumer, spans))
            conn.send(("done", it))
        conn.send(("bye",))
    except BaseException:  # noqa: BLE001 - the driver counts it and starts a replacement
        conn.send(("error", traceback.format_exc()[-3000:]))
    finally:
        dock.close()


# --- shard processes -------------------------------------------------------------------------------------


def start_shard(token: str, lease_s: float, timeout_s: float, log: IO[str], port: int = 0) -> subprocess.Popen:
    env = {**os.environ, TOKEN_ENV: token}
    cmd = [sys.executable, "-m", "dockrl.dock.flight.shards", "--port", str(port), "--token-env", TOKEN_ENV,
           "--lease-s", str(lease_s), "--timeout-s", str(timeout_s)]
    return subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=log, text=True)


def shard_location(proc: subprocess.Popen, s: int, timeout_s: float, log: IO[str]) -> str:
    """The ``grpc://`` location a shard process prints first.

    Raises:
        TimeoutError: nothing printed within ``timeout_s``.
        RuntimeError: the process exited first.
    """
    if not select.select([proc.stdout], [], [], timeout_s)[0]:
        raise TimeoutError(f"dock shard {s} printed no location within {timeout_s:.0f}s (log: {log.name})")
    line = proc.stdout.readline().strip()
    if not line.startswith("grpc://"):
        raise RuntimeError(f"dock shard {s} exited with {proc.poll()} before printing its location (log: {log.name})")
    return line


def shard_action(location: str, token: str, name: str, body: dict[str, Any], timeout_s: float) -> Any:
    """One ``do_action`` on one shard (the protocol of ``dockrl.dock.flight.shards``)."""
    client = flight.connect(location)
    try:
        opts = flight.FlightCallOptions(headers=[(b"authorization", f"Bearer {token}".encode())], timeout=timeout_s)
        results = list(client.do_action(flight.Action(name, json.dumps(body).encode()), opts))
        return json.loads(results[0].body.to_pybytes()) if results else None
    finally:
        client.close()


# --- the driver ------------------------------------------------------------------------------------------


@dataclass
class Client:
    spec: ClientSpec
    proc: mp.Process
    conn: Connection
    pid: int = 0
    owner: str = ""
    state: str = "starting"  # starting, working, done (with the iteration), paused, kill_me, gone
    claim: tuple | None = None  # (iteration, consumer, spans, put_done) of the claim in hand


@dataclass
class Ledger:
    """Per iteration and consumer, what happened to every row."""

    rows: int
    claims: dict[str, np.ndarray] = field(default_factory=dict)
    puts: dict[str, np.ndarray] = field(default_factory=dict)
    acks: dict[str, np.ndarray] = field(default_factory=dict)
    put_by_dead: dict[str, np.ndarray] = field(default_factory=dict)  # put confirmed, then killed before the ack
    unput_by_dead: dict[str, np.ndarray] = field(default_factory=dict)  # claimed, killed before a confirmed put
    unknown_by_dead: dict[str, np.ndarray] = field(default_factory=dict)  # killed anywhere: the put may have landed

    def __post_init__(self) -> None:
        for table in (self.claims, self.puts, self.acks, self.put_by_dead, self.unput_by_dead, self.unknown_by_dead):
            for s in STAGES:
                table[s] = np.zeros(self.rows, dtype=np.int32)


@dataclass
class Stats:
    seconds: float = 0.0
    bytes: int = 0
    latencies: list[float] = field(default_factory=list)
    timeouts: int = 0
    faults: dict[str, int] = field(default_factory=lambda: {f: 0 for f in FAULTS})
    released: int = 0
    errors: list[str] = field(default_factory=list)
    snapshot: str = "-"
    verified_bytes: int = 0


class Stress:
    """The driver: shards, clients, fault injector, accounting."""

    def __init__(self, args: argparse.Namespace) -> None:
        self.args = args
        self.shape = Shape(args.rows, args.group_size, args.prompt_tokens, args.tokens)
        self.cells = Cells(self.shape)
        self.token = secrets.token_hex(16)
        self.rng = random.Random(args.seed)
        self.log = tempfile.NamedTemporaryFile("w", prefix="dock-stress-shards-", suffix=".log", delete=False)
        self.shards: list[subprocess.Popen] = []
        self.locations: list[str] = []
        self.pids: dict[int, float] = {}  # every process started: pid -> create time
        self.clients: dict[int, Client] = {}
        self.ctx = mp.get_context("forkserver")
        self.ctx.set_forkserver_preload(["numpy", "pyarrow", "pyarrow.flight", "dockrl.dock.client.dock_client"])
        self.pause_id = 0
        self.pausing = False
        self.driver: DockClient | None = None
        self.iteration = -1

    # --- processes ------------------------------------------------------------------------------------
    def _remember(self, pid: int) -> None:
        try:
            self.pids[pid] = psutil.Process(pid).create_time()
        except psutil.NoSuchProcess:
            self.pids[pid] = -1.0  # already gone

    def start_shards(self) -> None:
        a = self.args
        self.shards = [start_shard(self.token, a.lease_s, a.timeout_s, self.log) for _ in range(a.shards)]
        for proc in self.shards:
            self._remember(proc.pid)
        self.locations = [shard_location(p, s, a.timeout_s, self.log) for s, p in enumerate(self.shards)]

    def spawn(self, index: int, generation: int, after: int) -> Client:
        a = self.args
        spec = ClientSpec(index, generation, tuple(self.locations), self.token, self.shape, a.clients, a.seed, a.max_claim, a.lease_s,
                          a.claim_wait_s, a.timeout_s, after)
        parent, child = self.ctx.Pipe()
        proc = self.ctx.Process(target=client_main, args=(child, spec), daemon=True, name=f"dock-stress-client-{index}")
        proc.start()
        child.close()
        client = Client(spec, proc, parent)
        self.clients[index] = client
        if self.pausing:
            parent.send(("pause", self.pause_id))
        return client

    def start_clients(self) -> None:
        for i in range(self.args.clients):
            self.spawn(i, 0, -1)
        deadline = time.monotonic() + self.args.timeout_s
        while any(c.state == "starting" for c in self.clients.values()):
            if time.monotonic() > deadline:
                raise TimeoutError(f"client processes did not say hello within {self.args.timeout_s:.0f}s")
            self.pump(0.5, None, None)

    # --- events ---------------------------------------------------------------------------------------
    def pump(self, timeout: float, ledger: Ledger | None, stats: Stats | None) -> None:
        """Handle the events that arrive within ``timeout`` seconds."""
        conns = {c.conn: c for c in self.clients.values() if c.state != "gone"}
        for conn in wait(list(conns), timeout=timeout):
            client = conns[conn]
            try:
                event = conn.recv()
            except (EOFError, OSError):
                self.lost(client, ledger, stats, "exited")
                continue
            self.handle(client, event, ledger, stats)

    def handle(self, client: Client, event: tuple, ledger: Ledger | None, stats: Stats | None) -> None:
        kind = event[0]
        if kind == "hello":
            client.pid, client.owner, client.state = event[1], event[2], "working"
            self._remember(client.pid)
        elif kind == "claimed":
            it, consumer, spans, latency, nbytes = event[1:]
            client.claim = (it, consumer, spans, False)
            ledger.claims[consumer][unrun(spans)] += 1
            stats.latencies.append(latency)
            stats.bytes += nbytes
        elif kind in ("put", "put_acked"):
            it, consumer, spans, nbytes = event[1:]
            rows = unrun(spans)
            ledger.puts[consumer][rows] += 1
            stats.bytes += nbytes
            if kind == "put_acked":
                ledger.acks[consumer][rows] += 1
                client.claim = None
            else:
                client.claim = (it, consumer, spans, True)
        elif kind == "acked":
            ledger.acks[event[2]][unrun(event[3])] += 1
            client.claim = None
        elif kind == "timeout":
            stats.timeouts += 1
        elif kind == "kill_me":
            client.state = "kill_me"
            self.kill(client, event[1], ledger, stats)
        elif kind == "paused":
            if event[1] == self.pause_id and self.pausing and client.state != "done":
                client.state = "paused"
        elif kind == "done":
            client.state = "done" if event[1] == self.iteration else client.state
        elif kind == "error":
            stats.errors.append(f"client {client.spec.index} (pid {client.pid}): {event[1]}")
            self.lost(client, ledger, stats, "failed")
        elif kind == "bye":
            client.state = "gone"

    def kill(self, client: Client, fault: str, ledger: Ledger, stats: Stats) -> None:
        """SIGKILL ``client`` by PID, account for the claim in its hands, maybe release its owner, replace it."""
        try:
            os.kill(client.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        client.proc.join(self.args.timeout_s)
        try:  # events it sent before dying
            while client.conn.poll():
                event = client.conn.recv()
                if event[0] not in ("kill_me", "paused", "done", "error", "bye"):
                    self.handle(client, event, ledger, stats)
        except (EOFError, OSError):
            pass
        stats.faults[fault] += 1
        if client.claim is not None:
            _, consumer, spans, put_done = client.claim
            rows = unrun(spans)
            if fault == "anywhere" and not put_done:
                ledger.unknown_by_dead[consumer][rows] += 1
            elif put_done:
                ledger.put_by_dead[consumer][rows] += 1
            else:
                ledger.unput_by_dead[consumer][rows] += 1
        if self.rng.random() < self.args.release_share:  # a launcher that saw the process die; else lease expiry
            stats.released += self.driver.release_owner(client.owner)
        self.replace(client)

    def lost(self, client: Client, ledger: Ledger | None, stats: Stats | None, how: str) -> None:
        """A client that exited on its own: a failure, unless it said bye (end of the run)."""
        if client.state == "gone":
            return
        client.proc.join(self.args.timeout_s)
        if stats is not None and how == "exited":
            stats.errors.append(f"client {client.spec.index} (pid {client.pid}) exited with {client.proc.exitcode}")
        if ledger is not None and client.claim is not None:
            ledger.unknown_by_dead[client.claim[1]][unrun(client.claim[2])] += 1
        self.replace(client)

    def replace(self, client: Client) -> None:
        client.state = "gone"
        client.conn.close()
        if self.iteration >= 0:
            self.spawn(client.spec.index, client.spec.generation + 1, self.iteration - 1)

    def live(self) -> list[Client]:
        return [c for c in self.clients.values() if c.state != "gone"]

    # --- one iteration --------------------------------------------------------------------------------
    def run_iteration(self, it: int) -> tuple[Ledger, Stats]:
        a, shape = self.args, self.shape
        ledger, stats = Ledger(shape.rows), Stats()
        self.iteration = it
        self.driver.open_iteration(it, shape.rows, shape.group_size, announce=False)
        for start in range(0, shape.rows, 4096):
            rows = np.arange(start, min(start + 4096, shape.rows))
            prompts = self.cells.column("prompt_ids", it, rows)
            self.driver.put(rows.tolist(), {"prompt_ids": prompts})
            stats.bytes += prompts.nbytes
        kills = sorted(self.rng.uniform(0.05, 0.9) for _ in range(a.kills))
        snapshot_at = self.rng.uniform(0.3, 0.6) if it == a.snapshot_iteration else None
        total = shape.rows * len(STAGES)
        t0 = time.perf_counter()
        for c in self.live():
            if c.state == "done":
                c.state = "working"
        self.driver.announce(it)
        deadline = time.monotonic() + a.timeout_s
        while any(c.state != "done" for c in self.live()):
            self.pump(0.2, ledger, stats)
            progress = sum(int(v.sum()) for v in ledger.acks.values()) / total
            while kills and progress >= kills[0]:
                kills.pop(0)
                self.inject(ledger, stats)
            if snapshot_at is not None and progress >= snapshot_at:
                snapshot_at = None
                stats.snapshot = self.snapshot_restore(it, ledger, stats)
            if time.monotonic() > deadline:
                busy = sorted((c.spec.index, c.state) for c in self.live() if c.state != "done")
                raise TimeoutError(f"iteration {it}: clients {busy[:10]} not done within {a.timeout_s:.0f}s")
        stats.seconds = time.perf_counter() - t0
        self.verify(it, ledger, stats)
        self.driver.close_iteration()
        return ledger, stats

    def inject(self, ledger: Ledger, stats: Stats) -> None:
        working = [c for c in self.live() if c.state == "working" and c.pid]
        if not working:
            return
        client = self.rng.choice(working)
        fault = self.rng.choice(FAULTS)
        if fault == "anywhere":
            self.kill(client, fault, ledger, stats)
        else:
            try:
                client.conn.send(("die", fault))  # it stops at that point of its next claim, then is killed
            except OSError:
                pass  # it is gone already: the event loop will see it

    def snapshot_restore(self, it: int, ledger: Ledger, stats: Stats) -> str:
        """Hold the clients at a claim boundary, snapshot shard 1, SIGKILL it, restore into a fresh process."""
        a = self.args
        self.pause_id += 1
        self.pausing = True
        for c in self.live():
            try:
                c.conn.send(("pause", self.pause_id))  # one done with the iteration reads it in the next: ignored
            except OSError:
                pass  # gone: the event loop will see it
        deadline = time.monotonic() + a.timeout_s
        while any(c.state not in ("paused", "done") for c in self.live()):
            if time.monotonic() > deadline:
                busy = sorted((c.spec.index, c.state) for c in self.live() if c.state not in ("paused", "done"))
                raise TimeoutError(f"clients {busy[:10]} not held at a claim boundary within {a.timeout_s:.0f}s")
            self.pump(0.2, ledger, stats)
        t0 = time.perf_counter()
        uri = tempfile.mkdtemp(prefix="dock-stress-snapshot-")
        location = self.locations[SNAPSHOT_SHARD]
        shard_action(location, self.token, "snapshot", {"uri": uri}, a.timeout_s)
        nbytes = sum(os.path.getsize(os.path.join(d, f)) for d, _, fs in os.walk(uri) for f in fs)
        old = self.shards[SNAPSHOT_SHARD]
        old.kill()
        old.wait(a.timeout_s)
        port = int(location.rsplit(":", 1)[1])
        fresh = start_shard(self.token, a.lease_s, a.timeout_s, self.log, port=port)
        self._remember(fresh.pid)
        if shard_location(fresh, SNAPSHOT_SHARD, a.timeout_s, self.log) != location:
            raise RuntimeError(f"the restarted shard did not come back at {location}")
        self.shards[SNAPSHOT_SHARD] = fresh
        layout = ShardLayout(it, self.shape.rows, self.shape.group_size, a.shards).shard_meta(SNAPSHOT_SHARD)
        shard_action(location, self.token, "restore", {"uri": uri, "layout": layout}, a.timeout_s)
        seconds = time.perf_counter() - t0
        subprocess.run(["rm", "-rf", uri], check=False)
        self.pausing = False
        for c in self.live():
            if c.state == "paused":
                c.state = "working"
            c.conn.send(("resume", self.pause_id))
        return f"shard {SNAPSHOT_SHARD}: {nbytes / 1e6:.0f} MB, {seconds:.1f} s"

    def verify(self, it: int, ledger: Ledger, stats: Stats) -> None:
        """No consumer has a row left; the cells nobody reads are there and right."""
        for consumer in STAGES:
            try:
                left = self.driver.claim(consumer, READS[consumer][:1], 1, timeout_s=self.args.claim_wait_s)
            except DockTimeoutError as e:
                stats.errors.append(f"iteration {it}: probe claim of {consumer!r} timed out: {e}")
                continue
            if left.rows:
                stats.errors.append(f"iteration {it}: {consumer!r} still had row {left.rows} after every client was done")
        for start in range(0, self.shape.rows, 2048):
            rows = np.arange(start, min(start + 2048, self.shape.rows))
            try:
                batch = self.driver.get(list(UNREAD), rows.tolist())
            except DockError as e:
                stats.errors.append(f"iteration {it}: read-back of rows {start}..: {e}")
                continue
            stats.verified_bytes += batch.nbytes
            for column in UNREAD:
                try:
                    self.cells.check(column, it, rows, batch.column(column))
                except ValueError as e:
                    stats.errors.append(str(e))

    # --- the run ----------------------------------------------------------------------------------------
    def run(self) -> dict[str, Any]:
        a = self.args
        started = time.perf_counter()
        results = []
        try:
            self.start_shards()
            self.driver = DockClient(self.locations, GRPO_SCHEMA, token=self.token, timeout_s=a.timeout_s,
                                     rpc_timeout_s=a.timeout_s, lease_s=a.lease_s)
            self.start_clients()
            for it in range(a.iterations):
                results.append(self.run_iteration(it))
            self.driver.finish()
            deadline = time.monotonic() + a.timeout_s
            while self.live() and time.monotonic() < deadline:
                self.pump(0.5, None, None)
        finally:
            self.teardown()
        left = self.leftover()
        return {"results": results, "left": left, "wall_s": time.perf_counter() - started, "pids": len(self.pids),
                "shard_log": self.log.name}

    def teardown(self) -> None:
        for c in self.clients.values():
            if c.proc.is_alive():
                c.proc.join(5)
            if c.proc.is_alive():
                c.proc.kill()
                c.proc.join(5)
        if self.driver is not None:
            self.driver.close()
        for proc in self.shards:
            proc.terminate()
        for proc in self.shards:
            try:
                proc.wait(10)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(10)
        self.log.close()

    def leftover(self) -> list[str]:
        """Processes this run started that are still there (same PID and start time), zombies included."""
        left = []
        for pid, created in self.pids.items():
            try:
                proc = psutil.Process(pid)
                if proc.create_time() == created:
                    left.append(f"{pid} ({proc.status()}: {' '.join(proc.cmdline())[:60]})")
            except psutil.NoSuchProcess:
                pass
        return left


# --- accounting and the table ------------------------------------------------------------------------------


def account(ledger: Ledger, stats: Stats) -> dict[str, int]:
    """Per-iteration counts: rows consumed more than once or never, dead clients' rows returned."""
    duplicated = lost = returned = by_dead_put = 0
    for s in STAGES:
        done = ledger.acks[s] + ledger.put_by_dead[s]
        duplicated += int((done > 1).sum() + (ledger.puts[s] > 1).sum())
        unresolved = done == 0
        # killed anywhere, its put may have landed unconfirmed: the dock then counts the row as done, and the
        # read-back / the consumers downstream checked the cells
        by_dead_put += int((unresolved & (ledger.unknown_by_dead[s] > 0)).sum()) + int((ledger.put_by_dead[s] > 0).sum())
        lost += int((unresolved & (ledger.unknown_by_dead[s] == 0)).sum())
        # a dead client's row that never came back is unresolved: counted as lost above
        returned += int((((ledger.unput_by_dead[s] > 0) | (ledger.unknown_by_dead[s] > 0)) & (ledger.acks[s] == 1)).sum())
    refused = sum(1 for e in stats.errors if "already written" in e or "re-delivered" in e)
    return {"duplicated": duplicated + refused, "lost": lost, "returned": returned,
            "by_dead_put": by_dead_put, "errors": len(stats.errors)}


def render(headers: list[str], rows: list[list[str]]) -> str:
    widths = [max(len(h), *(len(r[i]) for r in rows)) for i, h in enumerate(headers)]
    line = lambda cells: "| " + " | ".join(c.rjust(w) for c, w in zip(cells, widths)) + " |"  # noqa: E731
    return "\n".join([line(headers), "|" + "|".join("-" * (w + 2) for w in widths) + "|", *map(line, rows)])


def report(args: argparse.Namespace, out: dict[str, Any], load: tuple[float, float, float]) -> tuple[str, bool]:
    """The table, and whether the accounting holds (nothing lost, duplicated, failed or left running)."""
    rows, ok, restores = [], not out["left"], 0
    total = Stats()
    sums = {"duplicated": 0, "lost": 0, "returned": 0, "by_dead_put": 0, "errors": 0}

    def line(name: str, n_rows: int, st: Stats, acc: dict[str, int]) -> list[str]:
        lat = np.asarray(st.latencies) * 1e3 if st.latencies else np.zeros(1)
        faults = "/".join(str(st.faults[f]) for f in FAULTS)
        result = "ok" if not (acc["duplicated"] or acc["lost"] or acc["errors"]) else "FAIL"
        return [name, f"{n_rows:,}", f"{st.seconds:.1f}", f"{n_rows / st.seconds:,.0f}", f"{st.bytes / 1e9:.2f}",
                f"{st.bytes / 1e9 / st.seconds:.3f}", f"{len(st.latencies):,}", f"{np.percentile(lat, 50):.0f}",
                f"{np.percentile(lat, 99):.0f}", str(st.timeouts), faults, str(st.released), str(acc["returned"]),
                str(acc["by_dead_put"]), st.snapshot, str(acc["lost"]), str(acc["duplicated"]), str(acc["errors"]), result]

    for it, (ledger, st) in enumerate(out["results"]):
        acc = account(ledger, st)
        ok &= not (acc["duplicated"] or acc["lost"] or acc["errors"])
        rows.append(line(str(it), ledger.rows, st, acc))
        total.seconds += st.seconds
        total.bytes += st.bytes
        total.latencies += st.latencies
        total.timeouts += st.timeouts
        total.released += st.released
        total.errors += st.errors
        total.verified_bytes += st.verified_bytes
        restores += st.snapshot != "-"
        for f in FAULTS:
            total.faults[f] += st.faults[f]
        for k in sums:
            sums[k] += acc[k]
    total.snapshot = f"{restores} restored"
    if out["results"]:
        rows.append(line("all", sum(lg.rows for lg, _ in out["results"]), total, sums))
    head = [
        f"# transfer dock under load: {args.clients} client processes, {args.shards} shard processes, {args.iterations} "
        f"iterations x {args.rows:,} rows (groups of {args.group_size}), prompts {args.prompt_tokens} tokens, responses "
        f"~{args.tokens} tokens, claims of 1..{args.max_claim} rows, lease {args.lease_s:g} s",
        f"# machine: {os.cpu_count()} CPU cores, load average {load[0]:.1f} at start; wall time {out['wall_s']:.0f} s "
        f"(start-up, read-back of {total.verified_bytes / 1e9:.2f} GB and teardown included)",
        "# GB = payload through the dock (Arrow buffer bytes every client read in its claims and put, and the prompts); "
        "claim latency from call to return, waits for other stages included; faults: " + "/".join(FAULTS),
    ]
    table = render(["iteration", "rows", "flow s", "rows/s", "GB", "GB/s", "claims", "p50 ms", "p99 ms", "timeouts",
                    "faults", "released", "returned", "done by dead put", "snapshot+restore", "lost", "duplicated",
                    "errors", "result"], rows)
    tail = [f"processes started: {out['pids']}; left running afterwards (by PID and start time): "
            f"{len(out['left'])}" + (f" {out['left'][:5]}" if out["left"] else "")]
    for e in total.errors[:10]:
        tail.append(f"error: {e.strip()}")
    tail.append("accounting: " + ("every row of every iteration consumed exactly once per consumer, no cell written twice "
                                  "or lost, dead clients' rows returned, no process left" if ok else "FAILED (see above)"))
    return "\n".join([*head, table, *tail]), ok


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python benchmarks/dock_stress.py", description=__doc__.split("\n\n")[0])
    p.add_argument("--clients", type=int, default=64, help="client processes")
    p.add_argument("--shards", type=int, default=4, help="dock shard processes")
    p.add_argument("--iterations", type=int, default=6, help="iterations")
    p.add_argument("--rows", type=int, default=42_000, help="rows per iteration (the defaults move ~10 GB)")
    p.add_argument("--group-size", type=int, default=8, help="rows per prompt group")
    p.add_argument("--prompt-tokens", type=int, default=256, help="tokens per prompt")
    p.add_argument("--tokens", type=int, default=1024, help="mean response tokens (0.5x to 1.5x)")
    p.add_argument("--max-claim", type=int, default=256, help="largest claim, rows (sizes are drawn uniformly)")
    p.add_argument("--kills", type=int, default=6, help="clients killed per iteration")
    p.add_argument("--snapshot-iteration", type=int, default=1, help="iteration in which shard 1 is snapshotted and restored (-1: none)")
    p.add_argument("--lease-s", type=float, default=30.0, help="lease term of the clients' claims, seconds")
    p.add_argument("--release-share", type=float, default=0.5,
                   help="share of killed clients whose owner the driver releases at once (the others' rows come back at expiry)")
    p.add_argument("--claim-wait-s", type=float, default=5.0, help="a client's claim timeout; it then claims again")
    p.add_argument("--timeout-s", type=float, default=600.0, help="limit of every other wait, seconds")
    p.add_argument("--seed", type=int, default=0, help="seed of roles, claim sizes and faults")
    a = p.parse_args(argv)
    for name in ("clients", "shards", "iterations", "rows", "group_size", "prompt_tokens", "tokens", "max_claim"):
        if getattr(a, name) < 1:
            p.error(f"--{name.replace('_', '-')}: got {getattr(a, name)}; must be >= 1")
    if a.clients < len(STAGES):
        p.error(f"--clients {a.clients}: need at least one per consumer ({len(STAGES)})")
    if a.rows % a.group_size or a.max_claim < a.group_size:
        p.error(f"--rows {a.rows} must be a multiple of --group-size {a.group_size}, and --max-claim at least one group")
    if a.snapshot_iteration >= 0 and a.shards < 2:
        p.error("--snapshot-iteration needs --shards >= 2 (shard 0 carries the control channel)")
    if a.kills < 0 or min(a.lease_s, a.claim_wait_s, a.timeout_s) <= 0 or not 0 <= a.release_share <= 1:
        p.error("--kills must be >= 0, the times > 0 and --release-share in [0, 1]")
    return a


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    logging.basicConfig(level=logging.ERROR)
    load = os.getloadavg()
    out = Stress(args).run()
    text, ok = report(args, out, load)
    print(text)
    if ok:
        os.unlink(out["shard_log"])
    else:
        print(f"the shards' log (lease expiries, refusals): {out['shard_log']}")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
