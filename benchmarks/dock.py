"""Sample-flow benchmark: the sharded transfer dock against a centralized driver, one GRPO-shaped iteration.

Four stages move five columns of an iteration of ``--rows`` rows (prompt groups of
``--group-size``), with the dock's ``GRPO_SCHEMA`` types (token ids ``list<int32>``, log-probs
``list<float32>``)::

    rollout    reads prompt_ids                         writes response_ids, rollout_log_prob
    reward     reads response_ids                       writes rm_score
    reference  reads response_ids                       writes ref_log_prob
    actor      reads all five (whole groups)            writes nothing (checks every cell)

Response ``r`` has ``response_lengths(r)`` tokens (mean ``--tokens``, between 0.5x and 1.5x);
prompts have ``--prompt-tokens``. Each stage runs as ``W`` worker processes (``--workers``).

Two topologies, on the same serialization and transport (Arrow IPC over Arrow Flight/gRPC on
loopback, bearer-token auth on every call), so the comparison is about topology, not codecs:

* **centralized** — one driver process holds the batch (as verl's single controller does):
  per stage it scatters contiguous whole-group slices of the stage's input columns to the
  stage's workers (``do_put``, all workers at once from a thread pool) and gathers their
  outputs (``do_get``); stages run one after the other. Every payload byte crosses the driver.
* **dock** — ``S`` dock shards (``python -m dockrl.dock.flight.shards``, separate processes); the
  driver opens the iteration and puts the prompts; every worker claims, reads and puts
  directly against the shards (``DockClient``), all stages at once. Only metadata (the
  shards' ``do_action`` bodies and results: claims, row indexes, layout) crosses a controller.

**Not simulated, not run: the compute of the stages.** Workers only move data: they receive
their input cells, build output cells of the right types and lengths (slices of a random pool
made before timing) and send them; the actor checks every cell's length and reward against the
row it belongs to, so a lost, repeated or misrouted row fails the run.

Reported per configuration (medians over ``--repeats``): sample-flow seconds (from the first
prompt sent to the last actor row received), rows/s, GB/s of stage payload (the Arrow buffer
bytes every stage reads and writes, the same in both topologies), bytes that crossed a
controller, and the ratio to a loopback ceiling measured in the same run: one ``do_get`` stream
of about the same bytes between two processes. Everything shares the machine's cores, so the
absolute times are noisy and CPU-bound; the ratios are the result. A second response length
(``--tokens2``) shows how controller bytes depend (or not) on payload size.

Run::

    python benchmarks/dock.py                      # 4,096 rows x ~1k tokens, 1/2/4/8 workers, 1/2/4 shards
    python benchmarks/dock.py --rows 512 --tokens 256 --workers 1,2 --shards 1,2 --repeats 1
"""

from __future__ import annotations

import argparse
import json
import logging
import multiprocessing as mp
import os
import secrets
import select
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import traceback
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from multiprocessing.connection import Connection, wait
from typing import IO, Any, Callable

import numpy as np
import pyarrow as pa
import pyarrow.flight as flight

from dockrl.dock.client.dock_client import DockClient
from dockrl.dock.flight.server import BearerTokenMiddlewareFactory
from dockrl.dock.roles import ShardAccess
from dockrl.dock.schema import GRPO_SCHEMA
from dockrl.dock.shard.layout import shard_ranges

logger = logging.getLogger("benchmarks.dock")

STAGES = ("rollout", "reward", "reference", "actor")
COLUMNS = ("prompt_ids", "response_ids", "rollout_log_prob", "rm_score", "ref_log_prob")
READS = {"rollout": ("prompt_ids",), "reward": ("response_ids",), "reference": ("response_ids",), "actor": COLUMNS}
WRITES = {"rollout": ("response_ids", "rollout_log_prob"), "reward": ("rm_score",), "reference": ("ref_log_prob",), "actor": ()}
WHOLE_GROUPS = {"rollout": True, "reward": False, "reference": False, "actor": True}
TOKEN_ENV = "DOCKRL_DOCK_TOKEN"
_GOLDEN = 0.6180339887498949


@dataclass(frozen=True)
class Shape:
    """Sizes of one iteration: rows, group size, prompt tokens per row, mean response tokens."""

    rows: int
    group_size: int
    prompt_tokens: int
    tokens: int


@dataclass(frozen=True)
class Job:
    """What a worker does for one dock iteration."""

    iteration: int
    locations: tuple[str, ...]
    shape: Shape
    claim_rows: int
    timeout_s: float


@dataclass(frozen=True)
class Run:
    """One measured iteration: flow seconds, controller bytes, stage payload bytes moved."""

    seconds: float
    controller_bytes: int
    payload_bytes: int


# --- the data every stage moves (no compute) -----------------------------------------------------


def response_lengths(rows: np.ndarray, tokens: int) -> np.ndarray:
    """Response length of each row, tokens: ``floor(tokens·(0.5 + frac(row·φ⁻¹)))``, at least 1 (mean ≈ tokens)."""
    frac = np.mod(np.asarray(rows, dtype=np.float64) * _GOLDEN, 1.0)
    return np.maximum(1, (tokens * (0.5 + frac)).astype(np.int64))


def reward_of(lengths: np.ndarray) -> np.ndarray:
    """The simulated reward of a response of ``lengths`` tokens: 1.0 for an even length, else 0.0."""
    return (np.asarray(lengths) % 2 == 0).astype(np.float32)


def _lengths(column: pa.Array | pa.ChunkedArray) -> np.ndarray:
    if isinstance(column, pa.ChunkedArray):
        column = column.combine_chunks()
    return np.diff(column.offsets.to_numpy())


class Cells:
    """Builds stage outputs as slices of random pools made up front, and checks the actor's input.

    Args:
        pool_values: values per pool; must cover the largest call (rows × longest response).
    """

    def __init__(self, pool_values: int, seed: int = 0) -> None:
        rng = np.random.default_rng(seed)
        self.token_pool = rng.integers(0, 151_936, pool_values, dtype=np.int32)
        self.logp_pool = -rng.exponential(1.0, pool_values).astype(np.float32)

    def lists(self, lengths: np.ndarray, pool: np.ndarray) -> pa.ListArray:
        offsets = np.zeros(len(lengths) + 1, dtype=np.int32)
        np.cumsum(lengths, out=offsets[1:])
        if offsets[-1] > len(pool):
            raise ValueError(f"cell pool of {len(pool)} values is too small for {offsets[-1]} values")
        return pa.ListArray.from_arrays(pa.array(offsets), pa.array(pool[: offsets[-1]]))

    def prompts(self, shape: Shape) -> pa.Table:
        return pa.table({"prompt_ids": self.lists(np.full(shape.rows, shape.prompt_tokens), self.token_pool)})

    def run(self, stage: str, rows: np.ndarray, batch: pa.RecordBatch | pa.Table, shape: Shape) -> dict[str, pa.Array]:
        """The output columns of ``stage`` for ``rows`` given its input ``batch``; the actor checks and returns none.

        Raises:
            ValueError: the batch does not have one record per row, or (actor) a cell does not
                belong to its row.
        """
        if batch.num_rows != len(rows):
            raise ValueError(f"{stage}: {batch.num_rows} records for {len(rows)} rows")
        if stage == "rollout":
            lengths = response_lengths(rows, shape.tokens)
            return {"response_ids": self.lists(lengths, self.token_pool), "rollout_log_prob": self.lists(lengths, self.logp_pool)}
        if stage == "reward":
            return {"rm_score": pa.array(reward_of(_lengths(batch.column("response_ids"))))}
        if stage == "reference":
            return {"ref_log_prob": self.lists(_lengths(batch.column("response_ids")), self.logp_pool)}
        if stage != "actor":
            raise ValueError(f"unknown stage {stage!r}; expected one of {STAGES}")
        want = response_lengths(rows, shape.tokens)
        checks = {name: (_lengths(batch.column(name)), want) for name in ("response_ids", "rollout_log_prob", "ref_log_prob")}
        checks["prompt_ids"] = (_lengths(batch.column("prompt_ids")), np.full(len(rows), shape.prompt_tokens))
        checks["rm_score"] = (batch.column("rm_score").to_numpy(), reward_of(want))
        for name, (got, expected) in checks.items():
            bad = np.flatnonzero(got != expected)
            if len(bad):
                raise ValueError(f"actor: column {name!r} of rows {rows[bad[:5]].tolist()} is {got[bad[:5]].tolist()}, "
                                 f"expected {expected[bad[:5]].tolist()}")
        return {}


def stage_payload(full: pa.Table) -> int:
    """Arrow buffer bytes all stages read and write in one iteration, from the full five-column table."""
    return sum(full.column(c).nbytes for s in STAGES for c in READS[s] + WRITES[s])


# --- workers: one process per (stage, worker); a Flight server for the centralized topology, a
# --- DockClient loop for the dock ------------------------------------------------------------------


class StageServer(flight.FlightServerBase):
    """A centralized-topology worker: ``do_put`` delivers a stage's input and runs it, ``do_get`` returns the output.

    Descriptor command (JSON): {stage, key, first_row, shape}; stage ``store`` keeps the input as
    the output (the ceiling measurement). Ticket (JSON): {key, pop}.
    """

    def __init__(self, cells: Cells, token: str, host: str = "127.0.0.1") -> None:
        # the shards' own bearer-token check, one token (the driver's role): the same auth on every call as the dock's
        access = ShardAccess(token, GRPO_SCHEMA)
        super().__init__(f"grpc://{host}:0", middleware={"auth": BearerTokenMiddlewareFactory(access)})
        self.cells, self.location = cells, f"grpc://{host}:{self.port}"
        self._outputs: dict[str, pa.Table] = {}
        self._lock = threading.Lock()

    def do_put(self, context, descriptor, reader, writer) -> None:
        cmd = json.loads(descriptor.command)
        table = reader.read_all()
        if cmd["stage"] == "store":
            out = table
        else:
            rows = np.arange(cmd["first_row"], cmd["first_row"] + table.num_rows)
            out = pa.table(self.cells.run(cmd["stage"], rows, table, Shape(**cmd["shape"])))
        with self._lock:
            self._outputs[cmd["key"]] = out

    def do_get(self, context, ticket) -> flight.RecordBatchStream:
        req = json.loads(ticket.ticket)
        with self._lock:
            out = self._outputs.pop(req["key"]) if req["pop"] else self._outputs[req["key"]]
        return flight.RecordBatchStream(out)


def dock_stage(dock: DockClient, stage: str, job: Job, cells: Cells) -> tuple[int, int]:
    """Claim, build outputs and put until ``stage`` has taken every row; returns (rows, payload bytes moved).

    First waits for the job's iteration as a stage does (``wait_iteration``): its puts then carry its next claims.
    """
    if dock.wait_iteration(job.iteration - 1, timeout_s=job.timeout_s) != job.iteration:
        raise RuntimeError(f"{stage}: the dock announced another iteration than the job's {job.iteration}")
    rows = moved = 0
    while claim := dock.claim(stage, READS[stage], job.claim_rows, whole_groups=WHOLE_GROUPS[stage]):
        out = cells.run(stage, np.asarray(claim.rows), claim.batch, job.shape)
        if out:
            dock.put(claim.rows, out, ack=claim)  # and done with these rows: their lease ends (as the stage loops do)
        else:
            dock.ack(claim)
        rows += len(claim)
        moved += claim.batch.nbytes + sum(a.nbytes for a in out.values())
    return rows, moved


def worker_main(conn: Connection, stage: str, token: str, pool_values: int, seed: int) -> None:
    """A worker process: serves the centralized topology and runs dock jobs sent on ``conn`` until told to stop."""
    cells = Cells(pool_values, seed)
    server = StageServer(cells, token)
    dock: DockClient | None = None
    conn.send(("ready", server.location))
    try:
        while True:
            try:
                job = conn.recv()  # the driver's next job; EOFError when the driver is gone
            except EOFError:
                break
            if job is None:
                break
            try:
                if dock is None or tuple(dock.locations) != job.locations:
                    if dock is not None:
                        dock.close()
                    dock = DockClient(job.locations, GRPO_SCHEMA, token=token, timeout_s=job.timeout_s)
                conn.send(("done", *dock_stage(dock, stage, job, cells)))
            except Exception:  # noqa: BLE001 - reported to the driver, which fails the run with it
                conn.send(("error", traceback.format_exc()))
    finally:
        if dock is not None:
            dock.close()
        server.shutdown()


class ProcessPool:
    """Processes with one pipe each, started from a fresh fork server that has imported pyarrow and
    the dock client (fast start, and no fork of a process whose gRPC threads already run).

    ``targets``: per process its function and arguments (the child's end of the pipe goes first);
    ``names``: per process what the errors call it.
    """

    def __init__(self, targets: list[tuple[Callable[..., None], tuple]], names: list[str], timeout_s: float) -> None:
        ctx = mp.get_context("forkserver")
        ctx.set_forkserver_preload(["numpy", "pyarrow.flight", "dockrl.dock.client.dock_client"])
        self.timeout_s = timeout_s
        self.names = names
        self.conns: list[Connection] = []
        self.procs: list[Any] = []
        for target, args in targets:
            parent, child = ctx.Pipe()
            proc = ctx.Process(target=target, args=(child, *args), daemon=True)
            proc.start()
            child.close()
            self.conns.append(parent)
            self.procs.append(proc)

    def collect(self, what: str, k: int | None = None) -> list[tuple]:
        """One message from each of the first ``k`` processes (default: all), in order; raises on an
        error report, an exit or the timeout."""
        k = len(self.conns) if k is None else k
        got: dict[int, tuple] = {}
        deadline = time.monotonic() + self.timeout_s
        while len(got) < k:
            waiting = [c for i, c in enumerate(self.conns[:k]) if i not in got]
            for conn in wait(waiting, timeout=max(deadline - time.monotonic(), 0.0)):
                i = self.conns.index(conn)
                try:
                    got[i] = conn.recv()  # type: ignore[union-attr]
                except EOFError:
                    raise RuntimeError(f"{what}: {self.names[i]} exited (code {self.procs[i].exitcode})") from None
                if got[i][0] == "error":
                    raise RuntimeError(f"{what}: {self.names[i]} failed:\n{got[i][1]}")
            if time.monotonic() >= deadline and len(got) < k:
                late = [self.names[i] for i in range(k) if i not in got]
                raise TimeoutError(f"{what}: no answer within {self.timeout_s:.0f}s from {', '.join(late)}")
        return [got[i] for i in range(k)]

    def pids(self) -> list[int]:
        return [p.pid for p in self.procs]

    def close(self) -> None:
        for conn in self.conns:
            try:
                conn.send(None)
            except OSError:
                pass
        deadline = time.monotonic() + 10.0  # idle processes exit at once; one stuck in a claim is terminated
        for proc in self.procs:
            proc.join(max(deadline - time.monotonic(), 0.0))
        for proc in self.procs:
            if proc.is_alive():
                proc.terminate()
                proc.join(5)


class WorkerPool(ProcessPool):
    """``W`` worker processes per stage, each serving on loopback (``ProcessPool``).

    ``pool_values`` sizes the cell pools of the stages that write lists (rollout, reference).
    """

    def __init__(self, per_stage: int, token: str, pool_values: int, timeout_s: float) -> None:
        self.stage_of: list[str] = [s for s in STAGES for _ in range(per_stage)]
        targets = [(worker_main, (stage, token, pool_values if stage in ("rollout", "reference") else 0, k))
                   for k, stage in enumerate(self.stage_of)]
        super().__init__(targets, [f"{stage} worker {k}" for k, stage in enumerate(self.stage_of)], timeout_s)
        ready = self.collect("start")
        self.locations = {s: [loc for (_, loc), st in zip(ready, self.stage_of) if st == s] for s in STAGES}


# --- the two topologies ------------------------------------------------------------------------------


class Centralized:
    """The driver of the centralized topology: scatter each stage's input, gather its output, stage after stage."""

    def __init__(self, locations: dict[str, list[str]], token: str, timeout_s: float) -> None:
        self.clients = {s: [flight.connect(loc) for loc in locs] for s, locs in locations.items()}
        self.options = flight.FlightCallOptions(headers=[(b"authorization", f"Bearer {token}".encode())], timeout=timeout_s)
        self.threads = ThreadPoolExecutor(max_workers=max(len(c) for c in self.clients.values()))
        self.runs = 0

    def _call(self, stage: str, w: int, part: pa.Table, first_row: int, shape: Shape) -> tuple[pa.Table | None, int]:
        client, key = self.clients[stage][w], f"{self.runs}/{stage}/{w}"
        cmd = json.dumps({"stage": stage, "key": key, "first_row": first_row, "shape": shape.__dict__}).encode()
        writer, _ = client.do_put(flight.FlightDescriptor.for_command(cmd), part.schema, self.options)
        writer.write_table(part)
        writer.close()
        moved = len(cmd) + part.nbytes
        if not WRITES[stage]:
            return None, moved
        ticket = json.dumps({"key": key, "pop": True}).encode()
        out = client.do_get(flight.Ticket(ticket), self.options).read_all()
        return out, moved + len(ticket) + out.nbytes

    def _stage(self, stage: str, batch: pa.Table, shape: Shape) -> tuple[pa.Table, int]:
        parts = [(w, a, b) for w, (a, b) in enumerate(shard_ranges(shape.rows, shape.group_size, len(self.clients[stage]))) if b > a]
        inputs = batch.select(list(READS[stage]))
        futures = [self.threads.submit(self._call, stage, w, inputs.slice(a, b - a), a, shape) for w, a, b in parts]
        results = [f.result() for f in futures]
        outs = [out for out, _ in results if out is not None]
        return (pa.concat_tables(outs) if outs else batch.select([])), sum(moved for _, moved in results)

    def run(self, prompts: pa.Table, shape: Shape) -> Run:
        self.runs += 1
        start = time.perf_counter()
        batch, through_driver = prompts, 0
        for stage in STAGES:
            out, moved = self._stage(stage, batch, shape)
            for name in WRITES[stage]:
                batch = batch.append_column(name, out.column(name))
            through_driver += moved
        seconds = time.perf_counter() - start
        return Run(seconds, through_driver, through_driver)  # all payload crosses the driver

    def ceiling(self, table: pa.Table) -> float:
        """GB/s of one ``do_get`` stream of ``table`` from a worker process to this one."""
        client = self.clients["actor"][0]
        cmd = json.dumps({"stage": "store", "key": "ceiling"}).encode()
        writer, _ = client.do_put(flight.FlightDescriptor.for_command(cmd), table.schema, self.options)
        writer.write_table(table)
        writer.close()
        ticket = flight.Ticket(json.dumps({"key": "ceiling", "pop": True}).encode())
        start = time.perf_counter()
        got = client.do_get(ticket, self.options).read_all()
        return got.nbytes / (time.perf_counter() - start) / 1e9

    def close(self) -> None:
        self.threads.shutdown()
        for clients in self.clients.values():
            for c in clients:
                c.close()


def run_dock(driver: DockClient, pool: WorkerPool, prompts: pa.Table, job: Job) -> Run:
    """One iteration through the dock: open, hand every worker the job, put the prompts, wait for every stage."""
    before_call = driver.controller_bytes
    before = driver.stats()["dock/controller_bytes"]
    stats_call = driver.controller_bytes - before_call  # the shards count this call after answering it
    start = time.perf_counter()
    driver.open_iteration(job.iteration, job.shape.rows, job.shape.group_size)
    for conn in pool.conns:
        conn.send(job)
    driver.put(range(job.shape.rows), {"prompt_ids": prompts.column("prompt_ids")})
    done = pool.collect(f"dock iteration {job.iteration}")
    seconds = time.perf_counter() - start
    driver.close_iteration()
    for stage in STAGES:
        rows = sum(d[1] for d, s in zip(done, pool.stage_of) if s == stage)
        if rows != job.shape.rows:
            raise RuntimeError(f"dock iteration {job.iteration}: stage {stage} took {rows} rows, expected {job.shape.rows}")
    controller = int(driver.stats()["dock/controller_bytes"] - before - stats_call)
    return Run(seconds, controller, sum(d[2] for d in done))


def start_shards(n: int, token: str, timeout_s: float, log: IO[str]) -> tuple[list[subprocess.Popen], list[str]]:
    """``n`` dock shard processes on loopback, logging to ``log``; their locations in shard order.

    Raises:
        TimeoutError: a shard printed no location within ``timeout_s``.
        RuntimeError: a shard exited before printing its location.
    """
    env = {**os.environ, TOKEN_ENV: token}
    cmd = [sys.executable, "-m", "dockrl.dock.flight.shards", "--port", "0", "--token-env", TOKEN_ENV, "--timeout-s", str(timeout_s)]
    procs = [subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=log, text=True) for _ in range(n)]
    return procs, shard_locations(procs, timeout_s, log)


def shard_locations(procs: list[subprocess.Popen], timeout_s: float, log: IO[str]) -> list[str]:
    """The ``grpc://`` location each started shard process prints first, in order.

    Raises:
        TimeoutError: a shard printed no location within ``timeout_s``.
        RuntimeError: a shard exited before printing its location.
    """
    locations = []
    for s, proc in enumerate(procs):
        assert proc.stdout is not None
        if not select.select([proc.stdout], [], [], timeout_s)[0]:
            raise TimeoutError(f"dock shard {s} printed no location within {timeout_s:.0f}s (log: {log.name})")
        line = proc.stdout.readline().strip()
        if not line.startswith("grpc://"):
            raise RuntimeError(f"dock shard {s} exited with {proc.poll()} before printing its location (log: {log.name})")
        locations.append(line)
    return locations


# --- the table ---------------------------------------------------------------------------------------


def full_table(cells: Cells, shape: Shape) -> pa.Table:
    """All five columns of an iteration, built by running the stages in this process (ceiling payload, check)."""
    rows, table = np.arange(shape.rows), cells.prompts(shape)
    for stage in STAGES:
        for name, array in cells.run(stage, rows, table.select(list(READS[stage])), shape).items():
            table = table.append_column(name, array)
    return table


def percent(share: float) -> str:
    """``share`` as a percentage: one decimal, or two significant digits under 0.1% (never a 0.0% of something)."""
    value = 100 * share
    return f"{value:.1f}%" if value >= 0.1 else f"{value:.2g}%"


def render(headers: list[str], rows: list[list[str]]) -> str:
    widths = [max(len(h), *(len(r[i]) for r in rows)) for i, h in enumerate(headers)]
    line = lambda cells: "| " + " | ".join(c.rjust(w) for c, w in zip(cells, widths)) + " |"  # noqa: E731
    return "\n".join([line(headers), "|" + "|".join("-" * (w + 2) for w in widths) + "|", *map(line, rows)])


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python benchmarks/dock.py", description=__doc__.split("\n\n")[0])
    ints = lambda s: [int(x) for x in s.split(",")]  # noqa: E731
    p.add_argument("--rows", type=int, default=4096, help="rows per iteration (responses)")
    p.add_argument("--group-size", type=int, default=8, help="rows per prompt group")
    p.add_argument("--prompt-tokens", type=int, default=256, help="tokens per prompt")
    p.add_argument("--tokens", type=int, default=1024, help="mean response tokens")
    p.add_argument("--tokens2", type=int, default=256, help="second mean response length, for controller bytes against payload")
    p.add_argument("--workers", type=ints, default=[1, 2, 4, 8], help="worker processes per stage, comma-separated")
    p.add_argument("--shards", type=ints, default=[1, 2, 4], help="dock shard counts, comma-separated")
    p.add_argument("--repeats", type=int, default=3, help="measured iterations per configuration (median reported)")
    p.add_argument("--warmup", type=int, default=1, help="unmeasured iterations per configuration first")
    p.add_argument("--claim-rows", type=int, default=128, help="rows per dock claim (a multiple of --group-size)")
    p.add_argument("--timeout-s", type=float, default=300.0, help="limit of every wait (claims, calls, start-up), seconds")
    a = p.parse_args(argv)
    for name in ("rows", "group_size", "prompt_tokens", "tokens", "tokens2", "repeats", "claim_rows"):
        if getattr(a, name) < 1:
            p.error(f"--{name.replace('_', '-')}: got {getattr(a, name)}; must be >= 1")
    if a.warmup < 0:
        p.error(f"--warmup: got {a.warmup}; must be >= 0")
    if a.rows % a.group_size:
        p.error(f"--rows {a.rows} must be a multiple of --group-size {a.group_size}")
    if a.claim_rows % a.group_size:
        p.error(f"--claim-rows {a.claim_rows} must be a multiple of --group-size {a.group_size} (whole-group claims)")
    for name in ("workers", "shards"):
        if not getattr(a, name) or min(getattr(a, name)) < 1:
            p.error(f"--{name}: got {getattr(a, name)}; expected positive integers, e.g. 1,2,4")
    return a


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    logging.basicConfig(level=logging.WARNING)
    token = secrets.token_hex(16)
    lengths = [args.tokens] + ([args.tokens2] if args.tokens2 != args.tokens else [])
    shapes = {t: Shape(args.rows, args.group_size, args.prompt_tokens, t) for t in lengths}
    longest = 3 * max(lengths) // 2 + 1  # response_lengths < 1.5 x tokens
    cells = Cells(args.rows * max(args.prompt_tokens, longest), seed=10_000)
    prompts = {t: cells.prompts(s) for t, s in shapes.items()}
    full = {t: full_table(cells, s) for t, s in shapes.items()}
    payload = {t: stage_payload(full[t]) for t in lengths}
    ceiling_tables = {t: pa.concat_tables([full[t]] * max(1, round(payload[t] / full[t].nbytes))) for t in lengths}
    results: dict[tuple, list[Run]] = {}
    ceilings: dict[int, list[float]] = {t: [] for t in lengths}
    iteration = 0
    started = time.perf_counter()
    load = os.getloadavg()
    with tempfile.NamedTemporaryFile("w", prefix="dock-shards-", suffix=".log", delete=False) as log:
        shard_procs, shard_locations = start_shards(max(args.shards), token, args.timeout_s, log)
        try:
            driver_docks = {s: DockClient(shard_locations[:s], GRPO_SCHEMA, token=token, timeout_s=args.timeout_s)
                            for s in args.shards}
            for w in args.workers:
                largest_input = max(args.claim_rows, -(-args.rows // (args.group_size * w)) * args.group_size)
                pool = WorkerPool(w, token, largest_input * longest, args.timeout_s)
                central = Centralized(pool.locations, token, args.timeout_s)
                try:
                    # unmeasured rounds at the shorter length open every connection, then round-robin
                    # repeats, so that changes of the machine's load hit every configuration alike
                    rounds = [(False, min(lengths))] * args.warmup + [(True, t) for _ in range(args.repeats) for t in lengths]
                    for measured, t in rounds:
                        runs = [("centralized", w, 0, t, lambda central=central, t=t: central.run(prompts[t], shapes[t]))]
                        for s in args.shards:
                            iteration += 1
                            job = Job(iteration, tuple(shard_locations[:s]), shapes[t], args.claim_rows, args.timeout_s)
                            runs.append(("dock", w, s, t, lambda s=s, t=t, job=job, pool=pool: run_dock(driver_docks[s], pool, prompts[t], job)))
                        for *key, measure in runs:
                            run = measure()
                            if measured:
                                results.setdefault(tuple(key), []).append(run)
                        if measured:  # the ceiling under the same load as this round's runs
                            ceilings[t].append(central.ceiling(ceiling_tables[t]))
                finally:
                    central.close()
                    pool.close()
        finally:
            for proc in shard_procs:
                proc.terminate()
            for proc in shard_procs:
                try:
                    proc.wait(10)
                except subprocess.TimeoutExpired:
                    proc.kill()
    os.unlink(log.name)
    print(report(args, shapes, payload, ceilings, results, load, time.perf_counter() - started))
    return 0


def report(
    args: argparse.Namespace, shapes: dict[int, Shape], payload: dict[int, int], ceilings: dict[int, list[float]],
    results: dict[tuple, list[Run]], load: tuple[float, float, float], wall_s: float,
) -> str:
    """The tables: one per response length, controller bytes against length, and the issue's targets."""
    med = lambda runs, f: statistics.median(getattr(r, f) for r in runs)  # noqa: E731
    out = [
        f"# transfer dock sample-flow benchmark: {args.rows:,} rows in groups of {args.group_size}, "
        f"prompts {args.prompt_tokens} tokens, four stages (rollout, reward, reference, actor), five columns",
        f"# machine: {os.cpu_count()} CPU cores, shared by the driver, up to {max(args.shards)} shard processes and "
        f"4 x W worker processes (W = workers/stage), load average {load[0]:.1f} at start: CPU-bound and noisy, read the ratios",
        "# stage compute is not run: workers only move data (receive inputs, build outputs of the right size, send them)",
        f"# medians of {args.repeats} iterations per configuration (after {args.warmup} unmeasured), {args.claim_rows} rows "
        f"per dock claim; benchmark wall time {wall_s:.0f} s",
    ]
    for t, shape in shapes.items():
        ceiling = statistics.median(ceilings[t])
        out += ["", f"## responses ~{t} tokens: stage payload {payload[t] / 1e6:.4g} MB per iteration; loopback ceiling "
                f"{ceiling:.3g} GB/s (one Flight do_get stream between two processes, median of {len(ceilings[t])}, one per round; "
                "parallel streams can beat it)"]
        rows = []
        for w in args.workers:
            central = med(results[("centralized", w, 0, t)], "seconds")
            for s in [0, *args.shards]:
                runs = results[("centralized" if s == 0 else "dock", w, s, t)]
                sec, ctrl = med(runs, "seconds"), med(runs, "controller_bytes")
                gbps = payload[t] / sec / 1e9
                rows.append([str(w), "centralized" if s == 0 else "dock", str(s) if s else "-", f"{sec:.3f}",
                             f"{shape.rows / sec:,.0f}", f"{gbps:.3g}", percent(gbps / ceiling),
                             f"{central / sec:.2f}x", f"{ctrl:,.0f}", f"{ctrl / shape.rows:,.1f}"])
        out.append(render(["workers/stage", "topology", "shards", "flow s", "rows/s", "GB/s", "of ceiling",
                           "speed vs central", "controller bytes", "per row"], rows))
    if len(shapes) == 2:
        small, big = sorted(shapes)
        out += ["", f"## controller bytes against payload: stage payload x{payload[big] / payload[small]:.2f} "
                f"from ~{small} to ~{big} tokens"]
        rows = []
        for w in args.workers:
            for s in [0, *args.shards]:
                topo = "centralized" if s == 0 else "dock"
                a, b = (med(results[(topo, w, s, t)], "controller_bytes") for t in (small, big))
                rows.append([str(w), topo, str(s) if s else "-", f"{a:,.0f}", f"{b:,.0f}", f"x{b / a:.2f}"])
        out.append(render(["workers/stage", "topology", "shards", f"~{small} tokens", f"~{big} tokens", "ratio"], rows))
    t, w = args.tokens, max(args.workers)
    ceiling = statistics.median(ceilings[t])
    best = min(args.shards, key=lambda s: med(results[("dock", w, s, t)], "seconds"))
    speed = med(results[("centralized", w, 0, t)], "seconds") / med(results[("dock", w, best, t)], "seconds")
    share = payload[t] / med(results[("dock", w, best, t)], "seconds") / 1e9 / ceiling
    out += ["", f"## targets (responses ~{t} tokens, {w} workers per stage, fastest dock: {best} shard{'s' if best > 1 else ''})",
            f"- dock speed / centralized speed: {speed:.2f}x (target >= 4x: {'met' if speed >= 4 else 'not met'})",
            f"- dock GB/s / loopback ceiling: {100 * share:.1f}% (target >= 50%: {'met' if share >= 0.5 else 'not met'})"]
    if len(shapes) == 2:
        ratios = [med(results[("dock", w2, s, args.tokens)], "controller_bytes") / med(results[("dock", w2, s, args.tokens2)], "controller_bytes")
                  for w2 in args.workers for s in args.shards]
        out.append(f"- dock controller bytes, ~{args.tokens} over ~{args.tokens2} tokens: x{min(ratios):.2f} to x{max(ratios):.2f} "
                   f"(payload x{payload[args.tokens] / payload[args.tokens2]:.2f}; target: independent of payload size)")
    return "\n".join(out)


if __name__ == "__main__":
    sys.exit(main())
