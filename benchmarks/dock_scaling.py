"""Scaling model: an iteration's sample flow through the dock, the dock with locality and a centralized driver, K = 16 … 1,024 nodes.

The flow of one GRPO iteration (``benchmarks/dock.py``'s four stages and five columns: rollout reads the prompts and
writes responses and their log-probs, reward and reference read the responses and write a score and reference
log-probs, the actor reads all five) between a driver node and K worker nodes, each running every stage and, for the
dock, one shard; every node's link carries R bytes/s in each direction. Per side, from the bytes each link and each
process carries (``link_bytes``) and the measured costs of a claim and of the controller (``Costs``):

* **centralized**: the driver scatters each stage's input and gathers its output, stage after stage, so its link's
  two directions take turns: ``φc·(in + out)/R``, or the driver process's serialization ``(in + out)/G`` if slower;
  plus ``2·stages·K`` calls per iteration, made concurrently, on the driver's core (``call_cpu_s`` each).
* **dock** (no locality): rows spread over the K shards, a claim takes rows wherever they are, so ``(K−1)/K`` of the
  stage payload SP crosses a link, evenly ``SP·(K−1)/K²`` per node and direction. Today's schedule (measured: the
  timeline of ``dock_network.py``) runs in three parts one after the other: the **fill**, the driver putting the
  prompts P shard after shard (``φc·P/R``; the stages work on the few rows already in); the **middle**, the stage
  traffic spread over the nodes' links (``φd·SP·(K−1)/(K²·R)``, or the shard process's ``SP/(K·G)``); the **drain**,
  the last claim of the actor (``claim_rows`` rows, all five columns) read over one link pair; plus the controller
  (claims per shard × ``claim_cpu_s``) and the driver's calls to every shard: the prompts' put one shard after
  the other (``K·rpc_s``), the others at once (``(fanouts − 1)·K·call_cpu_s``; ``--serial-calls``: one after the
  other, as the dock client did before).
* **dock + locality**: each node's stages claim from its own shard, so only the prompts cross links: the fill, then
  the **steal**: when the last shard's prompts land every other node is idle, and where that shard holds more than
  one claim of rows for a stage, an idle node's stage steals one (the shard's own stage, waiting longest, takes the
  first), so one claim of every stage crosses into that node (``φd·claim_rows·Σ reads/R``); then the last node's
  rows through its own shard's process (``SP/(K·G)``), plus the controller and fan-outs.

φc and φd (bytes on the wire over Arrow buffer bytes: Ethernet, TCP, gRPC) are the bridge counters of
``dock_network.py`` over the payload; G, a process's Arrow Flight throughput, is measured here (``--measure-g``,
one loopback ``do_get`` stream) or given. Not modelled: the stages' compute (the dock overlaps the flow with it, the
centralized driver does not: its flow adds to every iteration), the actor → rollout weight broadcast (the same for
all three; none with the hybrid actor). docs/dock.md ("The scaling model") states the assumptions; docs/benchmarks.md
the measured points.

Run::

    python benchmarks/dock_scaling.py                  # the table at K = 16 … 1,024, 100 Gbit/s, 7B-shaped workload
    python benchmarks/dock_scaling.py --measure-g      # G measured on this machine instead of --process-gbyte-s
    python benchmarks/dock_scaling.py --measure-calls  # the driver's cost of a call to every shard, measured here
"""

from __future__ import annotations

import argparse
import math
import secrets
import statistics
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))  # dock.py, beside this file
import dock as flow  # noqa: E402 - after the path

SIDES = ("centralized", "dock", "dock+locality")


@dataclass(frozen=True)
class Workload:
    """One iteration's rows: ``prompts`` × ``samples`` rows, prompts and responses of these many tokens (4 bytes each)."""

    prompts: int
    samples: int
    prompt_tokens: int
    response_tokens: int
    claim_rows: int

    @property
    def rows(self) -> int:
        return self.prompts * self.samples

    def column_bytes(self) -> dict[str, float]:
        """Arrow bytes per row of each column: a ``list<int32|float32>`` is 4 bytes a token and a 4-byte offset."""
        p, t = 4 * self.prompt_tokens + 4, 4 * self.response_tokens + 4
        return {"prompt_ids": p, "response_ids": t, "rollout_log_prob": t, "rm_score": 4, "ref_log_prob": t}

    def per_row(self, stage: str, what: str) -> float:
        """Bytes per row ``stage`` reads (``what='reads'``) or writes."""
        cols = (flow.READS if what == "reads" else flow.WRITES)[stage]
        return sum(self.column_bytes()[c] for c in cols)

    def totals(self) -> tuple[float, float, float]:
        """(stage inputs IN, stage outputs OUT, prompts P) of the iteration, bytes."""
        n = self.rows
        return (n * sum(self.per_row(s, "reads") for s in flow.STAGES), n * sum(self.per_row(s, "writes") for s in flow.STAGES),
                n * self.column_bytes()["prompt_ids"])


@dataclass(frozen=True)
class Costs:
    """Measured constants (docs/benchmarks.md; the defaults' sources in ``parse_args``' help)."""

    phi_central: float
    phi_dock: float
    process_bytes_s: float
    claim_cpu_s: float
    rpc_s: float
    call_cpu_s: float
    fanouts: int
    serial: bool


@dataclass
class Prediction:
    """One side at one K: seconds, the parts they add up from, and the busiest link's bytes."""

    seconds: float
    parts: dict[str, float]
    busiest_bytes: float


def predict(side: str, w: Workload, k: int, rate: float, c: Costs) -> Prediction:
    """Seconds of one iteration's flow of ``side`` over ``k`` worker nodes with links of ``rate`` bytes/s each way.

    Raises:
        ValueError: an unknown side, or ``k`` < 1.
    """
    if k < 1:
        raise ValueError(f"k={k}: expected >= 1 worker nodes")
    inputs, outputs, prompts = w.totals()
    payload = inputs + outputs
    claims_per_shard = sum(math.ceil(w.rows / w.claim_rows) for _ in flow.STAGES) / k
    # the prompts' put goes shard after shard (their rows arrive early on the first shards); open, stats and close go
    # to every shard at once (DockClient), or one after the other as before it (--serial-calls)
    control = claims_per_shard * c.claim_cpu_s + k * c.rpc_s + (c.fanouts - 1) * k * (c.rpc_s if c.serial else c.call_cpu_s)
    fill = max(c.phi_central * prompts / rate, prompts / c.process_bytes_s)
    if side == "centralized":
        parts = {"link": c.phi_central * payload / rate, "process": payload / c.process_bytes_s,
                 "calls": 2 * len(flow.STAGES) * k * c.call_cpu_s}
        return Prediction(max(parts["link"], parts["process"]) + parts["calls"], parts, c.phi_central * inputs)
    if side == "dock":
        spread = payload * (k - 1) / k / k
        actor_row = w.per_row("actor", "reads")
        parts = {"fill": fill, "middle": max(c.phi_dock * spread / rate, payload / k / c.process_bytes_s),
                 "drain": c.phi_dock * min(w.claim_rows, w.rows) * actor_row / rate if k > 1 else 0.0, "control": control}
        busiest = max(c.phi_central * prompts, c.phi_dock * (spread + prompts / k))
        return Prediction(sum(parts.values()), parts, busiest)
    if side == "dock+locality":
        # the last shard's prompts land at the end of the fill, when every other node is idle: its own stages take one
        # claim each first (the oldest waiters), an idle node's stages steal the next (one claim of every stage)
        stolen = w.claim_rows * sum(w.per_row(s, "reads") for s in flow.STAGES) if k > 1 and w.rows / k > w.claim_rows else 0.0
        parts = {"fill": fill, "steal": c.phi_dock * stolen / rate, "middle": payload / k / c.process_bytes_s, "control": control}
        return Prediction(sum(parts.values()), parts, max(c.phi_central * prompts, c.phi_dock * (stolen + prompts / k)))
    raise ValueError(f"side {side!r}: expected one of {SIDES}")


def measure_process_bytes_s(mbytes: int = 256) -> float:
    """One loopback Arrow Flight ``do_get`` stream of ``mbytes`` MB of ``list<int32>`` cells between this process and a
    server thread: bytes/s (the best of three)."""
    import numpy as np
    import pyarrow as pa
    import pyarrow.flight as flight

    values = np.arange(mbytes * 2**20 // 4, dtype=np.int32)
    table = pa.table({"cells": pa.ListArray.from_arrays(np.arange(0, len(values) + 1, 1024, dtype=np.int32), values)})

    class Server(flight.FlightServerBase):
        def do_get(self, context, ticket):  # noqa: ANN001 - pyarrow's signature
            return flight.RecordBatchStream(table)

    server = Server("grpc://127.0.0.1:0")
    thread = threading.Thread(target=server.serve, daemon=True)
    thread.start()
    try:
        client = flight.connect(f"grpc://127.0.0.1:{server.port}")
        best = math.inf
        for _ in range(3):
            start = time.perf_counter()
            got = client.do_get(flight.Ticket(b"x")).read_all()
            best = min(best, time.perf_counter() - start)
        if got.nbytes != table.nbytes:
            raise RuntimeError(f"the stream brought {got.nbytes} bytes, sent {table.nbytes}")
        return table.nbytes / best
    finally:
        server.shutdown()


def measure_call_us(shards: int = 32, repeats: int = 10) -> float:
    """µs per shard of ``DockClient.stats`` (one call to every shard, at once) over ``shards`` Arrow Flight shard servers
    of this process (median of ``repeats``): what a call the driver makes to every shard costs it."""
    from dockrl.dock.client.dock_client import DockClient
    from dockrl.dock.flight.shards import start_local_shards
    from dockrl.dock.schema import GRPO_SCHEMA

    token = secrets.token_hex(16)
    servers, locations = start_local_shards(shards, GRPO_SCHEMA, token)
    try:
        with DockClient(locations, GRPO_SCHEMA, token=token, timeout_s=60) as dock:
            dock.stats()  # connections and the thread pool made
            times = []
            for _ in range(repeats):
                start = time.perf_counter()
                dock.stats()
                times.append(time.perf_counter() - start)
        return statistics.median(times) / shards * 1e6
    finally:
        for server in servers:
            server.close()


# dock_network.py at R = 1 Mbit/s: seconds per side, docs/benchmarks.md ("The dock over an emulated network": the two
# K = 2, 4, 8 runs, the K = 8 runs after them, and "The scaling model": the K = 2, 4 run of 30f02b1, the last entry
# of K = 2, 4; the K = 8 runs of 516cfd0, the last four of K = 8, the dock's without its run with the prompts in rounds)
MEASURED = {
    2: {"centralized": [85.2, 87.4, 84.80], "dock": [50.8, 40.7, 41.27], "dock+locality": [17.2, 18.2, 17.68]},
    4: {"centralized": [84.2, 83.1, 102.81], "dock": [35.2, 40.3, 39.70], "dock+locality": [17.2, 18.9, 24.15]},
    8: {"centralized": [80.2, 97.5, 94.65, 83.99, 95.03, 81.14, 96.05, 81.40, 84.70, 81.60, 81.43],
        "dock": [34.3, 25.8, 28.12, 26.79, 34.79, 29.35, 27.77, 30.19, 29.07],
        "dock+locality": [12.5, 10.1, 9.40, 9.22, 9.24, 9.20, 9.21, 9.24, 9.62, 9.24, 9.62]},
}
# the same runs' busiest link direction, MB (bridge port counters)
MEASURED_MB = {
    2: {"centralized": [7.60, 7.601], "dock": [4.86, 3.731], "dock+locality": [1.51, 1.510]},
    4: {"centralized": [7.65, 7.646], "dock": [3.07, 2.951], "dock+locality": [1.29, 1.299]},
    8: {"centralized": [7.86, 7.66, 7.68, 7.655, 7.689, 7.652, 7.642], "dock": [2.13, 2.00, 2.09, 2.634, 2.212],
        "dock+locality": [1.10, 1.11, 1.10, 1.101, 1.105, 1.101, 1.104]},
}
EMULATED = Workload(prompts=64, samples=8, prompt_tokens=512, response_tokens=512, claim_rows=64)
"""``dock_network.py``'s defaults: 512 rows in groups of 8, 512 + ~512 tokens, 64 rows per claim."""


def check_table(c: Costs, measured: dict[int, dict[str, list[float]]], measured_mb: dict[int, dict[str, list[float]]]) -> str:
    """The model's predictions for ``dock_network.py`` at R = 1 Mbit/s beside the measured seconds and busiest link (medians)."""
    rows = []
    for k, sides in sorted(measured.items()):
        for side in SIDES:
            got, got_mb = statistics.median(sides[side]), statistics.median(measured_mb[k][side])
            pred = predict(side, EMULATED, k, 1e6 / 8, c)
            rows.append([str(k), side, f"{pred.seconds:.1f}", ", ".join(f"{x:g}" for x in sides[side]), f"{got:g}",
                         f"{pred.seconds / got - 1:+.0%}", "yes" if abs(pred.seconds / got - 1) <= 0.25 else "no",
                         f"{pred.busiest_bytes / 1e6:.2f}", f"{got_mb:.2f}"])
    return flow.render(["K", "side", "model s", "measured s", "median", "model / median - 1", "within 25%",
                        "model busiest MB", "measured busiest MB"], rows)


def scale_table(w: Workload, nodes: list[int], rate: float, c: Costs) -> str:
    rows = []
    for k in nodes:
        preds = {side: predict(side, w, k, rate, c) for side in SIDES}
        central = preds["centralized"].seconds
        cells = [str(k)]
        for side in SIDES:
            p = preds[side]
            top = max(p.parts, key=lambda name: p.parts[name])
            cells += [f"{p.seconds:.3f}", f"{central / p.seconds:.1f}x", f"{p.busiest_bytes / 1e9:.3f}", top]
        rows.append(cells)
    heads = ["K"]
    for side in SIDES:
        heads += [f"{side} s", "vs central", "busiest link GB", "largest part"]
    return flow.render(heads, rows)


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python benchmarks/dock_scaling.py", description=__doc__.split("\n\n")[0])
    p.add_argument("--nodes", type=lambda s: [int(x) for x in s.split(",")], default=[16, 32, 64, 128, 256, 512, 1024])
    p.add_argument("--link-gbit", type=float, default=100.0, help="each node's link, Gbit/s each way")
    p.add_argument("--prompts", type=int, default=512)
    p.add_argument("--samples", type=int, default=16, help="responses per prompt (the group)")
    p.add_argument("--prompt-tokens", type=int, default=2048)
    p.add_argument("--response-tokens", type=int, default=8192)
    p.add_argument("--claim-rows", type=int, default=16, help="rows per claim (a group)")
    p.add_argument("--phi-central", type=float, default=1.04,
                   help="wire bytes / Arrow bytes, one stream (dock_network.py K = 8: driver up 7.66 MB for 7.35 MB)")
    p.add_argument("--phi-dock", type=float, default=1.2,
                   help="the same, the dock's many flows per link (K = 8: 1.51-1.57 MB per node for 1.26 MB)")
    p.add_argument("--process-gbyte-s", type=float, default=1.0,
                   help="G, GB/s one process moves through Arrow Flight (--measure-g measures it here)")
    p.add_argument("--measure-g", action="store_true", help="measure G: one loopback do_get stream of 256 MB")
    p.add_argument("--claim-cpu-us", type=float, default=37.0,
                   help="shard CPU per claim, µs (dock_claims.py (b): 34-37 µs up to 1,024 claimers and 131,072 rows)")
    p.add_argument("--rpc-us", type=float, default=1000.0,
                   help="one call of the driver to a shard or worker, µs: the driver makes them one after the other "
                        "(DockClient.open_iteration loops over the shards) (dock_claims.py (a): a claim cycle, one round "
                        "trip with both ends' Python, 1.04 ms)")
    p.add_argument("--call-cpu-us", type=float, default=500.0,
                   help="the driver's CPU per call it makes to many shards or workers at once (the dock's open, stats, "
                        "close; the centralized scatter and gather), µs (--measure-calls here: 415-575 over four runs)")
    p.add_argument("--serial-calls", action="store_true",
                   help="the dock driver's open, stats and close one shard after the other (the dock client before "
                        "ClientCore.each), not at once")
    p.add_argument("--measure-calls", action="store_true",
                   help="measure --call-cpu-us: DockClient.stats over 32 Flight shards of this process, per shard")
    p.add_argument("--fanouts", type=int, default=4, help="driver calls per shard per iteration (open, prompts put, stats, close)")
    a = p.parse_args(argv)
    if min(a.nodes) < 1 or a.link_gbit <= 0 or min(a.prompts, a.samples, a.prompt_tokens, a.response_tokens, a.claim_rows) < 1:
        p.error("--nodes, --link-gbit and the workload's sizes must be positive")
    return a


def main(argv: list[str] | None = None) -> int:
    a = parse_args(argv)
    g = measure_process_bytes_s() if a.measure_g else a.process_gbyte_s * 1e9
    call_cpu = measure_call_us() if a.measure_calls else a.call_cpu_us
    costs = Costs(a.phi_central, a.phi_dock, g, a.claim_cpu_us * 1e-6, a.rpc_us * 1e-6, call_cpu * 1e-6, a.fanouts,
                  a.serial_calls)
    w = Workload(a.prompts, a.samples, a.prompt_tokens, a.response_tokens, a.claim_rows)
    inputs, outputs, prompts = w.totals()
    rate = a.link_gbit * 1e9 / 8
    calls = "one after the other" if a.serial_calls else f"open, stats, close at once: {call_cpu:.0f} µs of CPU each"
    groups = w.prompts
    print(f"# scaling model: {w.rows:,} rows ({w.prompts} prompts x {w.samples}), {w.prompt_tokens} + {w.response_tokens} "
          f"tokens; stage payload {(inputs + outputs) / 1e9:.2f} GB per iteration (prompts {prompts / 1e9:.3f} GB); "
          f"{w.claim_rows} rows per claim; links {a.link_gbit:g} Gbit/s each way; G = {g / 1e9:.2f} GB/s per process"
          f"{' (measured here)' if a.measure_g else ''}; phi {a.phi_central:g} / {a.phi_dock:g}; claim {a.claim_cpu_us:g} µs, "
          f"driver call {a.rpc_us:g} µs ({calls})")
    print("# the flow of one iteration (no compute, no weight broadcast): seconds, speed vs the centralized driver, the "
          "busiest link's bytes, the part that dominates")
    print(scale_table(w, a.nodes, rate, costs))
    for side in SIDES:
        preds = {k: predict(side, w, k, rate, costs) for k in a.nodes}
        best = min(preds, key=lambda k: preds[k].seconds)
        parts = ", ".join(f"{name} {sec:.3f} s" for name, sec in preds[best].parts.items())
        print(f"# {side}: fastest at K = {best} ({preds[best].seconds:.3f} s: {parts}); beyond it the parts that grow "
              f"with K (the driver's calls to every node) outweigh those that shrink")
    print(f"\n# beyond K = {groups} nodes a whole-group claim ({w.samples} rows) leaves nodes without rows of a stage "
          f"({groups} groups per iteration): no side gets faster")
    print("\n## the model against dock_network.py (R = 1 Mbit/s, 512 rows, 512 + ~512 tokens, 64 rows per claim; measured "
          "seconds from docs/benchmarks.md)")
    print(check_table(costs, MEASURED, MEASURED_MB))
    return 0


if __name__ == "__main__":
    sys.exit(main())
