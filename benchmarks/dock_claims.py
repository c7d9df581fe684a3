"""Claim benchmark: the dock's claim cycle against raw Flight calls, and the controller's cost as the work grows.

Three tables (medians; the machine is shared, so the ratios are the result, not the times):

* **(a) claim + put cycle** over Arrow Flight on loopback: one dock shard in its own process
  (``python -m dockrl.dock.flight.shards``) and a ``DockClient`` in this one claim ``--claim-rows`` rows
  of ``response_ids`` (``--tokens`` tokens each) for the ``reference`` consumer and put the same
  rows' ``ref_log_prob`` with the ack (``put(..., ack=claim)``), twice: with the next claim riding
  on the put (one round trip per cycle, the default) and with ``prefetch=False`` (two). The
  floor, measured in the same run: a raw Flight server in its own process answering one
  ``do_get`` of a table of the same cells and one ``do_put`` of a batch of the same output cells
  (plus the int64 row column). The cycles are reported in units of those two raw calls; the
  raw ``do_exchange`` that moves both in one call is shown beside them. And the same cycle (claim
  on the put) against a second shard process serving mutual TLS with a run's certificates
  (``dockrl.dock.tls``, as a distributed run's launcher starts its shards), alternating with the
  plain one: the TLS / plain ratio is TLS's cost on the claim cycle.
* **(b) claim cost as the work grows**, on one ``ShardService`` in this process (the controller
  a shard server runs, without the transport): claimers (distinct lease owners) take turns;
  each acks its previous claim of ``--claim-rows`` rows and claims the next, so every claimer
  holds one lease at any time. Reported: microseconds per claim plus ack against rows per
  iteration (claimers fixed) and against claimers (rows fixed), and a cycle's cost with claims
  of another consumer blocked on the same shard (they must not slow the others down).
* **(c) controller CPU per iteration**: one ``ShardService`` runs a whole GRPO-shaped iteration
  of ``rows`` rows for ``claimers`` claimers of 16 rows: the driver's put of the prompts, then
  for each of the five consumers (rollout, reward, advantage, reference, actor) every claimer
  claims (all leases held at once) and then puts its outputs with the ack. Reported: process
  CPU seconds inside the shard's calls per iteration (building the requests is the clients'
  work, left out), and the part spent in claims. Sizes too slow to run (an old,
  quadratic controller) are extrapolated from the two largest measured ones (``--max-cpu-s``),
  and marked so.

Run::

    python benchmarks/dock_claims.py            # the full tables (several minutes on 2 cores)
    python benchmarks/dock_claims.py --quick    # small sizes, seconds (the test suite's run)
"""

from __future__ import annotations

import argparse
import os
import select
import statistics
import subprocess
import sys
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import numpy as np
import pyarrow as pa
import pyarrow.flight as flight

from dockrl.dock.client.dock_client import DockClient
from dockrl.dock.errors import DockError
from dockrl.dock.schema import GRPO_SCHEMA
from dockrl.dock.shard.service import ShardService
from dockrl.dock.tls import RunCertificates

GROUP = 16
"""Rows per prompt group in every table."""


# --- cells ------------------------------------------------------------------------------------------
def token_lists(rows: int, tokens: int, type_: pa.DataType, seed: int = 0) -> pa.Array:
    """``rows`` lists of ``tokens`` values each, of the list type ``type_`` (int32 ids or float32 log-probs)."""
    rng = np.random.default_rng(seed)
    value_type = type_.value_type
    values = rng.integers(0, 50_000, rows * tokens).astype(np.int32) if pa.types.is_integer(value_type) \
        else -rng.exponential(1.0, rows * tokens).astype(np.float32)
    offsets = np.arange(0, rows * tokens + 1, tokens, dtype=np.int32)
    return pa.ListArray.from_arrays(pa.array(offsets), pa.array(values, type=value_type)).cast(type_)


def column_type(name: str) -> pa.DataType:
    return GRPO_SCHEMA.column(name).type


# --- (a) the cycle against raw Flight ------------------------------------------------------------------
class RawServer(flight.FlightServerBase):
    """The floor: a Flight server that answers every ``do_get`` with one fixed table and reads every ``do_put``."""

    def __init__(self, rows: int, tokens: int) -> None:
        super().__init__("grpc://127.0.0.1:0")
        self.table = pa.table({"response_ids": token_lists(rows, tokens, column_type("response_ids"))})

    def do_get(self, context, ticket):  # noqa: ANN001 - Flight's signature
        return flight.RecordBatchStream(self.table)

    def do_put(self, context, descriptor, reader, writer):  # noqa: ANN001 - Flight's signature
        reader.read_all()

    def do_exchange(self, context, descriptor, reader, writer):  # noqa: ANN001 - Flight's signature
        reader.read_all()
        writer.begin(self.table.schema)
        writer.write_table(self.table)


def raw_server_main(rows: int, tokens: int) -> None:
    server = RawServer(rows, tokens)
    print(f"grpc://127.0.0.1:{server.port}", flush=True)
    sys.stdin.read()  # until the parent closes our stdin
    server.shutdown()


@dataclass
class Child:
    proc: subprocess.Popen
    location: str


def start_child(args: list[str], env: dict[str, str] | None = None) -> Child:
    """A server process that prints its location as its first line; stops when its stdin closes or on terminate."""
    proc = subprocess.Popen([sys.executable, *args], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
                            stderr=subprocess.DEVNULL, env={**os.environ, **(env or {})})
    ready = select.select([proc.stdout], [], [], 60.0)[0]
    line = proc.stdout.readline().strip() if ready else ""  # type: ignore[union-attr]
    if not line.startswith(("grpc://", "grpc+tls://")):
        proc.kill()
        raise RuntimeError(f"server {args} did not print its location (got {line!r})")
    return Child(proc, line)


def stop_child(child: Child) -> None:
    child.proc.terminate()
    try:
        child.proc.wait(10)
    except subprocess.TimeoutExpired:
        child.proc.kill()
        child.proc.wait()


def timed(fn: Callable[[], object], n: int) -> float:
    """Median seconds of ``n`` calls of ``fn``, after one untimed call."""
    fn()
    times = []
    for _ in range(n):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def cycle_table(claim_rows: int, tokens: int, cycles: int, repeats: int) -> list[dict[str, float]]:
    """Per repeat, alternating in the same processes: ms of the raw do_get + do_put, of the raw do_exchange, of the
    dock's cycle with the claim riding on the put (``one_ms``) and without (``two_ms``); the cycles' ratios to the raw pair;
    the claim-on-the-put cycle against a shard over mutual TLS (``tls_ms``) and its ratio to the plain one."""
    raw = start_child([__file__, "--raw-server", "--claim-rows", str(claim_rows), "--tokens", str(tokens)])
    shard = start_child(["-m", "dockrl.dock.flight.shards", "--host", "127.0.0.1", "--port", "0"])
    certs = RunCertificates.generate(["127.0.0.1"], run="bench")
    secure = start_child(["-m", "dockrl.dock.flight.shards", "--host", "127.0.0.1", "--port", "0", "--tls"], env=certs.server.env("server"))
    out = []
    try:
        conn = flight.connect(raw.location)
        ticket = flight.Ticket(b'{"claim": "raw"}')
        logp = token_lists(claim_rows, tokens, column_type("ref_log_prob"), seed=1)
        raw_batch = pa.RecordBatch.from_arrays([pa.array(np.arange(claim_rows, dtype=np.int64)), logp], names=["row", "ref_log_prob"])
        descriptor = flight.FlightDescriptor.for_command(b'{"iteration": 0}')

        def raw_cycle() -> None:
            conn.do_get(ticket).read_all()
            writer, _ = conn.do_put(descriptor, raw_batch.schema)
            writer.write_batch(raw_batch)
            writer.close()

        def raw_exchange() -> None:
            writer, reader = conn.do_exchange(descriptor)
            with writer:
                writer.begin(raw_batch.schema)
                writer.write_batch(raw_batch)
                writer.done_writing()
                reader.read_all()

        def dock_cycle_s(dock: DockClient, iteration: int) -> float:
            rows = claim_rows * cycles
            dock.open_iteration(iteration, rows, GROUP)
            dock.put(range(rows), {"response_ids": token_lists(rows, tokens, column_type("response_ids"))})
            times = []
            for _ in range(cycles):
                t0 = time.perf_counter()
                claim = dock.claim("reference", ["response_ids"], claim_rows)
                dock.put(claim.rows, {"ref_log_prob": logp}, ack=claim)
                times.append(time.perf_counter() - t0)
            dock.close_iteration()
            return statistics.median(times[1:] or times)  # the first claim is its own call either way

        with DockClient([shard.location], GRPO_SCHEMA, timeout_s=30.0) as one, \
                DockClient([shard.location], GRPO_SCHEMA, timeout_s=30.0, prefetch=False) as two, \
                DockClient([secure.location], GRPO_SCHEMA, timeout_s=30.0, tls=certs.client) as tls:
            for rep in range(repeats):
                raw_s = timed(raw_cycle, cycles)
                exchange_s = timed(raw_exchange, cycles)
                one_s, two_s = dock_cycle_s(one, 2 * rep), dock_cycle_s(two, 2 * rep + 1)
                tls_s = dock_cycle_s(tls, rep)
                out.append({"raw_ms": raw_s * 1e3, "exchange_ms": exchange_s * 1e3, "one_ms": one_s * 1e3,
                            "two_ms": two_s * 1e3, "one_ratio": one_s / raw_s, "two_ratio": two_s / raw_s,
                            "tls_ms": tls_s * 1e3, "tls_ratio": tls_s / one_s})
        conn.close()
    finally:
        stop_child(secure)
        stop_child(shard)
        raw.proc.stdin.close()  # type: ignore[union-attr]
        stop_child(raw)
    return out


# --- (b) claim cost as the work grows -----------------------------------------------------------------
def service() -> ShardService:
    return ShardService(GRPO_SCHEMA, name="local://bench", timeout_s=30.0, lease_s=3600.0)


def open_one_shard(svc: ShardService, iteration: int, rows: int) -> None:
    svc.action("open_iteration", {"iteration": iteration, "num_rows": rows, "group_size": GROUP, "first_row": 0,
                                  "stop_row": rows, "shard": 0, "num_shards": 1})


def claim_req(iteration: int, consumer: str, columns: list[str], count: int, owner: str, *, whole_groups: bool = False,
              timeout_s: float | None = 0.0, at_least: int = 0) -> dict:
    return {"iteration": iteration, "consumer": consumer, "columns": columns, "count": count, "at_least": at_least,
            "whole_groups": whole_groups, "timeout_s": timeout_s, "owner": owner, "lease": uuid.uuid4().hex,
            "lease_s": 3600.0, "wait_held": False}


def rotation_cost(rows: int, claimers: int, claim_rows: int, measured: int) -> float:
    """Microseconds per (ack previous + claim next) with ``claimers`` owners each holding one lease, median of blocks."""
    svc = service()
    open_one_shard(svc, 0, rows)
    svc.dock.put(np.arange(rows), {"response_ids": token_lists(rows, 4, column_type("response_ids"))})
    held: list[tuple[str, list[int]]] = []
    owners = [f"claimer-{k}" for k in range(claimers)]

    def step(k: int) -> None:
        owner = owners[k % claimers]
        if len(held) >= claimers:
            lease, got = held.pop(0)
            svc.action("ack", {"iteration": 0, "consumer": "reference", "lease": lease, "rows": got})
        req = claim_req(0, "reference", ["response_ids"], claim_rows, owner)
        res = svc.claim(req)
        held.append((req["lease"], res["rows"]))

    total_claims = rows // claim_rows
    for k in range(claimers):  # every claimer holds a lease
        step(k)
    left = total_claims - claimers
    n = max(1, min(measured, left))
    blocks = []
    k = claimers
    per_block = max(1, n // 5)
    while k < claimers + n:
        t0 = time.perf_counter()
        for _ in range(per_block):
            step(k)
            k += 1
        blocks.append((time.perf_counter() - t0) / per_block)
    svc.close()
    return statistics.median(blocks) * 1e6


def blocked_cost(rows: int, blocked: int, claim_rows: int, cycles: int) -> float:
    """Microseconds per claim + put + ack of one consumer while ``blocked`` claims of another wait on the same shard."""
    svc = service()
    open_one_shard(svc, 0, rows)
    svc.dock.put(np.arange(rows), {"response_ids": token_lists(rows, 4, column_type("response_ids"))})
    logp = token_lists(claim_rows, 4, column_type("ref_log_prob"))
    stop = threading.Event()

    def waiter(k: int) -> None:  # the actor's input never becomes ready: it blocks until the iteration closes
        try:
            svc.claim(claim_req(0, "actor", ["ref_log_prob", "advantages"], GROUP, f"blocked-{k}", whole_groups=True,
                                timeout_s=60.0, at_least=GROUP))
        except DockError:
            pass
        stop.wait()

    threads = [threading.Thread(target=waiter, args=(k,), daemon=True) for k in range(blocked)]
    for t in threads:
        t.start()
    time.sleep(0.2 + 0.002 * blocked)  # let them block
    times = []
    for _ in range(cycles):
        t0 = time.perf_counter()
        req = claim_req(0, "reference", ["response_ids"], claim_rows, "worker")
        res = svc.claim(req)
        table = pa.table({"row": pa.array(res["rows"], type=pa.int64()), "ref_log_prob": logp.slice(0, len(res["rows"]))})
        svc.put({"iteration": 0, "ack": {"consumer": "reference", "lease": req["lease"]}}, table)
        times.append(time.perf_counter() - t0)
    svc.action("close_iteration", {})  # fails the blocked claims
    stop.set()
    for t in threads:
        t.join(10)
    svc.close()
    return statistics.median(times) * 1e6


# --- (c) controller CPU per iteration --------------------------------------------------------------------
PIPELINE = [  # consumer, input columns, whole groups, outputs
    ("rollout", ["prompt_ids"], True, ["response_ids", "truncated", "rollout_log_prob"]),
    ("reward", ["response_ids"], False, ["rm_score", "correct"]),
    ("advantage", ["rm_score"], True, ["advantages"]),
    ("reference", ["response_ids"], False, ["ref_log_prob"]),
    ("actor", ["prompt_ids", "response_ids", "rollout_log_prob", "advantages", "ref_log_prob"], True, ["old_log_prob"]),
]


def iteration_cpu(rows: int, claimers: int, tokens: int = 4) -> tuple[float, float]:
    """(controller CPU seconds of one whole iteration on one shard, the part spent in claims) for ``claimers``
    of ``rows/claimers`` rows: process CPU inside the shard's calls (the requests are built outside)."""
    per = rows // claimers
    cells = {name: (token_lists(per, tokens, column_type(name)) if pa.types.is_list(column_type(name))
                    else pa.array(np.zeros(per), type=column_type(name)))
             for _, _, _, outs in PIPELINE for name in outs}
    prompts = pa.table({"row": pa.array(np.arange(rows)), "prompt_ids": token_lists(rows, tokens, column_type("prompt_ids"))})
    svc = service()
    open_one_shard(svc, 0, rows)
    owners = [f"claimer-{k}" for k in range(claimers)]
    clock = time.thread_time
    t0 = clock()
    svc.put({"iteration": 0}, prompts)
    put_cpu, claim_cpu = clock() - t0, 0.0
    for consumer, inputs, whole, outputs in PIPELINE:
        claims = []
        for owner in owners:
            req = claim_req(0, consumer, inputs, per, owner, whole_groups=whole)
            t0 = clock()
            got = svc.claim(req)["rows"]
            claim_cpu += clock() - t0
            claims.append((req["lease"], got))
        for lease, got in claims:
            table = pa.table({"row": pa.array(got, type=pa.int64()), **{name: cells[name] for name in outputs}})
            body = {"iteration": 0, "ack": {"consumer": consumer, "lease": lease}}
            t0 = clock()
            svc.put(body, table)
            put_cpu += clock() - t0
    svc.close()
    return put_cpu + claim_cpu, claim_cpu


def cpu_table(sizes: list[tuple[int, int]], max_cpu_s: float) -> Iterator[tuple[int, int, float, float, str]]:
    """Rows of table (c): measured while the previous size stayed under ``max_cpu_s``, else extrapolated."""
    measured: list[tuple[int, float, float]] = []  # (rows·claimers, cpu, claim cpu)
    for rows, claimers in sizes:
        work = rows * claimers
        if measured and measured[-1][1] * work / measured[-1][0] > max_cpu_s and len(measured) >= 2:
            # power law through the two largest measured sizes: cpu ∝ work^p
            (w0, c0, k0), (w1, c1, k1) = measured[-2], measured[-1]
            p = np.log(c1 / c0) / np.log(w1 / w0)
            q = np.log(k1 / k0) / np.log(w1 / w0)
            yield rows, claimers, c1 * (work / w1) ** p, k1 * (work / w1) ** q, f"extrapolated (cpu ∝ work^{p:.2f})"
            continue
        cpu, claim = iteration_cpu(rows, claimers)
        measured.append((work, cpu, claim))
        yield rows, claimers, cpu, claim, "measured"


# --- report ------------------------------------------------------------------------------------------------
def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="small sizes: seconds, for the test suite")
    parser.add_argument("--claim-rows", type=int, default=128, help="rows per claim in table (a)")
    parser.add_argument("--tokens", type=int, default=16, help="tokens per row in table (a)")
    parser.add_argument("--max-cpu-s", type=float, default=60.0, help="extrapolate sizes of table (c) expected to take longer")
    parser.add_argument("--label", default="", help="a label printed in the title (which code was measured)")
    parser.add_argument("--raw-server", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    for flag, value in (("--claim-rows", args.claim_rows), ("--tokens", args.tokens)):
        if value < 1:
            parser.error(f"{flag}: got {value}; expected an integer >= 1")
    if args.raw_server:
        raw_server_main(args.claim_rows, args.tokens)
        return 0
    if args.quick:
        cycles, repeats, rows_sweep, claimers_sweep, blocked_sweep = 20, 2, [1024, 4096], [8, 64], [0, 8]
        cpu_sizes, sweep_rows, sweep_claimers, measured = [(1024, 64), (2048, 128)], 4096, 8, 32
    else:
        cycles, repeats, rows_sweep, claimers_sweep, blocked_sweep = 200, 5, [1024, 8192, 32768, 131072], [8, 64, 256, 1024], [0, 16, 64]
        cpu_sizes = [(2048, 128), (4096, 256), (8192, 512), (16384, 1024)]
        sweep_rows, sweep_claimers, measured = 65536, 16, 400
    print(f"# dock claims{' — ' + args.label if args.label else ''}: {os.cpu_count()} CPU cores, "
          f"pyarrow {pa.__version__}, numpy {np.__version__}")

    cyc = cycle_table(args.claim_rows, args.tokens, cycles, repeats)
    print(f"\n## (a) claim + put cycle, {args.claim_rows} rows x {args.tokens} tokens, one shard over Flight (loopback)\n")
    keys = ("raw_ms", "exchange_ms", "one_ms", "two_ms", "tls_ms", "one_ratio", "two_ratio", "tls_ratio")
    print("| repeat | raw do_get + do_put ms | raw do_exchange ms | dock, claim on the put ms | dock, two round trips ms "
          "| dock over mutual TLS, claim on the put ms | claim on the put / raw pair | two round trips / raw pair | TLS / plain |")
    print("|---|---|---|---|---|---|---|---|---|")
    for k, c in enumerate([*cyc, {key: statistics.median(c[key] for c in cyc) for key in keys}]):
        print(f"| {k if k < len(cyc) else 'median'} | " + " | ".join(f"{c[key]:.3f}" for key in keys[:5])
              + f" | {c['one_ratio']:.2f}x | {c['two_ratio']:.2f}x | {c['tls_ratio']:.2f}x |")

    print(f"\n## (b) claim + ack cost, {args.claim_rows // 8} rows per claim, one shard in process\n")
    print("| sweep | rows per iteration | claimers | blocked claims | us per claim |")
    print("|---|---|---|---|---|")
    per = args.claim_rows // 8
    for rows in rows_sweep:
        print(f"| rows | {rows:,} | {sweep_claimers} | 0 | {rotation_cost(rows, sweep_claimers, per, measured):.0f} |")
    for claimers in claimers_sweep:
        print(f"| claimers | {sweep_rows:,} | {claimers} | 0 | {rotation_cost(sweep_rows, claimers, per, measured):.0f} |")
    for blocked in blocked_sweep:
        print(f"| blocked (claim+put+ack) | {args.claim_rows * (cycles + 1):,} | 1 | {blocked} | "
              f"{blocked_cost(args.claim_rows * (cycles + 1), blocked, args.claim_rows, cycles):.0f} |")

    print("\n## (c) controller CPU per iteration, 16 rows per claim, 5 consumers, one shard in process\n")
    print("| rows | claimers | CPU s per iteration | of which claims s | how |")
    print("|---|---|---|---|---|")
    for rows, claimers, cpu, claim, how in cpu_table(cpu_sizes, args.max_cpu_s):
        print(f"| {rows:,} | {claimers:,} | {cpu:.3f} | {claim:.3f} | {how} |")
    sys.stdout.flush()
    return 0


if __name__ == "__main__":
    sys.exit(main())
