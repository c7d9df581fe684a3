"""Distributed mode: every GRPO stage its own process, sharing only the sharded dock.

``train_distributed(cfg)`` is what ``dockrl train dock.mode=distributed`` runs. This process,
the driver, starts through a worker backend: a ``LocalBackend`` by default (processes on this
machine, logs in ``RUN/logs/<group>-0.log``), or a ``KubernetesBackend`` (one JobSet per
run; ``launcher.run_training(worker_backend="kubernetes")``). Every group starts at once:

1. ``dock.shards`` dock shards (``dockrl dock-shard``), each a group of its own on a port the
   backend gives, with a bearer token generated for the run and passed as a secret;
2. one group per stage (``dockrl worker``): rollout, reward (with the advantage step),
   reference (only when ``algorithm.kl_coef > 0``) and actor; rollout, reference and actor
   hold one device each (``member_devices``). Rollout and actor also meet on the weight
   channel, a gloo group whose ``TCPStore`` this process hosts. The rollout evaluates first;
   the others load their models meanwhile and wait for the first iteration
   (``first_wait_s``). With ``trainer.hybrid`` one ``hybrid`` group plays
   rollout and actor (no weight channel): ``parallel.tp × pp × dp`` members, one per actor rank, whose
   gloo group meets at this process's ``TCPStore`` instead.

Every address comes from the backend (``backend.address``, ``backend.launcher_host``) and the
config travels as YAML in an environment variable (``CONFIG_ENV``), so the same groups run as
local processes and as pods, which cannot read this process's files. Paths in the config
(model, data, run folder) must be ones the members see: any path for local processes, the
shared volume (``backend.shared_dir``) or the image for pods.

Then, per iteration (at most ``dock.max_inflight`` open at once), it opens the iteration, puts
its prompts, waits for the report of every stage and of the weight sync — in short slices,
checking the workers in between, so a dead worker fails the run within a second with
``WorkerFailed`` and its log tail — merges the metrics into the same ``metrics.jsonl``,
TensorBoard, progress bar and ``summary.json`` as the in-process mode, and closes it. After
the last one it calls ``finish()`` and collects the final reports (the evaluation after
training, the final checkpoint). Every process is torn down in ``finally``.
"""

from __future__ import annotations

import dataclasses
import logging
import math
import secrets
import signal
import threading
import time
from datetime import timedelta
from pathlib import Path
from typing import Callable, Sequence

import pyarrow.flight as flight
import torch.distributed as dist

from dockrl.config import Config, dump_config, save_config
from dockrl.dock import GRPO_SCHEMA, DockTimeoutError
from dockrl.dock.client import DockClient
from dockrl.dock.warehouse import make_warehouse
from dockrl.engines.hf import load_tokenizer
from dockrl.launch.backend import WorkerBackend, WorkerGroup
from dockrl.launch.local import LocalBackend, keep_earlier_logs
from dockrl.lifeline import DriverLease
from dockrl.metrics import MetricsWriter, Progress, plot_metrics
from dockrl.resume import (
    CHECKPOINT_STAGE, checkpoint_dir, checkpoint_due, final_dir, find_resume, prompts_fingerprint, write_final_state,
)
from dockrl.trainer import (
    add_iteration_metrics, load_run_prompts, open_with_prompts, prompt_batches, resolve_data, resolve_model, snapshot_for_checkpoint,
)
from dockrl.workers.main import AFTER_TRAINING, BEFORE_TRAINING, CONFIG_ENV, TOKEN_ENV, WEIGHT_SYNC, stage_processes

logger = logging.getLogger(__name__)

CHECK_EVERY_S = 0.5
"""Longest the driver waits for reports between two checks of the workers, seconds."""
ACCELERATOR_STAGES = ("rollout", "reference", "actor", "hybrid")
"""Stages that hold a model and take the platform's accelerators (reward and dock shards do not)."""


def iteration_stages(cfg: Config) -> list[str]:
    """Reports the driver waits for in each iteration, in the order their metrics are merged."""
    sync = [] if cfg.trainer.hybrid else [WEIGHT_SYNC]  # the hybrid actor syncs inside its "actor" report
    return ["rollout", "reward"] + (["reference"] if cfg.algorithm.kl_coef > 0 else []) + ["actor", *sync]


def shard_locations(backend: WorkerBackend, ports: Sequence[int]) -> list[str]:
    """``grpc://host:port`` of every dock shard (group ``dock-shard-<s>`` on ``ports[s]``), in shard order."""
    return [f"grpc://{backend.address(f'dock-shard-{s}', 0, port)}" for s, port in enumerate(ports)]


def member_devices(cfg: Config, stage: str) -> int:
    """Devices one member of ``stage`` holds: every stage process that holds a model is one rank
    of the layout with one device (docs/design.md §6); reward and dock shards compute on CPU.

    The layout sets how many such members there are: the hybrid actor is ``parallel.tp × pp ×
    dp`` members (``worker_groups``), so a run asks for that many devices for it, plus one each
    for the rollout, actor and reference processes of a non-hybrid run.
    """
    return 1 if stage in ACCELERATOR_STAGES else 0


def first_wait_s(cfg: Config, test_prompts: int) -> float:
    """Longest a stage waits for the first iteration once it runs, seconds: every stage starts at
    once, and the driver opens the first iteration after the rollout loaded its model
    (``dock.timeout_s``) and, on a fresh run with ``trainer.eval_before``, evaluated (one
    ``dock.timeout_s`` per rollout batch). The driver adds ``backend.start_spread_s``: pods of
    one run may start minutes apart."""
    evaluates = cfg.trainer.eval_before and not cfg.run.resume
    return cfg.dock.timeout_s * (2 + (eval_batches(cfg, test_prompts) if evaluates else 0))


def eval_batches(cfg: Config, test_prompts: int) -> int:
    """Rollout batches of an evaluation of ``test_prompts`` prompts; each may take ``dock.timeout_s``."""
    return math.ceil(test_prompts / cfg.rollout.batch_size)


def worker_groups(
    cfg: Config, backend: WorkerBackend, ports: Sequence[int], weight_address: str, token: str, run: str = "run",
    first_wait: float | None = None,
) -> list[WorkerGroup]:
    """The dock shard groups (one per shard, each serving on its port) and the stage groups of a run.

    Args:
        backend: gives the members' program, bind interface and addresses.
        ports: the shards' ports (``backend.serve_ports(dock.shards)``).
        weight_address: ``host:port`` of the launcher's ``TCPStore`` as the members reach it: the
            weight channel's rendezvous, or with ``trainer.hybrid`` that of the hybrid actor's
            ranks (one member each, ``parallel.tp × pp × dp``).
        token: the shards' bearer token; travels as a secret (``WorkerGroup.secret_env``,
            ``TOKEN_ENV``) only.
        run: the run's name (lease owners, the warehouse objects' root).
        first_wait: longest wait of the stages for the shards to answer and for the first
            iteration (``first_wait_s``; the rollout evaluates first and uses it for the shards
            only); None for ``dock.timeout_s``.

    The config travels as YAML in ``CONFIG_ENV``. With ``dock.warehouse`` other than
    ``memory`` the shards keep metadata only (``--payload store``) and every stage reads and
    writes the run's objects (named by ``run``) itself.
    """
    program = backend.program()
    payload = "memory" if cfg.dock.warehouse == "memory" else "store"
    shards = [
        WorkerGroup(name=f"dock-shard-{s}", secret_env={TOKEN_ENV: token}, port=port, command=(
            *program, "dock-shard", "--host", backend.bind_host, "--port", str(port),
            "--token-env", TOKEN_ENV, "--timeout-s", str(cfg.dock.timeout_s), "--lease-s", str(cfg.dock.lease_s),
            "--payload", payload, "--driver-timeout-s", str(cfg.run.driver_timeout_s),
        ))
        for s, port in enumerate(ports)
    ]
    dock = ",".join(shard_locations(backend, ports))
    stages = stage_processes(cfg)
    wait = ["--first-wait-s", f"{first_wait:g}"] if first_wait else []
    return shards + [
        # the config is portable: each stage resolves `auto` (device, dtypes) where it runs
        WorkerGroup(name=stage, env={CONFIG_ENV: dump_config(cfg, portable=True)}, secret_env={TOKEN_ENV: token}, devices=member_devices(cfg, stage),
                    replicas=cfg.parallel.world_size if stage == "hybrid" else 1, command=(
            *program, "worker", "--stage", stage, "--config-env", CONFIG_ENV,
            "--dock", dock, "--weight-sync", weight_address, "--run", run, *wait,
        ))
        for stage in stages
    ]


def wait_for_shards(locations: Sequence[str], token: str, backend: WorkerBackend, timeout_s: float) -> None:
    """Block until every shard answers; fail at once if a shard process died.

    A readiness probe (as a kubelet's): the shard listens only once its process has imported
    pyarrow, and gRPC offers no readiness event through pyarrow, so it asks every 0.1 s on a
    fresh connection (a failed channel would otherwise back off for seconds).

    Raises:
        WorkerFailed: a shard process exited.
        TimeoutError: a shard did not answer within ``timeout_s``.
    """
    options = flight.FlightCallOptions(headers=[(b"authorization", f"Bearer {token}".encode())], timeout=2.0)
    deadline = time.monotonic() + timeout_s
    for location in locations:
        while True:
            backend.check()
            client = flight.connect(location)
            try:
                list(client.list_actions(options))
                break
            except (flight.FlightUnavailableError, flight.FlightTimedOutError):
                if time.monotonic() > deadline:
                    raise TimeoutError(f"dock shard at {location} did not answer within {timeout_s:.0f} s") from None
                time.sleep(0.1)
            finally:
                client.close()


def wait_reports(
    dock: DockClient, backend: WorkerBackend, iteration: int, stages: Sequence[str], timeout_s: float, logs: str,
) -> dict[str, dict[str, float]]:
    """The reports of ``stages`` for ``iteration``, watching the workers while waiting.

    Waits in slices of ``CHECK_EVERY_S`` and calls ``backend.check()`` between them. Each
    stage may take ``timeout_s`` after the previous one reported.

    Raises:
        WorkerFailed: a worker died (its log tail is in the message), a dock shard too.
        DockTimeoutError: a stage did not report in time; names the stages missing.
        pyarrow.flight.FlightError: shard 0 is unreachable while its process runs.
    """
    reports: dict[str, dict[str, float]] = {}
    for stage in stages:
        deadline = time.monotonic() + timeout_s
        while stage not in reports:
            backend.check()
            try:
                reports |= dock.wait_reports(iteration, [stage], timeout_s=min(CHECK_EVERY_S, timeout_s))
            except DockTimeoutError:
                if time.monotonic() >= deadline:
                    missing = [s for s in stages if s not in reports]
                    raise DockTimeoutError(
                        f"iteration {iteration}: no report from {missing} within dock.timeout_s={timeout_s:.0f} s "
                        f"while their processes run; see their logs in {logs}"
                    ) from None
            except flight.FlightError as e:
                # shard 0 unreachable: if its process died, fail as any dead worker (name, log tail)
                for _ in range(10):
                    backend.check()
                    time.sleep(0.1)
                if isinstance(e, flight.FlightTimedOutError):  # its process runs but does not answer: frozen
                    raise DockTimeoutError(
                        f"iteration {iteration}: dock shard 0 at {dock.locations[0]} did not answer within "
                        f"{dock.rpc_timeout_s:.0f} s while its process runs (stopped, or the machine overloaded); "
                        f"see its log in {logs}"
                    ) from None
                raise
    return reports


def _log_eval(metrics: dict[str, float], tag: str) -> dict[str, float]:
    logger.info("greedy test accuracy %s training: %.3f (format %.3f)", tag, metrics[f"eval/accuracy_{tag}"],
                metrics[f"eval/format_rate_{tag}"])
    return metrics


def _raise_on_sigterm():
    """Turn SIGTERM into ``SystemExit`` while the workers run, so that the teardown in ``finally``
    runs when the driver is stopped (a pod deleted, ``kill``): the workers lead sessions of
    their own and would outlive it. Returns the previous handler (None off the main thread)."""
    if threading.current_thread() is not threading.main_thread():
        return None

    def stop(signum: int, frame: object) -> None:
        raise SystemExit(128 + signum)

    return signal.signal(signal.SIGTERM, stop)


def train_distributed(
    cfg: Config, *, backend: WorkerBackend | None = None, on_iteration: Callable[[int, dict[str, float]], None] | None = None,
) -> dict[str, float]:
    """Run GRPO with every stage in its own process; returns the run summary.

    Writes the same run folder as ``dockrl.trainer.train``, plus ``logs/`` (one log per process)
    with the local backend.
        A checkpoint (``dockrl.resume``) is written after iteration ``k`` when it is due: the actor
    writes weights and optimizer and reports ``checkpoint``; this driver then opens iteration
    ``k+1`` with its prompts, snapshots the dock, writes the driver state and only then
    announces ``k+1`` to the stages. With ``run.resume`` it restores that dock snapshot before
    the stages start, which load their weights (and the actor its optimizer) from the checkpoint.

    Args:
        backend: where to start the workers (see the module docstring); default a
            ``LocalBackend`` for a fresh run id.

    Raises:
        WorkerFailed: a worker process died; the message has its log tail.
        DockTimeoutError: a stage stopped reporting while its process kept running.
    """
    t0 = time.perf_counter()
    t, r = cfg.trainer, cfg.rollout
    run_dir = Path(cfg.run.output_dir)
    run_dir.mkdir(parents=True, exist_ok=True)
    model_path = resolve_model(cfg)  # prepared here once, before the workers look for it
    train_file, test_file = resolve_data(cfg)
    train_prompts, test_prompts = load_run_prompts(cfg, load_tokenizer(model_path, cfg.model.trust_remote_code), train_file, test_file)
    fingerprint = prompts_fingerprint([p.prompt_ids for p in train_prompts])
    point = find_resume(cfg, fingerprint)
    if point:  # the workers read the checkpoint folder itself, never 'latest' (a newer one may appear)
        cfg = dataclasses.replace(cfg, run=dataclasses.replace(cfg.run, resume=str(point.checkpoint)))
    save_config(cfg, run_dir / "config.yaml")

    log_dir = run_dir / "logs"
    keep_earlier_logs(log_dir)  # a resumed run: the failed attempt's logs go to logs/attempt-<N>/
    backend = backend or LocalBackend(f"dockrl-{secrets.token_hex(6)}", log_dir=log_dir, run_dir=run_dir)
    run = backend.run_id
    warehouse = make_warehouse(cfg.dock, run)  # checked here once, before any worker starts
    token = secrets.token_urlsafe(24)
    launcher_host = backend.launcher_host  # before the store: fails at once if members cannot reach this process
    # the store's server listens on every interface; members connect to launcher_host
    weight_store = dist.TCPStore(backend.bind_host, 0, is_master=True, wait_for_workers=False,
                                 timeout=timedelta(seconds=cfg.dock.timeout_s))
    ports = backend.serve_ports(cfg.dock.shards)
    locations = shard_locations(backend, ports)
    groups = worker_groups(cfg, backend, ports, f"{launcher_host}:{weight_store.port}", token, run,
                           first_wait=first_wait_s(cfg, len(test_prompts)) + backend.start_spread_s)
    stages = iteration_stages(cfg)
    summary: dict[str, float] = {"eval/test_prompts": len(test_prompts), "data/train_prompts": len(train_prompts)}
    summary |= point.summary if point else {}
    batches = list(prompt_batches(train_prompts, t))
    first, open_now = (point.next_iteration, point.open_iteration) if point else (0, None)
    dock = lease = None
    previous = _raise_on_sigterm()
    try:
        # every group at once: a stage never holds its devices while another still waits for a node
        backend.start(groups)
        lease = DriverLease(locations, token, cfg.run.driver_timeout_s)  # from now on: shards still starting count too
        backend.wait_ready(backend.start_timeout_s)
        wait_for_shards(locations, token, backend, timeout_s=backend.start_timeout_s)
        # a shard that stops answering fails the run within dock.timeout_s (at most a minute), not later
        dock = DockClient(locations, GRPO_SCHEMA, token=token, timeout_s=cfg.dock.timeout_s, warehouse=warehouse,
                          lease_s=cfg.dock.lease_s, owner=f"{run}/driver", rpc_timeout_s=min(60.0, cfg.dock.timeout_s))
        if point:
            if point.dock_uri:  # checkpoints/final has no open iteration to restore
                dock.restore(point.dock_uri)  # before any stage asks for an iteration
            logger.info("resuming at iteration %d from %s", first, point.checkpoint)

        def reports(iteration: int, names: Sequence[str]) -> dict[str, dict[str, float]]:
            return wait_reports(dock, backend, iteration, names, cfg.dock.timeout_s, backend.logs)

        # dock.timeout_s is what one rollout batch may take (the reward stage waits that long for
        # it); an evaluation generates for len(test_prompts) / rollout.batch_size such batches.
        # The other stages wait for the first iteration meanwhile (first_wait_s).
        eval_timeout_s = cfg.dock.timeout_s * eval_batches(cfg, len(test_prompts))
        if t.eval_before and not point:
            before = wait_reports(dock, backend, BEFORE_TRAINING, ["rollout"], eval_timeout_s + cfg.dock.timeout_s, backend.logs)
            summary |= _log_eval(before["rollout"], "before")
        others = groups[cfg.dock.shards + 1 :]
        logger.info("started %d dock shards and stages %s; logs in %s", cfg.dock.shards, [g.name for g in groups[cfg.dock.shards :]],
                    backend.logs)

        with MetricsWriter(run_dir, on_log=on_iteration, resume_from=first if point else None) as writer, \
                Progress(t.iterations - first, "GRPO", enable=cfg.run.progress) as progress:
            for it in range(first, t.iterations):
                picked, start = batches[it], time.perf_counter()
                if open_now == it:  # opened and filled before a checkpoint's snapshot: the stages may start now
                    dock.announce(it)
                else:
                    open_with_prompts(dock, it, picked, r.n)  # one open iteration: dock.max_inflight == 1
                metrics: dict[str, float] = {}
                for stage_metrics in reports(it, stages).values():
                    metrics |= stage_metrics
                metrics |= dock.stats()
                dock.close_iteration()
                add_iteration_metrics(metrics, time.perf_counter() - start, len(picked) * r.n)
                writer.log(it, metrics)
                progress.update(metrics)
                if checkpoint_due(t, it):
                    reports(it, [CHECKPOINT_STAGE])  # the actor wrote weights and optimizer
                    snapshot_for_checkpoint(dock, cfg, checkpoint_dir(run_dir, it + 1), next_iteration=it + 1,
                                            picked=batches[it + 1], summary=summary, prompts=fingerprint, run=run)
                    open_now = it + 1
            dock.finish()
            reports(AFTER_TRAINING, [g.name for g in others])  # every stage done, the final checkpoint written
            after = wait_reports(dock, backend, AFTER_TRAINING, ["rollout"], eval_timeout_s, backend.logs)
            # the actor wrote checkpoints/final's weights and optimizer before its report: complete it
            write_final_state(final_dir(run_dir), cfg, summary=summary, prompts=fingerprint)
            if t.eval_after:
                summary |= _log_eval(after["rollout"], "after")
            summary["run/seconds"] = time.perf_counter() - t0
            writer.log_summary(summary)
    finally:
        if lease is not None:
            lease.stop()  # first: its last beat goes to shards that still answer
        if dock is not None:
            dock.close()
        backend.teardown()
        del weight_store
        if previous is not None:
            signal.signal(signal.SIGTERM, previous)
    plot_metrics(run_dir / "metrics.jsonl", run_dir / "metrics.png")
    return summary
