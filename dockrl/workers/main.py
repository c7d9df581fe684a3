"""Entry point of one stage process of a distributed run (``dock.mode=distributed``).

    DOCKRL_DOCK_TOKEN=... dockrl worker --stage rollout --config RUN/config.yaml \\
        --dock grpc://127.0.0.1:5001,grpc://127.0.0.1:5002 --weight-sync 127.0.0.1:29500

(``python -m dockrl.workers.main`` is the same.) The launcher (``dockrl/launch/distributed.py``)
starts one per stage, with the run's config as YAML in the environment variable ``CONFIG_ENV``
(``--config-env DOCKRL_CONFIG_YAML``): a stage pod cannot read the launcher's files. Each builds its engine,
then loops until the driver calls ``finish()``: ``wait_iteration`` → the stage worker's
``run_iteration(dock)`` (the same classes as in-process) → ``report(iteration, stage, metrics)``.
The stages share nothing but the dock, and the actor → rollout weight channel:

* ``rollout``   evaluates greedily before training (the launcher starts the other stages
  once it reported), generates, and after each iteration waits for the actor's report,
  receives its weights and reports ``weight_sync``; evaluates again after training.
* ``reward``    scores the responses and computes the group advantages.
* ``reference`` log-probs under the frozen initial policy (only when β > 0).
* ``actor``     updates, sends its weights, writes the checkpoints (weights and optimizer,
  then reports ``checkpoint``; the driver adds the dock snapshot, ``dockrl.resume``).

With ``run.resume`` (a checkpoint folder; the driver resolves ``latest``) the rollout and actor
load their weights from it, the actor its optimizer, and the rollout skips the evaluation before
training. Every stage reseeds its generators per iteration (``dockrl.resume.seed_iteration``).
* ``hybrid``    (``trainer.hybrid``) rollout and actor in one process on the same devices:
  generates with vLLM, reports ``rollout``, updates with megatron-core, syncs by the
  allgather–swap, reports ``actor`` (``dockrl/workers/hybrid.py``); no weight channel.

Besides the iterations, stages report the pseudo-iterations ``BEFORE_TRAINING`` (the rollout's
evaluation) and ``AFTER_TRAINING`` (every stage once its loop ended: the rollout's evaluation,
the actor after the final checkpoint).
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
import time
from pathlib import Path
from typing import Callable

import torch

from dockrl.config import Config, load_config, load_config_text
from dockrl.resume import (
    CHECKPOINT_STAGE, checkpoint_dir, checkpoint_due, final_dir, load_optimizer, prepare_checkpoint, save_optimizer, seed_iteration,
    weights_path,
)

logger = logging.getLogger(__name__)

STAGES = ("rollout", "reward", "reference", "actor", "hybrid")
WEIGHT_SYNC = "weight_sync"
"""Report the rollout process makes once it holds the weights of an iteration's update."""
BEFORE_TRAINING = -1
"""Pseudo-iteration of the evaluation before training."""
AFTER_TRAINING = -2
"""Pseudo-iteration of the final reports (evaluation after training, final checkpoint)."""
TOKEN_ENV = "DOCKRL_DOCK_TOKEN"
"""Environment variable with the dock shards' bearer token."""
CONFIG_ENV = "DOCKRL_CONFIG_YAML"
"""Environment variable with the run's fully resolved config (YAML) for ``--config-env``."""
ROLLOUT_RANK, ACTOR_RANK = 1, 0


def stage_processes(cfg: Config) -> list[str]:
    """The stage processes of a run, the one that evaluates first: ``hybrid`` (rollout and actor
    in one, ``trainer.hybrid``) or ``rollout`` … ``actor``; ``reference`` only when β > 0."""
    reference = ["reference"] if cfg.algorithm.kl_coef > 0 else []
    if cfg.trainer.hybrid:
        return ["hybrid", "reward", *reference]
    return ["rollout", "reward", *reference, "actor"]


def replica() -> tuple[int, int]:
    """This member's index in its group and the group's size (``DOCKRL_REPLICA``, ``DOCKRL_REPLICAS``,
    set by every worker backend; 0 and 1 when unset).

    Raises:
        ValueError: the variables are not integers with 0 <= index < size.
    """
    raw = os.environ.get("DOCKRL_REPLICA", "0"), os.environ.get("DOCKRL_REPLICAS", "1")
    try:
        index, size = int(raw[0]), int(raw[1])
    except ValueError:
        index = size = -1
    if not 0 <= index < size:
        raise ValueError(f"DOCKRL_REPLICA={raw[0]!r}, DOCKRL_REPLICAS={raw[1]!r}: expected integers with 0 <= index < size")
    return index, size


def replica_suffix() -> str:
    """``-<index>`` for the members of a group of several (their lease owner ids differ), else ''."""
    index, size = replica()
    return f"-{index}" if size > 1 else ""


def serve_iterations(
    dock, stage: str, step: Callable[[int], dict[str, float]], *, timeout_s: float,
    after_report: Callable[[int], None] | None = None, seed: int | None = None, report: bool = True,
    first_timeout_s: float | None = None,
) -> int:
    """Run ``step(iteration)`` for every iteration the driver opens and report its metrics.

    ``after_report(iteration)`` runs after the report (weight sync, checkpoints). With ``seed``
    the generators are reseeded from ``(seed, iteration)`` before each step. With ``report``
    false the metrics are dropped (ranks other than the first of a multi-rank stage). Returns
    the number of iterations served once the driver called ``finish()``. ``first_timeout_s``
    (default ``timeout_s``) bounds the wait for the first iteration: every stage starts at
    once, and the first opens only after the rollout's evaluation (``--first-wait-s``).

    Raises:
        DockTimeoutError: no iteration opened within ``timeout_s`` of the previous one.
    """
    last, served = BEFORE_TRAINING, 0
    while (it := dock.wait_iteration(last, first_timeout_s if served == 0 and first_timeout_s else timeout_s)) is not None:
        logger.info("%s: iteration %d", stage, it)
        if seed is not None:
            seed_iteration(seed, it)
        metrics = step(it)
        if report:
            dock.report(it, stage, metrics)
        if after_report is not None:
            after_report(it)
        last, served = it, served + 1
    logger.info("%s: finished after %d iterations", stage, served)
    return served


def run_rollout(cfg: Config, dock, weights: str) -> None:
    from dockrl.engines.factory import build_rollout_engine, engine_device, receive_params
    from dockrl.engines.layer_loader import WholeLayerLoader
    from dockrl.engines.weight_sync import WeightChannel
    from dockrl.trainer import build_scorer, evaluate, load_run_prompts, resolve_data, resolve_model
    from dockrl.workers.rollout import RolloutWorker

    model_path = resolve_model(cfg)
    train_file, test_file = resolve_data(cfg)
    engine = build_rollout_engine(cfg, weights_path(cfg, model_path))
    _, test_prompts = load_run_prompts(cfg, engine.tokenizer, train_file, test_file)
    scorer = build_scorer(cfg.algorithm)
    params = receive_params(engine, cfg, model_path)
    worker = RolloutWorker(engine, cfg.rollout)
    channel = None

    def sync(it: int) -> None:
        dock.wait_reports(it, ["actor"], cfg.dock.timeout_s)  # updated: its weights come next on the channel
        loader = WholeLayerLoader(engine.load_weights, getattr(engine, "layer_members", None))  # vLLM: whole layers
        metrics = channel.receive(params, loader)
        loader.finish()
        metrics["timing_s/weight_sync"] = metrics["weight_sync/seconds"]
        dock.report(it, WEIGHT_SYNC, metrics)

    try:
        # joined before the evaluation: the actor, started at the same time, waits for it meanwhile
        channel = WeightChannel(weights, rank=ROLLOUT_RANK, timeout_s=cfg.dock.timeout_s, device=engine_device(cfg))
        if cfg.trainer.eval_before and not cfg.run.resume:  # the driver opens the first iteration once this is reported
            dock.report(BEFORE_TRAINING, "rollout", evaluate(engine, test_prompts, scorer, cfg, "before"))
        serve_iterations(dock, "rollout", lambda it: worker.run_iteration(dock), timeout_s=cfg.dock.timeout_s, after_report=sync,
                         seed=cfg.trainer.seed)
        dock.report(AFTER_TRAINING, "rollout", evaluate(engine, test_prompts, scorer, cfg, "after") if cfg.trainer.eval_after else {})
    finally:
        scorer.close()
        if channel is not None:
            channel.close()


def run_reward(cfg: Config, dock, first_wait_s: float | None = None) -> None:
    from dockrl.engines.hf import load_tokenizer
    from dockrl.trainer import build_scorer, resolve_model
    from dockrl.workers.advantage import AdvantageWorker
    from dockrl.workers.reward import RewardWorker

    tokenizer = load_tokenizer(resolve_model(cfg), cfg.model.trust_remote_code)
    scorer = build_scorer(cfg.algorithm)
    workers = [RewardWorker.from_config(scorer, tokenizer, cfg.algorithm), AdvantageWorker(cfg.algorithm)]

    def step(_: int) -> dict[str, float]:
        metrics: dict[str, float] = {}
        for worker in workers:
            metrics |= worker.run_iteration(dock)
        return metrics

    try:
        serve_iterations(dock, "reward", step, timeout_s=cfg.dock.timeout_s, seed=cfg.trainer.seed, first_timeout_s=first_wait_s)
        dock.report(AFTER_TRAINING, "reward", {})
    finally:
        scorer.close()


def run_reference(cfg: Config, dock, first_wait_s: float | None = None) -> None:
    from dockrl.engines.factory import build_reference_engine
    from dockrl.trainer import resolve_model
    from dockrl.workers.reference import ReferenceWorker

    t = cfg.trainer
    engine = build_reference_engine(cfg, resolve_model(cfg))
    worker = ReferenceWorker(engine, temperature=cfg.rollout.temperature, micro_batch=t.micro_batch)
    serve_iterations(dock, "reference", lambda it: worker.run_iteration(dock), timeout_s=cfg.dock.timeout_s, seed=cfg.trainer.seed,
                     first_timeout_s=first_wait_s)
    dock.report(AFTER_TRAINING, "reference", {})


def run_actor(cfg: Config, dock, weights: str, first_wait_s: float | None = None) -> None:
    from dockrl.engines.factory import build_train_engine, engine_device
    from dockrl.engines.weight_sync import WeightChannel
    from dockrl.trainer import resolve_model
    from dockrl.workers.actor import ActorWorker

    t = cfg.trainer
    engine = build_train_engine(cfg, weights_path(cfg, resolve_model(cfg)))
    if cfg.run.resume:
        load_optimizer(engine, Path(cfg.run.resume))
    channel = WeightChannel(weights, rank=ACTOR_RANK, timeout_s=cfg.dock.timeout_s, device=engine_device(cfg))
    worker = ActorWorker(engine, trainer=t, algo=cfg.algorithm, rollout=cfg.rollout)
    run_dir = Path(cfg.run.output_dir)
    wire_dtype = getattr(torch, cfg.rollout.dtype)

    def after_update(it: int) -> None:
        sent = channel.send(engine.named_weights(), wire_dtype)
        logger.info("actor: sent %.1f MB of weights in %d buckets in %.2f s", sent["weight_sync/bytes"] / 1e6,
                    sent["weight_sync/buckets"], sent["weight_sync/seconds"])
        if checkpoint_due(t, it):  # the driver snapshots the dock once this is reported
            save_optimizer(engine, engine.save(prepare_checkpoint(checkpoint_dir(run_dir, it + 1))))
            dock.report(it, CHECKPOINT_STAGE, {})

    try:
        serve_iterations(dock, "actor", lambda it: worker.run_iteration(dock), timeout_s=cfg.dock.timeout_s,
                         after_report=after_update, seed=cfg.trainer.seed, first_timeout_s=first_wait_s)
        save_optimizer(engine, engine.save(prepare_checkpoint(final_dir(run_dir))))  # the driver completes it
        dock.report(AFTER_TRAINING, "actor", {})
    finally:
        channel.close()


def wait_for_dock(locations: list[str], token: str | None, timeout_s: float, every_s: float = 0.5) -> None:
    """Block until every dock shard answers: a run's groups start at once, and a shard's pod may
    come up after a stage's (a slower image pull, a node still being added).

    Raises:
        DockTimeoutError: shards that did not answer within ``timeout_s`` (named).
        pyarrow.flight.FlightError: a shard answered with an error (a wrong token).
    """
    import pyarrow.flight as flight

    from dockrl.dock.errors import DockTimeoutError

    options = flight.FlightCallOptions(headers=[(b"authorization", f"Bearer {token}".encode())] if token else [], timeout=2.0)
    deadline = time.monotonic() + timeout_s
    waiting = list(locations)
    while True:
        for location in list(waiting):
            client = flight.connect(location)
            try:
                list(client.list_actions(options))
                waiting.remove(location)
            except (flight.FlightUnavailableError, flight.FlightTimedOutError):
                pass
            finally:
                client.close()
        if not waiting:
            return
        if time.monotonic() > deadline:
            raise DockTimeoutError(f"dock shards {waiting} did not answer within {timeout_s:.0f} s (--first-wait-s, else "
                                   "dock.timeout_s): their pods did not start, or the run was torn down")
        time.sleep(every_s)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="dockrl worker", description="Run one GRPO stage against a dock.")
    parser.add_argument("--stage", required=True, choices=STAGES)
    source = parser.add_mutually_exclusive_group(required=True)
    source.add_argument("--config", help="the run's config.yaml")
    source.add_argument("--config-env", metavar="NAME", help=f"environment variable holding the run's config as YAML (e.g. {CONFIG_ENV})")
    parser.add_argument("--dock", required=True, help="comma-separated grpc://host:port of every dock shard, in shard order")
    parser.add_argument("--run", default="run", help="the run's name: lease owner ids and the warehouse objects' root")
    parser.add_argument("--weight-sync", default="", help="host:port of the launcher's TCPStore: the weight channel's "
                        "(rollout and actor) or the hybrid actor ranks' rendezvous")
    parser.add_argument("--first-wait-s", type=float, default=None,
                        help="longest wait for the dock shards to answer and for the first iteration, seconds (default "
                        "dock.timeout_s); the launcher adds the time of the rollout's evaluation before training, which "
                        "the other stages wait through, and how far apart the run's pods may start")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, stream=sys.stderr, format=f"%(asctime)s {args.stage} %(levelname)s %(name)s: %(message)s")
    if args.stage in ("rollout", "actor", "hybrid") and not args.weight_sync:
        parser.error(f"--stage {args.stage} needs --weight-sync host:port")

    from dockrl.dock import GRPO_SCHEMA
    from dockrl.dock.client import DockClient
    from dockrl.dock.warehouse import make_warehouse
    from dockrl.lifeline import driver_pid_from_env, shard_lease_quiet, watch_driver
    from dockrl.trainer import seed_everything

    if args.config_env:
        text = os.environ.get(args.config_env)
        if not text:
            parser.error(f"--config-env {args.config_env}: the environment variable is unset or empty; the launcher sets it")
        cfg = load_config_text(text, f"environment variable {args.config_env}")
    else:
        cfg = load_config(args.config)
    if cfg.run.num_threads:
        torch.set_num_threads(cfg.run.num_threads)
    seed_everything(cfg.trainer.seed)
    locations = [loc for loc in args.dock.split(",") if loc]
    wait_for_dock(locations, os.environ.get(TOKEN_ENV) or None, args.first_wait_s or cfg.dock.timeout_s)
    # stop with the driver: at once when it was our parent, else when its lease on the dock goes quiet
    watch_driver(driver_pid=driver_pid_from_env(), lease_quiet=shard_lease_quiet(locations[0], os.environ.get(TOKEN_ENV) or None),
                 timeout_s=cfg.run.driver_timeout_s, what=f"{args.stage} worker")
    warehouse = make_warehouse(cfg.dock, args.run)
    with DockClient(
        locations, GRPO_SCHEMA, token=os.environ.get(TOKEN_ENV) or None, timeout_s=cfg.dock.timeout_s,
        warehouse=warehouse, lease_s=cfg.dock.lease_s, owner=f"{args.run}/{args.stage}{replica_suffix()}",
    ) as dock:
        if args.stage == "rollout":
            run_rollout(cfg, dock, args.weight_sync)  # it evaluates itself first
        elif args.stage == "hybrid":
            from dockrl.workers.hybrid import run_hybrid

            run_hybrid(cfg, dock, args.weight_sync, first_wait_s=args.first_wait_s)
        elif args.stage == "reward":
            run_reward(cfg, dock, first_wait_s=args.first_wait_s)
        elif args.stage == "reference":
            run_reference(cfg, dock, first_wait_s=args.first_wait_s)
        else:
            run_actor(cfg, dock, args.weight_sync, first_wait_s=args.first_wait_s)
    return 0


if __name__ == "__main__":
    sys.exit(main())
