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
that the ranks lie as the layout expects (docs/kubeflow.md).
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys

from dockrl.parallel.layout import ParallelLayout
from dockrl.process.env import NODE_PROCS_ENV, local_rank, replica

logger = logging.getLogger(__name__)

RDZV_PORT = 29400
"""Port of the node launchers' rendezvous on pod 0 of a group (torchrun's customary port)."""


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


def ranks_main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="dockrl ranks", description="print this process's rank, device and coordinates in a "
                                     "parallel layout, as one JSON line (run it under dockrl node to check a node)")
    parser.add_argument("layout", nargs="*", metavar="parallel.FIELD=VALUE", help="the layout: parallel.tp, pp, dp, infer_tp, device")
    args = parser.parse_args(argv)
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
    coords, infer = layout.train_coords(rank), layout.infer_coords(rank)
    report = json.dumps({"rank": rank, "world_size": world, "local_rank": index, "host": os.uname().nodename,
                         "device": str(devices.process_device(kind, index)), "tp_rank": coords.tp_rank, "dp_rank": coords.dp_rank,
                         "pp_rank": coords.pp_rank, "infer_tp_rank": infer.tp_rank, "infer_dp_rank": infer.dp_rank})
    # one write of the line and its newline: a pod's rank processes share its stdout, and print's two writes
    # (the text, then the newline) interleave there when stdout is unbuffered (PYTHONUNBUFFERED)
    sys.stdout.write(report + "\n")
    sys.stdout.flush()
    return 0


if __name__ == "__main__":
    sys.exit(main())
