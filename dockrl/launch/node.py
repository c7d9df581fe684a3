"""``dockrl node``: one pod shaped like a node runs several rank processes of a worker group.

    DOCKRL_REPLICA=0 DOCKRL_REPLICAS=2 MASTER_ADDR=<pod 0 of the group> MASTER_PORT=29400 \\
        dockrl node --nproc-per-node 8 -- worker --stage hybrid --config-env DOCKRL_CONFIG_YAML ...

The Kubernetes worker backend places a group whose members hold devices as one pod per node
(``dockrl.launch.pod_spec.pod_shape``), and that pod's command is this one. It starts
``--nproc-per-node`` processes of the ``dockrl`` command line after ``--`` with torch's elastic
launcher (``torchrun``, as Kubeflow's PyTorchJob does). The launcher gives each process its
``LOCAL_RANK`` (its device on the node), ``RANK = node_rank × nproc_per_node + local_rank`` and
``WORLD_SIZE``; when one process fails it stops the others and exits non-zero, so the pod fails
and with it the run. The node's rank is the pod's index in its group (``DOCKRL_REPLICA``: the
Indexed Job's completion index), the node count ``DOCKRL_REPLICAS`` (the group's pods); the
launchers of the group's pods meet at pod 0 (``MASTER_ADDR``, ``MASTER_PORT``: its name in the
JobSet's DNS) and start their processes together.

The rank processes read their place from torchrun's variables (``dockrl.process.env.replica``,
``local_rank``) because this command marks them (``NODE_PROCS_ENV``); they still build their
process groups at the run launcher's ``TCPStore`` (``--weight-sync``), as a member in a pod of
its own does.

``dockrl ranks parallel.tp=2 parallel.dp=4`` prints, as one JSON line, where the process it runs
in sits in that layout: its rank, local rank, device and TP/DP/PP coordinates. Run as the command
of ``dockrl node`` on a cluster's nodes it shows, before a run, that every device is visible and
that the ranks lie as the layout expects (docs/kubeflow.md). With ``--all-reduce`` every rank
also joins one process group of the device's collective backend (HCCL, NCCL or gloo:
``dockrl.parallel.device.backend_for``) at torchrun's rendezvous, checks one all-reduce's sum and
times ``--iterations`` more of ``--size-mib`` MiB; its line gets the bandwidth (``all_reduce``).
Across pods (``dockrl smoke``) that is the first collective a run's pods try, before any run.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import json
import logging
import os
import sys
import time
from typing import Any

from dockrl.launch.platform import Platform, get_platform
from dockrl.parallel.layout import ParallelLayout
from dockrl.process.env import NODE_PROCS_ENV, RDZV_PORT, local_rank, replica

logger = logging.getLogger(__name__)


def torchrun_args(*, nproc: int, nnodes: int, node_rank: int, master_addr: str, master_port: int, timeout_s: int,
                  command: list[str]) -> list[str]:
    """torchrun's arguments for ``nproc`` processes of ``python -m dockrl <command>`` on node
    ``node_rank`` of ``nnodes``: a static rendezvous at ``master_addr:master_port`` that waits
    ``timeout_s`` seconds for every node, and no restarts (a restarted rank has lost its state)."""
    return [
        "--nnodes", str(nnodes), "--nproc-per-node", str(nproc), "--node-rank", str(node_rank),
        "--master-addr", master_addr, "--master-port", str(master_port), "--rdzv-backend", "static",
        "--rdzv-conf", f"timeout={timeout_s}", "--max-restarts", "0", "--module", "dockrl", *command,
    ]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="dockrl node", description=__doc__.split("\n\n")[0] if __doc__ else None)
    parser.add_argument("--nproc-per-node", type=int, required=True, help="rank processes of this pod (its devices)")
    parser.add_argument("--rdzv-timeout-s", type=int, default=1800,
                        help="longest wait for the group's other pods at the rendezvous, seconds (they may start minutes apart)")
    parser.add_argument("command", nargs=argparse.REMAINDER, help="-- then the dockrl command line of every process")
    args = parser.parse_args(argv)
    command = args.command[1:] if args.command[:1] == ["--"] else args.command
    if not command:
        parser.error("no command: give the dockrl command line of the rank processes after --, e.g. -- worker --stage hybrid ...")
    if args.nproc_per_node < 1 or args.rdzv_timeout_s < 1:
        parser.error(f"--nproc-per-node {args.nproc_per_node}, --rdzv-timeout-s {args.rdzv_timeout_s}: expected >= 1")
    try:
        node, nodes = replica()  # this pod's index among the group's pods
    except ValueError as err:
        parser.error(str(err))
    master = os.environ.get("MASTER_ADDR", "127.0.0.1" if nodes == 1 else "")
    if not master:
        parser.error(f"MASTER_ADDR is unset: the {nodes} pods of a group meet at pod 0 (the Kubernetes backend sets it)")
    port = int(os.environ.get("MASTER_PORT", RDZV_PORT))
    logging.basicConfig(level=logging.INFO, stream=sys.stderr, format="%(asctime)s node %(levelname)s %(name)s: %(message)s")
    logger.info("node %d of %d: %d rank processes (ranks %d-%d), rendezvous at %s:%d", node, nodes, args.nproc_per_node,
                node * args.nproc_per_node, (node + 1) * args.nproc_per_node - 1, master, port)
    os.environ[NODE_PROCS_ENV] = str(args.nproc_per_node)  # the processes take torchrun's RANK and LOCAL_RANK
    from torch.distributed.run import main as torchrun  # lazy: torch, after the arguments are checked

    try:
        torchrun(torchrun_args(nproc=args.nproc_per_node, nnodes=nodes, node_rank=node, master_addr=master, master_port=port,
                               timeout_s=args.rdzv_timeout_s, command=command))
    except Exception as err:  # ChildFailedError: torchrun printed the failed ranks' errors above; the pod fails
        failures = getattr(err, "failures", None) or {}
        codes = ", ".join(f"rank {r} exit code {f.exitcode}" for r, f in sorted(failures.items())) or f"{type(err).__name__}: {err}"
        logger.error("node %d: %s; the node's other rank processes were stopped", node, codes)
        return 1
    return 0


def all_reduce_bandwidth(kind: str, device: Any, *, rank: int, world: int, size_mib: float, iterations: int,
                         timeout_s: float) -> dict[str, Any]:
    """One all-reduce (sum) over every process of the run, checked, then ``iterations`` timed ones
    of ``size_mib`` MiB of fp32 on ``device``, with the device kind's collective backend (gloo,
    nccl, hccl) over torch's ``env://`` rendezvous (``MASTER_ADDR``, ``MASTER_PORT``: torchrun's; none for one process).

    Returns:
        ``backend``, ``bytes`` (one all-reduce's buffer), ``iterations``, ``seconds`` (one
        all-reduce, the slowest rank's mean), ``algbw_gbps`` = bytes / seconds and ``busbw_gbps`` =
        algbw × 2(n−1)/n, in GB/s (10⁹ bytes per second), as nccl-tests reports them (its
        doc/PERFORMANCE.md: the ring's traffic per rank, comparable across rank counts).

    Raises:
        RuntimeError: the checked all-reduce summed wrong (a broken transport).
        torch.distributed.DistBackendError: a rank did not join or the collective timed out
            after ``timeout_s`` (its message names the peer or the store).
    """
    import torch  # lazy: the node check's other modes need no process group
    import torch.distributed as dist

    from dockrl.parallel import device as devices

    backend = devices.backend_for(kind)
    store = dist.HashStore() if world == 1 else None  # a group of one needs no rendezvous
    dist.init_process_group(backend, store=store, rank=rank, world_size=world, timeout=datetime.timedelta(seconds=timeout_s))
    try:
        buf = torch.full((max(1, int(size_mib * 2**20) // 4),), float(rank + 1), dtype=torch.float32, device=device)
        dist.all_reduce(buf)  # the first one also connects the ranks: not timed
        devices.synchronize(buf.device)
        expected = world * (world + 1) / 2
        if not torch.all(buf == expected):
            raise RuntimeError(f"all-reduce over {backend}: rank {rank} got a sum other than {expected} (1 + ... + {world}); "
                               "the collective's transport corrupts data")
        buf.zero_()  # zeros stay zeros however often they are summed
        dist.barrier()
        start = time.perf_counter()
        for _ in range(iterations):
            dist.all_reduce(buf)
        devices.synchronize(buf.device)
        elapsed = torch.tensor([(time.perf_counter() - start) / iterations], dtype=torch.float32, device=device)
        dist.all_reduce(elapsed, op=dist.ReduceOp.MAX)  # the collective is as fast as its slowest rank
        seconds, size = float(elapsed.item()), buf.numel() * buf.element_size()
    finally:
        dist.destroy_process_group()
    algbw = size / seconds / 1e9
    return {"backend": backend, "bytes": size, "iterations": iterations, "seconds": seconds,
            "algbw_gbps": algbw, "busbw_gbps": algbw * 2 * (world - 1) / world}


def ranks_main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="dockrl ranks", description="print this process's rank, device and coordinates in a "
                                     "parallel layout, as one JSON line (run it under dockrl node to check a node); with "
                                     "--all-reduce, the bandwidth of an all-reduce over every process besides")
    parser.add_argument("layout", nargs="*", metavar="parallel.FIELD=VALUE", help="the layout: parallel.tp, pp, dp, infer_tp, device")
    parser.add_argument("--all-reduce", action="store_true",
                        help="join every process in one process group (hccl, nccl or gloo) and time an all-reduce")
    parser.add_argument("--size-mib", type=float, default=64.0, help="the all-reduce's buffer, MiB of fp32 (default 64)")
    parser.add_argument("--iterations", type=int, default=5, help="timed all-reduces after a first, checked one (default 5)")
    parser.add_argument("--timeout-s", type=float, default=600.0,
                        help="longest wait for the other ranks and for one collective, seconds (default 600)")
    args = parser.parse_args(argv)
    if args.size_mib <= 0 or args.iterations < 1 or args.timeout_s <= 0:
        parser.error(f"--size-mib {args.size_mib}, --iterations {args.iterations}, --timeout-s {args.timeout_s}: expected > 0")
    fields: dict[str, int | str] = {}
    for item in args.layout:
        key, sep, value = item.partition("=")
        name = key.removeprefix("parallel.")
        if not sep or name not in ("tp", "pp", "dp", "infer_tp", "device"):
            parser.error(f"{item!r}: expected parallel.FIELD=VALUE with FIELD one of tp, pp, dp, infer_tp, device")
        fields[name] = value if name == "device" else int(value) if value.isdigit() else value
    try:
        layout = ParallelLayout(**fields)  # type: ignore[arg-type]
        rank, world = replica()
    except ValueError as err:  # LayoutError names the field; replica() the variables
        parser.error(str(err))
    if world != layout.world_size:
        parser.error(f"{world} processes run, the layout has tp × pp × dp = {layout.world_size} ranks")
    from dockrl.parallel import device as devices  # lazy: imports torch, after the layout is checked

    kind = devices.resolve_kind(layout.device)
    local = local_rank()
    index = devices.local_rank_of(kind, rank) if local is None else local
    device = devices.process_device(kind, index)
    coords, infer = layout.train_coords(rank), layout.infer_coords(rank)
    report: dict[str, Any] = {
        "rank": rank, "world_size": world, "local_rank": index, "host": os.uname().nodename, "device": str(device),
        "tp_rank": coords.tp_rank, "dp_rank": coords.dp_rank, "pp_rank": coords.pp_rank,
        "infer_tp_rank": infer.tp_rank, "infer_dp_rank": infer.dp_rank,
    }
    if args.all_reduce:
        report["all_reduce"] = all_reduce_bandwidth(kind, device, rank=rank, world=world, size_mib=args.size_mib,
                                                    iterations=args.iterations, timeout_s=args.timeout_s)
    # one write of the line and its newline: a pod's rank processes share its stdout, and print's two writes
    # (the text, then the newline) interleave there when stdout is unbuffered (PYTHONUNBUFFERED)
    sys.stdout.write(json.dumps(report) + "\n")
    sys.stdout.flush()
    return 0


SMOKE_RUN_ID = "dockrl-smoke"
"""Run id (label ``dockrl.io/run``) of the JobSet ``dockrl smoke`` renders."""
SMOKE_DEADLINE_S = 3600
"""Longest the check's pods may live, seconds: a rendezvous that never completes does not hold nodes for a week."""
_DEVICE_KIND = {"npu": "npu", "gpu": "cuda", "cpu": "cpu"}


def smoke_objects(platform: Platform, *, pods: int, namespace: str, size_mib: float = 64.0, iterations: int = 5) -> list[dict[str, Any]]:
    """The objects of a collective check across ``pods`` pods, as a run's JobSet renders them
    (``jobset.render_jobset``: every hook of ``platform``, its scheduler, the shared volume): one
    replicated job ``smoke`` whose pods each hold a node's devices (one process on the cpu
    platform) and run ``dockrl ranks --all-reduce`` under ``dockrl node``, one process per device,
    all of them in one process group.

    Raises:
        ValueError: ``pods`` < 1, or what ``render_jobset`` refuses.
    """
    from dockrl.launch.backend import WorkerGroup  # lazy: only `dockrl smoke` renders a JobSet
    from dockrl.launch.jobset import member_host, render_jobset  # lazy: as WorkerGroup

    if pods < 1:
        raise ValueError(f"smoke check: pods={pods}; expected >= 1")
    per_pod = platform.devices_per_node or 1
    ranks = ("ranks", "--all-reduce", "--size-mib", str(size_mib), "--iterations", str(iterations),
             f"parallel.dp={pods * per_pod}", f"parallel.device={_DEVICE_KIND[platform.name]}")
    env: dict[str, str] = {}
    if platform.accelerator:  # pods of a node's devices: the pod spec starts them under `dockrl node` (above one device)
        command = ranks if per_pod > 1 else ("node", "--nproc-per-node", "1", "--", *ranks)
    else:  # a pod per process; the pod spec gives the rendezvous to pods with devices only
        command = ("node", "--nproc-per-node", "1", "--", *ranks)
        env = {"MASTER_ADDR": member_host(SMOKE_RUN_ID, "smoke", 0, namespace), "MASTER_PORT": str(RDZV_PORT)}
    group = WorkerGroup(name="smoke", command=command, replicas=pods * per_pod, devices=1 if platform.accelerator else 0,
                        colocate=per_pod, env=env)
    bounded = dataclasses.replace(platform, worker_deadline_s=min(platform.worker_deadline_s, SMOKE_DEADLINE_S))
    return render_jobset([group], run_id=SMOKE_RUN_ID, namespace=namespace, platform=bounded)


def smoke_main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="dockrl smoke", description="print (YAML) a JobSet of pods shaped like a run's that all-reduce over HCCL, NCCL "
        "or gloo across pods, each rank printing the bandwidth: kubectl apply -f it before the first run")
    parser.add_argument("--platform", choices=tuple(_DEVICE_KIND), default="npu", help="the preset (default: npu)")
    parser.add_argument("--platform-config", default="", metavar="FILE", help="this site's platform fields, as for pipeline compile")
    parser.add_argument("--pods", type=int, default=2, help="pods (nodes) of the check (default 2)")
    parser.add_argument("--namespace", required=True, help="the runs' namespace (the overlay's)")
    parser.add_argument("--size-mib", type=float, default=64.0, help="the all-reduce's buffer, MiB (default 64)")
    parser.add_argument("--iterations", type=int, default=5, help="timed all-reduces (default 5)")
    args = parser.parse_args(argv)
    import yaml  # lazy: this command only

    from dockrl.launch.platform_files import platform_from_file  # lazy: as yaml

    try:
        platform = get_platform(args.platform)
        if args.platform_config:
            platform = platform_from_file(platform, args.platform_config)
        objects = smoke_objects(platform, pods=args.pods, namespace=args.namespace, size_mib=args.size_mib,
                                iterations=args.iterations)
    except (ValueError, OSError) as err:
        parser.error(str(err))
    sys.stdout.write(yaml.safe_dump_all(objects, sort_keys=False))
    return 0


if __name__ == "__main__":
    sys.exit(main())
