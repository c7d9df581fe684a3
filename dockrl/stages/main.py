"""Entry point of one stage process of a distributed run (``dock.mode=distributed``).

    DOCKRL_DOCK_TOKEN_ROLLOUT=... dockrl worker --stage rollout --config RUN/config.yaml \\
        --dock grpc://127.0.0.1:5001,grpc://127.0.0.1:5002 --weight-sync 127.0.0.1:29500

(its stage's own token, ``dockrl.process.env.stage_token_env``; a shard started with one token
for everything takes ``DOCKRL_DOCK_TOKEN``.)

(``python -m dockrl.stages.main`` is the same.) The driver's process runner
(``dockrl/launch/distributed.py``) starts one per stage process of the run
(``dockrl.stages.table.stage_processes``), with the run's config as YAML in the environment
variable ``CONFIG_ENV``: a stage pod cannot read the launcher's files. Each process body lives
next to its stage loop (its row's ``process`` in ``dockrl.stages.table.STAGES``): it builds its engine, serves the driver's iterations until
``finish()`` and reports through the dock (``dockrl.stages.loop.Report``). The stages share nothing
but the dock, and the actor → rollout weight channel. With ``run.resume`` (a checkpoint folder)
the rollout and actor load their weights from it, the actor its optimizer, the critic both from its ``critic/``.
"""

from __future__ import annotations

import argparse
import logging
import os
import sys

import torch

from dockrl.config import load_config, load_config_text, resolve_auto
from dockrl.dock import GRPO_SCHEMA
from dockrl.dock.client.dock_client import DockClient
from dockrl.dock.tls import DockTLS
from dockrl.dock.warehouse.stores import make_warehouse
from dockrl.engines.factory import process_ranks
from dockrl.process.env import CONFIG_ENV, REPLICA_ENV, TOKEN_ENV, local_rank, pod_index, replica, stage_token_env
from dockrl.process.lifeline import driver_pid_from_env, watch_driver
from dockrl.run.driver_lease import shard_lease_quiet, wait_for_shards
from dockrl.run.setup import seed_everything
from dockrl.stages.table import STAGES, load, stage

logger = logging.getLogger(__name__)


def local_shard(spec: str, shards: int) -> int:
    """The shard ``--local-shard spec`` names: ``S``, or ``S+pod`` = S + this process's pod index in its group
    (``REPLICA_ENV``, which ``dockrl node`` leaves to its rank processes: the pod's).

    Raises:
        ValueError: ``spec`` not of that form, the pod index unset or not an integer, or the shard not in ``[0, shards)``.
    """
    base, plus, what = spec.partition("+")
    pod = pod_index() if plus else "0"
    if not base.isdigit() or (plus and what != "pod") or not pod.isdigit():
        raise ValueError(f"--local-shard {spec!r} with {REPLICA_ENV}={pod!r}: expected S or S+pod (S an integer >= 0, "
                         f"{REPLICA_ENV} the pod's index, set by the worker backend)")
    shard = int(base) + int(pod)
    if shard >= shards:
        raise ValueError(f"--local-shard {spec!r}: shard {shard} (pod {pod}), but --dock names {shards} shard(s)")
    return shard


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="dockrl worker", description="Run one GRPO stage against a dock.")
    parser.add_argument("--stage", required=True, choices=[row.name for row in STAGES if row.process])
    source = parser.add_mutually_exclusive_group(required=True)
    source.add_argument("--config", help="the run's config.yaml")
    source.add_argument("--config-env", metavar="NAME", help=f"environment variable holding the run's config as YAML (e.g. {CONFIG_ENV})")
    parser.add_argument("--dock", required=True, help="comma-separated grpc://host:port of every dock shard, in shard order")
    parser.add_argument("--run", default="run", help="the run's name: lease owner ids and the warehouse objects' root")
    parser.add_argument("--weight-sync", default="", help="host:port of the launcher's TCPStore: the weight channel's "
                        "(rollout and actor) or the hybrid actor ranks' rendezvous")
    near = parser.add_mutually_exclusive_group()
    near.add_argument("--local-shard-of-replica", action="store_true",
                      help="this member shares its machine with dock shard (replica index mod shards): its claims take "
                      "from that shard first (the DockClient's local_shard)")
    near.add_argument("--local-shard", metavar="S[+pod]",
                      help="dock shard S runs beside this member (dock.placement=beside), or with +pod shard S + the index "
                      f"of this member's pod in its group ({REPLICA_ENV}: a shard beside every pod): its claims take from "
                      "that shard first")
    parser.add_argument("--first-wait-s", type=float, default=None,
                        help="longest wait for the dock shards to answer and for the first iteration, seconds (default "
                        "dock.timeout_s); the launcher adds the time of the rollout's evaluation before training, which "
                        "the other stages wait through, and how far apart the run's pods may start")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, stream=sys.stderr, format=f"%(asctime)s {args.stage} %(levelname)s %(name)s: %(message)s")
    # stop with the driver at once when it is our parent (local backend), armed before anything that waits
    watch_driver(driver_pid=driver_pid_from_env(), what=f"{args.stage} worker")
    row = stage(args.stage)
    if row.weight_sync and not args.weight_sync:
        parser.error(f"--stage {args.stage} needs --weight-sync host:port")

    if args.config_env:
        text = os.environ.get(args.config_env)
        if not text:
            parser.error(f"--config-env {args.config_env}: the environment variable is unset or empty; the launcher sets it")
        cfg = load_config_text(text, f"environment variable {args.config_env}")
    else:
        cfg = load_config(args.config)
    cfg = resolve_auto(cfg)  # here, where the stage runs: the launcher's config travels with auto unresolved
    if cfg.run.num_threads:
        torch.set_num_threads(cfg.run.num_threads)
    seed_everything(cfg.trainer.seed)
    token = os.environ.get(stage_token_env(args.stage)) or os.environ.get(TOKEN_ENV) or None  # its own, else a shard's one token
    try:
        tls = DockTLS.from_env(os.environ, "client")  # the run's certificates, when its shards serve over TLS
    except ValueError as e:
        parser.error(str(e))
    locations = [loc for loc in args.dock.split(",") if loc]
    near_shard: int | None = None  # the shard on this member's node or pod: its claims take from it first
    if args.local_shard:
        try:
            near_shard = local_shard(args.local_shard, len(locations))
        except ValueError as e:
            parser.error(str(e))
    # a run's groups start at once: a shard's pod may come up after this one
    wait_for_shards(locations, token, args.first_wait_s or cfg.dock.timeout_s, tls=tls)
    # and with any backend once its lease on the dock goes quiet
    watch_driver(driver_pid=None, lease_quiet=shard_lease_quiet(locations[0], token, tls=tls), timeout_s=cfg.run.driver_timeout_s,
                 what=f"{args.stage} worker")
    index, size = replica()  # read here once: every stage gets its ranks from this process's ranks object
    ranks = process_ranks(cfg, trains=row.trains, replica=index, replicas=size, store_address=args.weight_sync,
                          local_rank=local_rank())
    owner = f"{args.run}/{args.stage}" + (f"-{ranks.replica}" if ranks.replicas > 1 else "")  # members of a group of several differ
    if args.local_shard_of_replica:
        near_shard = index % len(locations)
    if near_shard is not None:
        logger.info("local dock shard %d of %d: %s", near_shard, len(locations), locations[near_shard])
    with DockClient(locations, GRPO_SCHEMA, token=token, tls=tls, timeout_s=cfg.dock.timeout_s, warehouse=make_warehouse(cfg.dock, args.run),
                    lease_s=cfg.dock.lease_s, owner=owner, prefetch=cfg.dock.prefetch, local_shard=near_shard) as dock:
        load(row.process)(cfg, dock, ranks, args.weight_sync, args.first_wait_s)
    return 0


if __name__ == "__main__":
    sys.exit(main())
