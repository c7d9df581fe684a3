"""Sample-flow benchmark over an emulated network: the dock against a centralized driver where links are the limit.

``benchmarks/dock.py`` runs the two topologies on one machine's loopback, where a process's
bytes cost CPU only and the centralized driver's one link costs nothing. This benchmark runs
the same workload and the same two sides (``dock.py``'s ``Cells``, ``StageServer``,
``Centralized`` and ``dock_stage``; real ``python -m dockrl.dock.flight.shards`` shard processes and
``DockClient``) on emulated nodes:

* one Linux network namespace per node, a driver node and K worker nodes, each joined to a
  bridge (in a namespace of its own) by a veth pair; every link is limited to the same rate R in
  both directions (``tc qdisc ... tbf`` on both ends of the pair: full duplex, no added delay);
* each worker node runs one dock shard and one worker process; the worker serves the
  centralized driver's calls for any stage (a ``StageServer``) and, for the dock, runs the four
  stages as four threads over one ``DockClient``;
* **centralized**: the driver node's process scatters each stage's input to the K workers and
  gathers their outputs, stage after stage (``Centralized``): every payload byte crosses the
  driver's one link;
* **dock**: the driver node opens the iteration and puts the prompts; the workers claim rows
  from the shards and put their columns back, all stages at once; **dock+locality** gives each
  worker's client its own node's shard as ``local_shard`` (claims take from it first, steal
  from the others only what it lacks).

Reported per K (medians of ``--repeats``): seconds of each side, the dock/centralized speed,
each side's own link bound (the bytes of the busiest link direction in that run, read from the
bridge ports' counters, Ethernet framing included, / R) with time / bound, and CPU seconds per
core (user + system time of every process of the benchmark / the cores it may use); then every link's bytes at the
largest K and, per dock side, the bound its bytes would give were they spread evenly over the nodes' links (what no
schedule of those bytes beats). R defaults
to the largest rate at which every side's link-bound time is >= ``--margin`` x its CPU time per
core, both measured in the unshaped control; runs at R/2 at the largest K check that the time
doubles. The unshaped control (the same namespaces, veth links at memory speed) is the
CPU-bound regime of ``benchmarks/dock.py`` and is printed, labelled, beside the shaped runs.

Needs root (CAP_NET_ADMIN), ``ip`` and ``tc`` with the ``tbf`` qdisc. Where that is not
permitted it prints ``# skipped: <reason>`` and exits 0 having measured nothing. It creates only
namespaces named ``dkn<pid>-*`` (at most ``MAX_NODES`` + 2; links live inside them) and deletes
them, and ends every process in them, on exit, on an error, on Ctrl-C and on SIGTERM.

Run (as root; pin it to cores to keep other work off the measurement)::

    python benchmarks/dock_network.py                       # K = 2, 4, 8; 512 rows; R chosen from the control
    python benchmarks/dock_network.py --nodes 8 --rate-mbit 4
    python benchmarks/dock_network.py --nodes 8 --rate-mbit 1 --sides dock --timeline   # one side, each link's use per second
    python benchmarks/dock_network.py --quick               # K = 2, 64 rows, seconds (the test suite's)
"""

from __future__ import annotations

import argparse
import ctypes
import json
import math
import multiprocessing as mp
import os
import secrets
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import traceback
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from multiprocessing.connection import Connection
from pathlib import Path
from typing import IO

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))  # dock.py, beside this file, also when imported by the tests
import dock as flow  # noqa: E402 - after the path

from dockrl.dock.client.dock_client import DockClient  # noqa: E402
from dockrl.dock.schema import GRPO_SCHEMA  # noqa: E402
from dockrl.dock.shard.layout import shard_ranges  # noqa: E402

MAX_NODES = 16
"""Most worker nodes (namespaces) one run creates."""
SUBNET = "10.88.0."
"""The emulated nodes' addresses: node i (0 the driver, k+1 worker k) has ``10.88.0.<i+1>``."""
CLONE_NEWNET = 0x40000000
NOTSENT_LOWAT = 16_384
"""``net.ipv4.tcp_notsent_lowat`` of every node namespace, bytes."""
SIDES = ("centralized", "dock", "dock+locality")


# --- the emulated network ----------------------------------------------------------------------------


def _run(*cmd: str) -> str:
    """Run ``cmd`` and return its stdout; ``RuntimeError`` with its stderr when it fails."""
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=60)
    if proc.returncode:
        raise RuntimeError(f"`{' '.join(cmd)}` failed with exit code {proc.returncode}: {proc.stderr.strip()}")
    return proc.stdout


def enter_netns(name: str) -> None:
    """Move the calling thread (call it before any other thread or socket exists) into namespace ``name``.

    Raises:
        OSError: ``setns`` refused (not permitted, or no such namespace).
    """
    libc = ctypes.CDLL(None, use_errno=True)
    fd = os.open(f"/var/run/netns/{name}", os.O_RDONLY)
    try:
        if libc.setns(fd, CLONE_NEWNET) != 0:
            errno = ctypes.get_errno()
            raise OSError(errno, f"setns into network namespace {name}: {os.strerror(errno)}")
    finally:
        os.close(fd)


def not_permitted() -> str | None:
    """Why this machine cannot run the benchmark (no ``ip``/``tc``, not permitted, no ``tbf``), or None."""
    if sys.platform != "linux":
        return f"network namespaces need Linux; this is {sys.platform}"
    missing = [tool for tool in ("ip", "tc") if shutil.which(tool) is None]
    if missing:
        return f"{' and '.join(missing)} not found (iproute2)"
    probe = Network(f"dkn{os.getpid()}p", 0)
    try:
        probe.create()
        probe.shape(8e6)
    except (RuntimeError, OSError) as e:
        return f"cannot create a network namespace with a tbf-shaped veth link here (needs root / CAP_NET_ADMIN): {e}"
    finally:
        probe.destroy()
    return None


class Network:
    """A bridge namespace ``<prefix>-sw`` and node namespaces ``<prefix>-d`` (driver), ``<prefix>-n<k>``.

    Node i's ``eth0`` (address ``10.88.0.<i+1>``) is one end of a veth pair whose other end,
    port ``p<i>``, is on the bridge. ``shape(rate)`` puts a ``tbf`` qdisc of that rate on both
    ends (egress of each: node to bridge, bridge to node).

    Raises:
        ValueError: more than ``MAX_NODES`` worker nodes.
    """

    def __init__(self, prefix: str, workers: int) -> None:
        if not 0 <= workers <= MAX_NODES:
            raise ValueError(f"--nodes: {workers} worker nodes; expected 1 .. {MAX_NODES}")
        self.switch = f"{prefix}-sw"
        self.nodes = [f"{prefix}-d"] + [f"{prefix}-n{k}" for k in range(workers)]
        self.created: list[str] = []
        self.rate_bit: float | None = None  # the links' rate now (shape); None: unshaped

    @staticmethod
    def address(node: int) -> str:
        """The address of node ``node`` (0 the driver, k + 1 worker node k)."""
        return f"{SUBNET}{node + 1}"

    def create(self) -> None:
        for ns in [self.switch, *self.nodes]:
            _run("ip", "netns", "add", ns)
            self.created.append(ns)
            _run("ip", "-n", ns, "link", "set", "lo", "up")
        _run("ip", "-n", self.switch, "link", "add", "br0", "type", "bridge")
        _run("ip", "-n", self.switch, "link", "set", "br0", "up")
        for i, ns in enumerate(self.nodes):
            # unsent bytes a socket may queue beyond what is in flight: without a cap a slow link's send buffers
            # hold seconds of data in front of gRPC's keepalive pings, which then time out and drop the channel
            _run("ip", "netns", "exec", ns, "sysctl", "-q", "-w", f"net.ipv4.tcp_notsent_lowat={NOTSENT_LOWAT}")
            _run("ip", "-n", self.switch, "link", "add", f"p{i}", "type", "veth", "peer", "name", "eth0", "netns", ns)
            _run("ip", "-n", self.switch, "link", "set", f"p{i}", "master", "br0", "up")
            _run("ip", "-n", ns, "addr", "add", f"{self.address(i)}/24", "dev", "eth0")
            _run("ip", "-n", ns, "link", "set", "eth0", "up")

    def shape(self, rate_bit: float | None) -> None:
        """Every link at ``rate_bit`` bit/s in each direction; None removes the limits (memory speed)."""
        self.rate_bit = rate_bit
        for i, ns in enumerate(self.nodes):
            for where, dev in ((ns, "eth0"), (self.switch, f"p{i}")):
                if rate_bit is None:
                    subprocess.run(["tc", "-n", where, "qdisc", "del", "dev", dev, "root"], capture_output=True, timeout=60)
                else:  # burst: >= one rate/HZ tick and a few full frames; 200 ms of queue
                    burst = max(16_384, int(rate_bit / 8 / 50))
                    _run("tc", "-n", where, "qdisc", "replace", "dev", dev, "root", "tbf", "rate", f"{int(rate_bit)}bit",
                         "burst", str(burst), "latency", "200ms")

    def counters(self) -> np.ndarray:
        """Bytes so far per node ``(nodes, 2)``: [:, 0] sent by the node (its uplink), [:, 1] sent to it (downlink)."""
        stats = {d["ifname"]: d["stats64"] for d in json.loads(_run("ip", "-n", self.switch, "-s", "-j", "link", "show"))}
        return np.array([[stats[f"p{i}"]["rx"]["bytes"], stats[f"p{i}"]["tx"]["bytes"]] for i in range(len(self.nodes))],
                        dtype=np.int64)

    def destroy(self) -> None:
        """End every process left in the namespaces (all started by this benchmark), then delete them (their links go too)."""
        for ns in reversed(self.created):
            pids = subprocess.run(["ip", "netns", "pids", ns], capture_output=True, text=True, timeout=60).stdout.split()
            for pid in pids:
                try:
                    os.kill(int(pid), signal.SIGKILL)
                except (ProcessLookupError, ValueError):
                    pass
            subprocess.run(["ip", "netns", "del", ns], capture_output=True, timeout=60)
        self.created.clear()


# --- the worker nodes ----------------------------------------------------------------------------------


@dataclass(frozen=True)
class NodeJob:
    """A dock iteration for one worker node: the job, and whether its client prefers the node's shard."""

    job: flow.Job
    locality: bool


def node_main(conn: Connection, netns: str, node: int, token: str, pool_values: int, seed: int) -> None:
    """Worker node ``node``: serves the centralized driver (any stage) and runs the four dock stages per job."""
    enter_netns(netns)
    cells = flow.Cells(pool_values, seed)
    server = flow.StageServer(cells, token, host=Network.address(node + 1))
    docks: dict[tuple, DockClient] = {}
    stages = ThreadPoolExecutor(len(flow.STAGES))
    conn.send(("ready", server.location))
    try:
        while (task := conn.recv()) is not None:
            try:
                job = task.job
                key = (job.locations, task.locality)
                if key not in docks:
                    docks[key] = DockClient(job.locations, GRPO_SCHEMA, token=token, timeout_s=job.timeout_s,
                                            local_shard=node if task.locality else None)
                futures = {s: stages.submit(flow.dock_stage, docks[key], s, job, cells) for s in flow.STAGES}
                conn.send(("done", {s: f.result() for s, f in futures.items()}))
            except Exception:  # noqa: BLE001 - reported to the driver, which fails the run with it
                conn.send(("error", traceback.format_exc()))
    except EOFError:
        pass  # the driver is gone
    finally:
        for dock in docks.values():
            dock.close()
        server.shutdown()


class NodePool(flow.ProcessPool):
    """One worker process per worker node, each in its node's namespace (``dock.ProcessPool``)."""

    def __init__(self, net: Network, workers: int, token: str, pool_values: int, timeout_s: float) -> None:
        targets = [(node_main, (net.nodes[k + 1], k, token, pool_values, k)) for k in range(workers)]
        super().__init__(targets, [f"worker node {k}" for k in range(workers)], timeout_s)
        self.locations = [loc for _, loc in self.collect("start")]


# --- measuring -----------------------------------------------------------------------------------------


def cpu_seconds(pids: list[int]) -> float:
    """User + system seconds used so far by the processes ``pids`` (all their threads); gone ones count 0."""
    total = 0
    for pid in pids:
        try:
            with open(f"/proc/{pid}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
        except OSError:
            continue
        total += int(fields[11]) + int(fields[12])  # utime, stime (fields 14 and 15 of proc(5))
    return total / os.sysconf("SC_CLK_TCK")


@dataclass
class Sample:
    """One measured iteration of one side: wall seconds, CPU seconds per core, bytes per link direction."""

    seconds: float
    cpu_per_core: float
    links: np.ndarray  # (nodes, 2) bytes: [:, 0] up, [:, 1] down

    def bottleneck(self) -> tuple[int, str]:
        """Bytes of the busiest link direction, and its name."""
        i, d = np.unravel_index(int(np.argmax(self.links)), self.links.shape)
        return int(self.links[i, d]), f"{'driver' if i == 0 else f'node {i - 1}'} {'up' if d == 0 else 'down'}"


def striped(ranges: list[tuple[int, int]], group_size: int, pieces: int) -> list[np.ndarray]:
    """The driver's prompt puts: ``pieces`` puts, the i-th holding the i-th of ``pieces`` runs of whole groups of every
    shard's rows ``ranges`` (each put goes to the shards one after the other), so every shard gets rows early; with 1,
    one put, shard after shard."""
    parts: list[list[np.ndarray]] = [[] for _ in range(pieces)]
    for start, stop in ranges:
        groups = (stop - start) // group_size
        for i in range(pieces):
            a, b = start + i * groups // pieces * group_size, start + (i + 1) * groups // pieces * group_size
            parts[i].append(np.arange(a, b))
    return [rows for rows in (np.concatenate(p) for p in parts) if len(rows)]


@dataclass
class Bench:
    """Everything the driver node's process measures with, for one run of the benchmark."""

    args: argparse.Namespace
    net: Network
    shard_locations: list[str]
    shard_pids: list[int]
    token: str
    shape: flow.Shape = field(init=False)

    def __post_init__(self) -> None:
        a = self.args
        self.shape = flow.Shape(a.rows, a.group_size, a.prompt_tokens, a.tokens)
        longest = 3 * a.tokens // 2 + 1
        self.cells = flow.Cells(a.rows * max(a.prompt_tokens, longest), seed=10_000)
        self.prompts = self.cells.prompts(self.shape)
        self.payload = flow.stage_payload(flow.full_table(self.cells, self.shape))
        k = max(a.nodes)
        largest_input = max(a.claim_rows, -(-a.rows // (a.group_size * min(a.nodes))) * a.group_size)
        self.pool = NodePool(self.net, k, self.token, largest_input * longest, a.timeout_s)
        self.central = {n: flow.Centralized({s: self.pool.locations[:n] for s in flow.STAGES}, self.token, a.timeout_s)
                        for n in a.nodes}
        self.docks = {n: DockClient(self.shard_locations[:n], GRPO_SCHEMA, token=self.token, timeout_s=a.timeout_s)
                      for n in a.nodes}
        self.iteration = 0
        self.pids = [os.getpid(), *self.pool.pids(), *self.shard_pids]

    def close(self) -> None:
        for c in self.central.values():
            c.close()
        for d in self.docks.values():
            d.close()
        self.pool.close()

    def dock(self, n: int, locality: bool) -> None:
        """One dock iteration over the first ``n`` nodes; checks every stage took every row."""
        self.iteration += 1
        job = flow.Job(self.iteration, tuple(self.shard_locations[:n]), self.shape, self.args.claim_rows, self.args.timeout_s)
        driver = self.docks[n]
        driver.open_iteration(job.iteration, self.shape.rows, self.shape.group_size)
        for conn in self.pool.conns[:n]:
            conn.send(NodeJob(job, locality))
        pieces = 1 if locality else self.args.prompt_pieces  # a local claim waits for its shard's rows: whole shards first
        for rows in striped(shard_ranges(self.shape.rows, self.shape.group_size, n), self.shape.group_size, pieces):
            driver.put(rows, {"prompt_ids": self.prompts.column("prompt_ids").take(rows)})
        done = self.pool.collect(f"dock iteration {job.iteration}", n)
        driver.close_iteration()
        for stage in flow.STAGES:
            rows = sum(d[1][stage][0] for d in done)
            if rows != self.shape.rows:
                raise RuntimeError(f"dock iteration {job.iteration}: stage {stage} took {rows} rows, expected {self.shape.rows}")

    def measure(self, side: str, n: int) -> Sample:
        before, cpu = self.net.counters(), cpu_seconds(self.pids)
        start = time.perf_counter()
        samples: list[tuple[float, np.ndarray]] = []  # (seconds since start, counters) each second, for --timeline
        stop, sampler, rate = threading.Event(), None, self.net.rate_bit

        def sample() -> None:
            while not stop.wait(1.0):
                samples.append((time.perf_counter() - start, self.net.counters()))

        if self.args.timeline and rate:
            sampler = threading.Thread(target=sample, daemon=True)
            sampler.start()
        if side == "centralized":
            self.central[n].run(self.prompts, self.shape)
        else:
            self.dock(n, locality=side == "dock+locality")
        seconds = time.perf_counter() - start
        if sampler is not None and rate:
            stop.set()
            sampler.join()
            print(timeline(f"{side}, K = {n}, R = {rate / 1e6:.4g} Mbit/s", before, samples, n, rate), file=sys.stderr, flush=True)
        cores = len(os.sched_getaffinity(0))
        used = max(cpu_seconds(self.pids) - cpu, 1 / os.sysconf("SC_CLK_TCK"))  # under one tick reads 0: count one (no 0 to divide by)
        return Sample(seconds, used / cores, self.net.counters() - before)


def timeline(what: str, before: np.ndarray, samples: list[tuple[float, np.ndarray]], n: int, rate_bit: float) -> str:
    """Each link direction's use, second by second (bytes in the second / R's bytes per second): where a run waits."""
    lines, prev, then = [f"# timeline of {what}: link use per second (1.00: busy at R), driver, then nodes 0 .. {n - 1}"], before, 0.0
    for t, counters in samples:
        use = (counters - prev)[: n + 1] / max(t - then, 1e-9) / (rate_bit / 8)
        lines.append(f"t={t:6.1f} s  up {' '.join(f'{x:.2f}' for x in use[:, 0])}  |  down {' '.join(f'{x:.2f}' for x in use[:, 1])}")
        prev, then = counters, t
    return "\n".join(lines)


def choose_rate(control: dict[tuple[str, int], list[Sample]], margin: float) -> float:
    """The largest rate, bit/s, at which every side's link-bound time is >= ``margin`` x its CPU time (control medians).

    The CPU time of a side is the larger of its CPU seconds per core and its unshaped wall
    seconds: on a machine other work also loads, the CPU work takes that long.
    """
    rates = []
    for runs in control.values():
        nbytes = statistics.median(r.bottleneck()[0] for r in runs)
        cpu = max(statistics.median(r.cpu_per_core for r in runs), statistics.median(r.seconds for r in runs))
        rates.append(8 * nbytes / (margin * cpu))
    rate = min(rates)
    nice = 10 ** np.floor(np.log10(rate))
    return float(np.floor(rate / nice * 4) / 4 * nice)  # rounded down to a quarter of its leading digit


def driver_main(conn: Connection, args: argparse.Namespace, prefix: str, shard_locations: list[str], shard_pids: list[int],
                token: str) -> None:
    """The driver node's process: runs every measurement and sends the report (or the error) to the parent."""
    net = Network(prefix, max(args.nodes))
    net.created = [net.switch, *net.nodes]  # created by the parent: counters and shaping only here
    enter_netns(net.nodes[0])
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # run the finally blocks: workers end too
    try:
        bench = Bench(args, net, shard_locations, shard_pids, token)
        try:
            conn.send(("report", run_all(bench)))
        finally:
            bench.close()
    except Exception:  # noqa: BLE001 - the parent prints it and fails
        conn.send(("error", traceback.format_exc()))


def run_all(bench: Bench) -> str:
    """The control, the shaped runs and the R/2 check, interleaved per round so that load changes hit every side alike."""
    a = bench.args
    started = time.perf_counter()
    control: dict[tuple[str, int], list[Sample]] = {}
    shaped: dict[tuple[str, int], list[Sample]] = {}
    bench.net.shape(None)
    for measured in [False] * a.warmup + [True] * a.repeats:
        for n in a.nodes:
            for side in a.sides:
                sample = bench.measure(side, n)
                if measured:
                    control.setdefault((side, n), []).append(sample)
    rate = a.rate_mbit * 1e6 if a.rate_mbit else choose_rate(control, a.margin)
    bench.net.shape(rate)
    for _ in range(a.repeats):
        for n in a.nodes:
            for side in a.sides:
                shaped.setdefault((side, n), []).append(bench.measure(side, n))
    top = max(a.nodes)
    halved: dict[str, Sample | str] = {}
    if not a.no_halving:
        bench.net.shape(rate / 2)
        for side in a.sides:
            try:
                halved[side] = bench.measure(side, top)
            except Exception as e:  # noqa: BLE001 - reported in the table: the runs at R stand
                halved[side] = f"failed: {type(e).__name__}: {str(e).splitlines()[0][:120]}"
    bench.net.shape(None)
    return report(bench, rate, control, shaped, halved, time.perf_counter() - started)


# --- the report --------------------------------------------------------------------------------------


def report(bench: Bench, rate: float, control: dict, shaped: dict, halved: dict[str, Sample | str], wall_s: float) -> str:
    a, shape = bench.args, bench.shape
    med = statistics.median
    byte_rate = rate / 8
    prompt_bytes = bench.prompts.nbytes
    out = [
        f"# dock over an emulated network: {shape.rows:,} rows in groups of {shape.group_size}, prompts {shape.prompt_tokens} "
        f"tokens, responses ~{shape.tokens} tokens; stage payload {bench.payload / 1e6:.3g} MB per iteration "
        f"(prompts {prompt_bytes / 1e6:.3g} MB); {a.claim_rows} rows per dock claim; the dock's driver puts the prompts "
        f"{'shard after shard' if a.prompt_pieces == 1 else f'in {a.prompt_pieces} rounds over the shards (not with locality)'}",
        f"# nodes: one driver and K workers (network namespaces, veth pairs on a bridge), every link tbf-limited to "
        f"R = {rate / 1e6:.4g} Mbit/s each way; each worker node runs one dock shard and one worker process (four stage "
        "threads for the dock); stage compute is not run",
        f"# machine: {len(os.sched_getaffinity(0))} core(s) usable by the benchmark (every process shares them), "
        f"load average {os.getloadavg()[0]:.1f} at the end; medians of {a.repeats} iterations (after {a.warmup} "
        f"unmeasured); benchmark wall time {wall_s:.0f} s",
        "# link bound: bytes of the run's busiest link direction (bridge port counters, Ethernet framing and gRPC "
        "included) / R; CPU/core: user+system seconds of all benchmark processes / usable cores",
    ]
    def central_s(results: dict, n: int) -> float:  # nan without the centralized side: its ratios print as "-"
        return med(r.seconds for r in results[("centralized", n)]) if ("centralized", n) in results else float("nan")

    def ratio(x: float) -> str:
        return f"{x:.2f}x" if math.isfinite(x) else "-"

    rows = []
    for n in a.nodes:
        central, ctrl_central = central_s(shaped, n), central_s(control, n)
        for side in a.sides:
            runs = shaped[(side, n)]
            sec = med(r.seconds for r in runs)
            nbytes = med(r.bottleneck()[0] for r in runs)
            bound = nbytes / byte_rate
            link = runs[len(runs) // 2].bottleneck()[1]
            ctrl = med(r.seconds for r in control[(side, n)])
            cpu = med(r.cpu_per_core for r in control[(side, n)])
            rows.append([str(n), side, f"{sec:.2f}", ratio(central / sec), f"{nbytes / 1e6:.3f}", link, f"{bound:.2f}",
                         f"{sec / bound:.2f}", f"{bound / cpu:.1f}", f"{ctrl:.3f}", ratio(ctrl_central / ctrl)])
    out += ["", f"## shaped links (R = {rate / 1e6:.4g} Mbit/s) and the unshaped control (CPU-bound, as benchmarks/dock.py)",
            flow.render(["K", "side", "seconds", "speed vs central", "bottleneck MB", "busiest link", "link bound s",
                         "time / bound", "bound / CPU per core", "control s (unshaped)", "control speed vs central"], rows)]
    if halved:
        top = max(a.nodes)
        hrows = []
        for side in a.sides:
            at_r, half = med(r.seconds for r in shaped[(side, top)]), halved[side]
            hrows.append([side, f"{at_r:.2f}", half if isinstance(half, str) else f"{half.seconds:.2f}",
                          "-" if isinstance(half, str) else f"{half.seconds / at_r:.2f}"])
        out += ["", f"## halving R at K = {top}: R = {rate / 1e6:.4g} against {rate / 2e6:.4g} Mbit/s (one iteration each)",
                flow.render(["side", "seconds at R", "seconds at R/2", "ratio (2 when link-bound)"], hrows)]
    top = max(a.nodes)
    central = central_s(shaped, top)
    out += ["", f"## bytes per link direction at K = {top}, MB (the median run of each side; node i: worker node i)",
            flow.render(["side", "direction", "driver", *(f"node {i}" for i in range(top)), "mean of nodes"],
                        [[side, d, *(f"{b / 1e6:.2f}" for b in run.links[: top + 1, j]), f"{run.links[1: top + 1, j].mean() / 1e6:.2f}"]
                         for side in a.sides
                         for run in [sorted(shaped[(side, top)], key=lambda r: r.seconds)[len(shaped[(side, top)]) // 2]]
                         for j, d in enumerate(("up", "down"))])]
    out += ["", f"## targets at K = {top} (links the limit)"]
    for side in (s for s in ("dock", "dock+locality") if s in a.sides):
        runs = shaped[(side, top)]
        sec = med(r.seconds for r in runs)
        bound = med(r.bottleneck()[0] for r in runs) / byte_rate
        speed = (f"{central / sec:.2f}x the centralized driver (target >= 8x: {'met' if central / sec >= 8 else 'not met'})"
                 if math.isfinite(central) else "no centralized side run")
        out.append(f"- {side}: {speed}; {sec / bound:.2f}x its own link bound (target <= 1.2x: {'met' if sec / bound <= 1.2 else 'not met'})")
        # the bound were every node's busier direction as loaded as the mean one: what no schedule of these bytes beats
        even = med(max(r.links[1: top + 1, 0].mean(), r.links[1: top + 1, 1].mean(), r.links[0].max()) for r in runs) / byte_rate
        cap = f": at most {central / even:.2f}x the centralized driver, whatever the schedule" if math.isfinite(central) else ""
        out.append(f"  its bytes evenly spread over the nodes' links would bound it at {even:.2f} s{cap}")
    low = min(med(b) for b in ([r.bottleneck()[0] / byte_rate / r.cpu_per_core for r in shaped[k]] for k in shaped))
    out.append(f"- link-bound time / CPU time per core, lowest over sides and K (shaped runs): {low:.1f} "
               f"(wanted >= {a.margin:g})")
    return "\n".join(out)


# --- entry point ---------------------------------------------------------------------------------------


def start_shards(net: Network, n: int, token: str, timeout_s: float, log: IO[str]) -> tuple[list[subprocess.Popen], list[str]]:
    """One dock shard process in each of the first ``n`` worker nodes' namespaces; their locations in shard order.

    Raises:
        TimeoutError: a shard printed no location within ``timeout_s``.
        RuntimeError: a shard exited before printing its location.
    """
    env = {**os.environ, flow.TOKEN_ENV: token}
    procs = []
    for k in range(n):
        cmd = ["ip", "netns", "exec", net.nodes[k + 1], sys.executable, "-m", "dockrl.dock.flight.shards", "--host",
               net.address(k + 1), "--port", "0", "--token-env", flow.TOKEN_ENV, "--timeout-s", str(timeout_s)]
        procs.append(subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=log, text=True))
    return procs, flow.shard_locations(procs, timeout_s, log)


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python benchmarks/dock_network.py", description=__doc__.split("\n\n")[0])
    p.add_argument("--quick", action="store_true", help="K = 2, 64 short rows, one repeat, 2 Mbit/s: seconds (the tests)")
    p.add_argument("--nodes", type=lambda s: [int(x) for x in s.split(",")], default=[2, 4, 8], help="worker node counts K")
    p.add_argument("--rows", type=int, default=512, help="rows per iteration")
    p.add_argument("--group-size", type=int, default=8, help="rows per prompt group")
    p.add_argument("--prompt-tokens", type=int, default=512, help="tokens per prompt")
    p.add_argument("--tokens", type=int, default=512, help="mean response tokens")
    p.add_argument("--claim-rows", type=int, default=64, help="rows per dock claim (a multiple of --group-size)")
    p.add_argument("--rate-mbit", type=float, default=0.0, help="link rate R, Mbit/s; 0: chosen from the control with --margin")
    p.add_argument("--margin", type=float, default=3.0, help="link-bound time / CPU time per core the chosen R gives at least")
    p.add_argument("--repeats", type=int, default=2, help="measured iterations per side and K (median reported)")
    p.add_argument("--warmup", type=int, default=1, help="unmeasured unshaped iterations first")
    p.add_argument("--no-halving", action="store_true", help="skip the runs at R/2")
    p.add_argument("--timeline", action="store_true", help="print each shaped run's link use second by second (stderr)")
    p.add_argument("--sides", type=lambda s: s.split(","), default=list(SIDES),
                   help=f"sides to run, of {','.join(SIDES)} (without centralized no speed ratio is printed)")
    p.add_argument("--prompt-pieces", type=int, default=1,
                   help="the dock's driver (without locality) puts its prompts in this many rounds over the shards (1: shard "
                        "after shard)")
    p.add_argument("--timeout-s", type=float, default=600.0, help="limit of every wait (claims, calls, start-up), seconds")
    a = p.parse_args(argv)
    if a.quick:
        a.nodes, a.rows, a.group_size, a.prompt_tokens, a.tokens, a.claim_rows = [2], 64, 4, 16, 32, 8
        a.repeats, a.warmup, a.rate_mbit, a.timeout_s = 1, 0, a.rate_mbit or 2.0, 60.0
    for name in ("rows", "group_size", "prompt_tokens", "tokens", "claim_rows", "repeats", "prompt_pieces"):
        if getattr(a, name) < 1:
            p.error(f"--{name.replace('_', '-')}: got {getattr(a, name)}; must be >= 1")
    if a.rows % a.group_size or a.claim_rows % a.group_size:
        p.error(f"--rows {a.rows} and --claim-rows {a.claim_rows} must be multiples of --group-size {a.group_size}")
    if not a.nodes or not all(1 <= n <= MAX_NODES for n in a.nodes):
        p.error(f"--nodes: got {a.nodes}; expected worker node counts in 1 .. {MAX_NODES}, e.g. 2,4,8")
    if not a.sides or set(a.sides) - set(SIDES):
        p.error(f"--sides: got {','.join(a.sides)}; expected some of {','.join(SIDES)}")
    a.sides = [s for s in SIDES if s in a.sides]
    if a.rate_mbit < 0 or a.margin <= 0 or a.warmup < 0:
        p.error("--rate-mbit must be >= 0, --margin > 0, --warmup >= 0")
    return a


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    reason = not_permitted()
    if reason:
        print(f"# skipped: {reason}")
        return 0
    prefix, token = f"dkn{os.getpid()}", secrets.token_hex(16)
    net = Network(prefix, max(args.nodes))
    shards: list[subprocess.Popen] = []
    driver = None

    def stop(signum: int, _frame: object) -> None:
        raise SystemExit(128 + signum)  # unwinds into the finally below

    previous = {s: signal.signal(s, stop) for s in (signal.SIGTERM, signal.SIGINT)}
    log = tempfile.NamedTemporaryFile("w", prefix="dock-network-", suffix=".log", delete=False)
    try:
        net.create()
        shards, locations = start_shards(net, max(args.nodes), token, args.timeout_s, log)
        ctx = mp.get_context("forkserver")
        ctx.set_forkserver_preload(["numpy", "pyarrow.flight", "dockrl.dock.client.dock_client"])
        parent, child = ctx.Pipe()
        driver = ctx.Process(target=driver_main, args=(child, args, prefix, locations, [p.pid for p in shards], token))
        driver.start()
        child.close()
        try:
            while not parent.poll(1.0):  # the driver node's waits have their own timeouts; this one ends if it dies
                if not driver.is_alive() and not parent.poll(0):
                    raise EOFError
            kind, text = parent.recv()
        except EOFError:
            raise RuntimeError(f"the driver node's process exited with code {driver.exitcode} (shard log: {log.name})") from None
        if kind == "error":
            raise RuntimeError(f"the benchmark failed in the driver node's process (shard log: {log.name}):\n{text}")
        print(text)
    finally:
        if driver is not None and driver.is_alive():
            driver.terminate()
            driver.join(15)
        for proc in shards:
            proc.terminate()
        for proc in shards:
            try:
                proc.wait(10)
            except subprocess.TimeoutExpired:
                proc.kill()
        net.destroy()  # also ends whatever is left in the namespaces
        log.close()
        for s, handler in previous.items():
            signal.signal(s, handler)
    os.unlink(log.name)
    return 0


if __name__ == "__main__":
    sys.exit(main())
