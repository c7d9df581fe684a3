"""Distributed mode: every GRPO stage its own process, sharing only the sharded dock (docs/distributed.md).

``start_processes`` starts, through a worker backend (``LocalBackend`` by default, logs in
``RUN/logs/``; or ``KubernetesBackend``, one JobSet per run), every group at once:
``dock.shards`` dock shards (``dockrl dock-shard``, bearer tokens generated for the run and
passed as secrets: the driver's, which only this process and the shards hold, and one per stage
process, which may not call the driver's actions nor snapshot outside the run's places, and may
claim and put only its own stages' columns, ``stage_rights``; ``dockrl.dock.roles``; mutual TLS
with certificates made for the run, ``dockrl.dock.tls``), one group per stage process
(``dockrl worker``, ``dockrl.stages.table.stage_processes``) and, with ``env.sandbox.backend=pod``, a sandbox
executor per stage that runs model-written programs (``dockrl sandbox serve`` with a secret of its own,
``executor_group``). Rollout and actor meet on the weight channel, whose ``TCPStore`` this process hosts (with
``trainer.hybrid``: the hybrid actor's ``parallel.tp × pp × dp`` ranks meet there). The rollout evaluates
first; the others load their models meanwhile (``first_wait_s``). Addresses come from the backend and the config travels as YAML in
``CONFIG_ENV``, so the same groups run as local processes and as pods; paths in the config must
be ones the members see. ``ProcessStages`` is then the driver's stage runner
(``dockrl/driver.py``): the stages' metrics arrive as reports (``dockrl.stages.loop.Report``),
waited for in short slices that check the workers in between (``wait_reports``).
"""

from __future__ import annotations

import dataclasses
import logging
import math
import secrets
import time
from pathlib import Path
from typing import Callable, Literal, Sequence

import pyarrow.flight as flight

from dockrl.checkpoint.resume import dock_snapshot_places
from dockrl.config import Config, dump_config
from dockrl.dock import GRPO_SCHEMA, DockTimeoutError
from dockrl.dock.client.dock_client import DockClient
from dockrl.dock.flight.shards import is_loopback
from dockrl.dock.roles import StageRights
from dockrl.dock.tls import RunCertificates, scheme
from dockrl.dock.warehouse.stores import make_warehouse
from dockrl.launch.backend import WorkerBackend, WorkerGroup, sandbox_group
from dockrl.launch.local import LocalBackend, keep_earlier_logs
from dockrl.parallel.layout import ParallelLayout
from dockrl.parallel.ranks import serve_store
from dockrl.process.env import CONFIG_ENV, DRIVER_TOKEN_ENV, SANDBOX_SECRET_ENV, SANDBOX_URL_ENV, SANDBOX_WAIT_ENV, stage_token_env
from dockrl.run.driver_lease import DriverLease, wait_for_shards
from dockrl.run.setup import RunPlan
from dockrl.stages.loop import Report, final_report
from dockrl.stages.table import checkpoint_reports, iteration_reports, process_rows, stage_processes
from dockrl.stages.table import stage as stage_row

logger = logging.getLogger(__name__)

CHECK_EVERY_S = 0.5
"""Longest the driver waits for reports between two checks of the workers, seconds."""


SHARDS_GROUP = "dock-shard"
"""The dock shards' worker group: shard ``s`` is its member ``s`` (on Kubernetes one replicated job
of ``dock.shards`` indexed pods, so a run's PodSets do not grow with its shards)."""


def shard_locations(backend: WorkerBackend, ports: Sequence[int], protocol: str = "grpc",
                    beside: Sequence[tuple[str, int]] = ()) -> list[str]:
    """``<protocol>://host:port`` of every dock shard, in shard order: member ``s`` of group ``dock-shard`` on
    ``ports[s]``, or with ``beside`` (``shard_nodes``, on a backend with ``sidecars``) the sidecar of pod ``p`` of
    stage group ``g`` for shard ``s`` at ``beside[s] = (g, p)``."""
    if beside:
        return [f"{protocol}://{backend.address(group, pod, port)}" for (group, pod), port in zip(beside, ports, strict=True)]
    return [f"{protocol}://{backend.address(SHARDS_GROUP, s, port)}" for s, port in enumerate(ports)]


def _stage_shape(cfg: Config, stage: str) -> WorkerGroup:
    """The members of ``stage``'s group as ``worker_groups`` places them (devices, replicas, blocks), with no command yet."""
    replicas, colocate = stage_members(cfg.parallel, stage)
    return WorkerGroup(name=stage, command=("worker",), devices=member_devices(cfg, stage), replicas=replicas, colocate=colocate)


def shard_nodes(cfg: Config, backend: WorkerBackend) -> list[tuple[str, int]]:
    """Where the dock shards of ``dock.placement=beside`` run: shard ``s`` beside node ``p`` of stage group ``g`` at
    ``[s] = (g, p)``, the stage groups in ``stage_processes`` order, each one's nodes (``backend.nodes``: its pods
    on Kubernetes, one on this machine) in order. The members on node ``p`` of ``g`` claim from that shard first
    (``dockrl worker --local-shard``); the driver's prompts, split over the shards by whole groups, so land on
    every node that runs stages. Empty with ``dock.placement=apart``."""
    if cfg.dock.placement != "beside":
        return []
    return [(stage, p) for stage in stage_processes(cfg) for p in range(backend.nodes(_stage_shape(cfg, stage)))]


def dock_shards(cfg: Config, backend: WorkerBackend) -> int:
    """The dock shards of a distributed run: ``dock.shards``, or with ``dock.placement=beside`` one per stage node (``shard_nodes``)."""
    return len(shard_nodes(cfg, backend)) or cfg.dock.shards


def member_devices(cfg: Config, stage: str) -> int:
    """Devices one member of ``stage`` holds: every stage process that holds a model is one rank
    of the layout with one device (docs/design.md §6); reward and dock shards compute on CPU.

    The layout sets how many such members there are: the hybrid actor is ``parallel.tp × pp ×
    dp`` members (``worker_groups``), so a run asks for that many devices for it, plus one each
    for the rollout, actor, reference and critic processes of a non-hybrid run, and one for the reward model
    (the rows of ``dockrl.stages.table.STAGES`` with ``devices``).
    """
    return 1 if stage_row(stage).devices else 0


def stage_members(layout: ParallelLayout, stage: str) -> tuple[int, int]:
    """Members of ``stage``'s group and how many consecutive ones must share a node: the hybrid
    actor is one member per rank of the layout (``tp × pp × dp``), and its tensor-parallel groups
    (training TP, inference TP': ``lcm(tp, infer_tp)`` consecutive ranks, as ranks are numbered
    TP fastest) share a node, since their collectives run on every layer; every other stage is one
    member (the rows of ``dockrl.stages.table.STAGES`` with ``layout``)."""
    if stage_row(stage).layout:
        return layout.world_size, math.lcm(layout.tp, layout.infer_tp)
    return 1, 1


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


def program_stages(cfg: Config) -> list[str]:
    """The stage processes that get a sandbox executor of their own: with ``env.sandbox.backend=pod``, those that run
    model-written programs (the rows of ``dockrl.stages.table.STAGES`` with ``programs``); else none."""
    if cfg.env.sandbox.backend != "pod":
        return []
    return [stage for stage in stage_processes(cfg) if stage_row(stage).programs]


EXECUTOR_MEMORY_MB = 512
"""Memory of a sandbox executor's server beside its programs', MiB."""
EXECUTOR_DISK_MB = 256
"""Disk of a sandbox executor's pod beside its programs' folders (its log), MiB."""


def executor_group(cfg: Config, backend: WorkerBackend, stage: str, port: int, secret: str) -> WorkerGroup:
    """The sandbox executor of ``stage`` (``dockrl sandbox serve``, ``dockrl.isolation.executor``) on ``port``, holding
    ``secret`` and no other credential: room for ``env.sandbox.pod_slots`` programs of ``env.sandbox``'s limits at
    once (a core, ``memory_mb`` and ``disk_mb`` each) and its server. Why one per stage, not one per member nor one
    for the run: a ``Sandbox`` is one pod, so one per member would multiply the run's pods by its data-parallel
    size; one for the run would put the tool calls (whose output the model sees and steers) beside the programs that
    decide its rewards, where a pod gives no layer inside to keep them apart."""
    s = cfg.env.sandbox
    sized = [f"env.sandbox.{name}={getattr(s, name)}" for name in ("memory_mb", "disk_mb", "file_mb", "max_processes", "pod_slots")]
    return WorkerGroup(name=sandbox_group(stage), port=port, secret_env={SANDBOX_SECRET_ENV: secret}, cpu=str(s.pod_slots),
                       memory=f"{s.pod_slots * s.memory_mb + EXECUTOR_MEMORY_MB}Mi",
                       ephemeral_storage=f"{s.pod_slots * s.disk_mb + EXECUTOR_DISK_MB}Mi",
                       command=(*backend.program(), "sandbox", "serve", "--host", backend.bind_host, "--port", str(port), *sized))


def stage_rights(cfg: Config, process: str) -> StageRights:
    """What the token of stage process ``process`` may do on the dock shards: act as the consumers of
    the stage table's rows it runs (``process_rows``), claim and read the columns they claim or write,
    put the columns they write; with dynamic sampling the row that ends each round (the advantage
    stage, in the reward's process) also drops rows and writes the round gate (``sampling_writes``)."""
    rows, sampling = process_rows(process), cfg.algorithm.filter_groups.enable
    writes = frozenset(c for row in rows for c in row.writes + (row.sampling_writes if sampling else ()))
    return StageRights(stage=process, consumers=frozenset(c for row in rows for c in row.consumers),
                       reads=frozenset(c for row in rows for c in row.claims) | writes, writes=writes,
                       drop=sampling and any(row.sampling_writes for row in rows))


def worker_groups(
    cfg: Config, backend: WorkerBackend, ports: Sequence[int], weight_address: str, token: str, run: str = "run",
    first_wait: float | None = None, *, restore: str = "", tls: RunCertificates | None = None,
    executor_ports: Sequence[int] = (), sandbox_secret: str = "",
) -> list[WorkerGroup]:
    """The dock shards' group (one member per shard, member ``s`` serving on ``ports[s]``), the stage groups of a run,
    and with ``env.sandbox.backend=pod`` a sandbox executor per stage that runs programs (``program_stages``).

    Args:
        backend: gives the members' program, bind interface and addresses.
        ports: the shards' ports (``backend.serve_ports(dock.shards)``).
        weight_address: ``host:port`` of the launcher's ``TCPStore`` as the members reach it: the
            weight channel's rendezvous, or with ``trainer.hybrid`` that of the hybrid actor's
            ranks (one member each, ``parallel.tp × pp × dp``).
        token: the driver's bearer token, a secret of the shards only (``DRIVER_TOKEN_ENV``). Each
            stage process gets a token of its own, made here, with its ``stage_rights``: a secret
            (``WorkerGroup.secret_env``) of its members (``stage_token_env``) and of the shards.
        run: the run's name (lease owners, the warehouse objects' root).
        first_wait: longest wait of the stages for the shards to answer and for the first
            iteration (``first_wait_s``; the rollout evaluates first and uses it for the shards
            only); None for ``dock.timeout_s``.
        restore: the snapshot the run resumes from: the shards may read it (beside the run's own
            places, ``dock_snapshot_places``).
        tls: the run's certificates: the shards serve mutual TLS (``grpc+tls://``), each end's
            part a secret of its members; None: plain gRPC.
        executor_ports: the sandbox executors' ports, one per ``program_stages(cfg)``.
        sandbox_secret: the run's secret of its sandbox executors, a secret of them and of the stages they serve only.

    Raises:
        ValueError: ``executor_ports`` or ``sandbox_secret`` missing where ``program_stages`` asks for executors.

    The config travels as YAML in ``CONFIG_ENV``. With ``dock.warehouse`` other than
    ``memory`` the shards keep metadata only (``--payload store``) and every stage reads and
    writes the run's objects (named by ``run``) itself.
    """
    program = backend.program()
    payload = "memory" if cfg.dock.warehouse == "memory" else "store"
    s3 = cfg.dock.warehouse == "s3"  # only then do the members need the object store's credentials
    shard_s3 = s3 or bool(cfg.run.rollouts_uri)  # and the shards, which write the kept rollouts there
    stages = stage_processes(cfg)
    tokens = {stage: secrets.token_urlsafe(24) for stage in stages}  # one per stage process
    access = [arg for stage in stages for arg in ("--stage-rights", stage_rights(cfg, stage).to_arg(stage_token_env(stage)))]
    for place in dock_snapshot_places(cfg, run, restore):
        access += ["--snapshot-place", place]
    shard_secrets = {DRIVER_TOKEN_ENV: token, **{stage_token_env(stage): t for stage, t in tokens.items()}}
    client: dict[str, str] = {}  # the stages' part of the TLS
    if tls:
        access.append("--tls")
        shard_secrets |= tls.server.env("server")
        client = tls.client.env("client")
    # one command for every shard: a member takes its port by its index (DOCKRL_REPLICA, on Kubernetes
    # the pod's completion index); in pods every shard serves on the same port
    port_arg = str(ports[0]) if len(set(ports)) == 1 else ",".join(map(str, ports))
    shards = WorkerGroup(name=SHARDS_GROUP, replicas=len(ports), secret_env=shard_secrets, port=ports[0], object_store=shard_s3, command=(
        *program, "dock-shard", "--host", backend.bind_host, "--port", port_arg,
        "--token-env", DRIVER_TOKEN_ENV, "--timeout-s", str(cfg.dock.timeout_s), "--lease-s", str(cfg.dock.lease_s),
        "--payload", payload, "--driver-timeout-s", str(cfg.run.driver_timeout_s), *access,
    ))
    beside = shard_nodes(cfg, backend)
    if beside and len(beside) != len(ports):
        raise ValueError(f"dock.placement=beside: {len(ports)} shard port(s) for the {len(beside)} stage nodes {beside}; "
                         "expected one each (dock_shards)")
    sidecars = backend.sidecars and bool(beside)
    dock = ",".join(shard_locations(backend, ports, scheme(tls.server if tls else None), beside if sidecars else ()))
    wait = ["--first-wait-s", f"{first_wait:g}"] if first_wait else []
    replicas = {stage: stage_members(cfg.parallel, stage)[0] for stage in stages}
    if beside:  # a stage node's members claim from the shard beside them; in pods, shard first + the pod's index
        local = {stage: ["--local-shard", f"{beside.index((stage, 0))}{'+pod' if sidecars else ''}"] for stage in stages}
    else:  # a backend on loopback runs every shard on each member's machine: replica r claims from shard r mod shards first
        local = {stage: ["--local-shard-of-replica"] if n > 1 and is_loopback(backend.bind_host) else [] for stage, n in replicas.items()}
    served = program_stages(cfg)
    if len(executor_ports) != len(served) or (served and not sandbox_secret):
        raise ValueError(f"sandbox executors of {served}: got {len(executor_ports)} port(s) and "
                         f"{'a' if sandbox_secret else 'no'} secret; expected one port each and the run's secret")
    executors = {stage: executor_group(cfg, backend, stage, port, sandbox_secret) for stage, port in zip(served, executor_ports)}
    config_yaml = dump_config(cfg, portable=True)  # portable: each stage resolves `auto` (device, dtypes) where it runs
    env = {stage: {CONFIG_ENV: config_yaml} for stage in stages}
    secret_env = {stage: {stage_token_env(stage): tokens[stage], **client} for stage in stages}
    for stage, group in executors.items():  # a stage that runs programs reaches its executor, and only it holds its secret
        env[stage] |= {SANDBOX_URL_ENV: f"http://{backend.address(group.name, 0, group.port)}",
                       SANDBOX_WAIT_ENV: f"{first_wait or cfg.dock.timeout_s:g}"}
        secret_env[stage][SANDBOX_SECRET_ENV] = sandbox_secret
    sidecar = dataclasses.replace(shards, replicas=1) if sidecars else None  # one in every pod of every stage group
    return ([] if sidecars else [shards]) + [
        dataclasses.replace(_stage_shape(cfg, stage), env=env[stage], secret_env=secret_env[stage], object_store=s3, sidecar=sidecar, command=(
            *program, "worker", "--stage", stage, "--config-env", CONFIG_ENV,
            "--dock", dock, "--weight-sync", weight_address, "--run", run, *wait, *local[stage],
        ))
        for stage in stages
    ] + list(executors.values())


def wait_reports(
    dock: DockClient, backend: WorkerBackend, iteration: int, stages: Sequence[str], timeout_s: float, logs: str | Path,
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
                    missing = [str(s) for s in stages if s not in reports]
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


def start_processes(plan: RunPlan, backend: WorkerBackend | None = None) -> ProcessStages:
    """Start the dock shards and the stage processes of ``plan`` through ``backend`` (default:
    local processes of a fresh run id) and return their runner once the shards answer; the
    stages then load their models. Every group starts at once: a stage never holds its devices
    while another still waits for a node.

    Raises:
        WorkerFailed: a process died while starting (its log tail in the message).
        TimeoutError: a dock shard did not answer within the backend's start timeout.
    """
    cfg = plan.cfg
    run_dir = Path(cfg.run.output_dir)
    keep_earlier_logs(run_dir / "logs")  # a resumed run: the failed attempt's logs go to logs/attempt-<N>/
    backend = backend or LocalBackend(f"dockrl-{secrets.token_hex(6)}", log_dir=run_dir / "logs", run_dir=run_dir,
                                      fork_server=cfg.run.fork_server)
    warehouse = make_warehouse(cfg.dock, backend.run_id)  # checked here once, before any worker starts
    driver_token = secrets.token_urlsafe(24)  # the stages' own tokens are made with their groups
    launcher_host = backend.launcher_host  # before the store: fails at once if members cannot reach this process
    # on the backend's bind host only (loopback for a local run); members connect to launcher_host
    weight_store = serve_store(backend.bind_host, timeout_s=cfg.dock.timeout_s)
    n_shards = dock_shards(cfg, backend)
    ports = backend.serve_ports(n_shards + len(program_stages(cfg)))  # the shards', then the sandbox executors'
    ports, executor_ports = ports[:n_shards], ports[n_shards:]
    beside = shard_nodes(cfg, backend) if backend.sidecars else []
    hosts = [loc.split("://", 1)[1].rsplit(":", 1)[0] for loc in shard_locations(backend, ports, beside=beside)]
    tls = RunCertificates.generate(hosts, run=backend.run_id)  # the run's own: no other run can talk to its shards
    locations = shard_locations(backend, ports, scheme(tls.server), beside)
    groups = worker_groups(cfg, backend, ports, f"{launcher_host}:{weight_store.port}", driver_token, backend.run_id,
                           first_wait=first_wait_s(cfg, len(plan.test_prompts)) + backend.start_spread_s,
                           restore=plan.resume.dock_uri if plan.resume else "", tls=tls,
                           executor_ports=executor_ports, sandbox_secret=secrets.token_urlsafe(32))
    lease: DriverLease | None = None
    dock: DockClient | None = None
    alive = [weight_store]  # until stop(): the members' rendezvous

    def stop() -> None:
        if lease is not None:
            lease.stop()  # first: its last beat goes to shards that still answer
        if dock is not None:
            dock.close()
        backend.teardown()
        alive.clear()

    try:
        backend.start(groups)
        lease = DriverLease(locations, driver_token, cfg.run.driver_timeout_s, tls=tls.client)  # from now on: shards still starting count too
        backend.wait_ready(backend.start_timeout_s)
        wait_for_shards(locations, driver_token, backend.start_timeout_s, check=backend.check, tls=tls.client)
        # a shard that stops answering fails the run within dock.timeout_s (at most a minute), not later
        dock = DockClient(locations, GRPO_SCHEMA, token=driver_token, tls=tls.client, timeout_s=cfg.dock.timeout_s, warehouse=warehouse,
                          lease_s=cfg.dock.lease_s, owner=f"{backend.run_id}/driver", rpc_timeout_s=min(60.0, cfg.dock.timeout_s),
                          max_inflight=cfg.dock.max_inflight)
    except BaseException:
        stop()
        raise
    logger.info("started %d dock shards and stages %s; logs in %s", n_shards, stage_processes(cfg), backend.logs)
    return ProcessStages(cfg, dock, backend, test_prompts=len(plan.test_prompts), stop=stop)


class ProcessStages:
    """The ``StageRunner`` of ``dock.mode=distributed`` (``dockrl/driver.py``): the stages run as
    processes (``start_processes``) and their metrics arrive as reports through ``dock``
    (``dockrl.stages.loop.Report``). Every wait watches the processes (``wait_reports``), so a dead
    one fails the run within a second with ``WorkerFailed``.

    Args:
        backend: what runs the processes: ``check()`` between waits, ``logs`` for messages,
            ``run_id`` the run's name.
        test_prompts: how many prompts an evaluation generates for: each rollout batch of them
            may take ``dock.timeout_s``.
        stop: stops the processes and closes the dock (``close``).
    """

    def __init__(self, cfg: Config, dock: DockClient, backend: WorkerBackend, *, test_prompts: int, stop: Callable[[], None]) -> None:
        self.cfg, self.dock, self.backend, self.run, self._stop = cfg, dock, backend, backend.run_id, stop
        # dock.timeout_s is what one rollout batch may take (the reward stage waits that long for it)
        self.eval_timeout_s = cfg.dock.timeout_s * eval_batches(cfg, test_prompts)

    def _wait(self, iteration: int, reports: Sequence[str], timeout_s: float) -> dict[str, dict[str, float]]:
        return wait_reports(self.dock, self.backend, iteration, reports, timeout_s, self.backend.logs)

    def evaluate(self, tag: Literal["before", "after"]) -> dict[str, float]:
        t, timeout_s = self.cfg.trainer, self.cfg.dock.timeout_s
        if tag == "before":  # the rollout loads its model first
            metrics = self._wait(0, [Report.EVAL_BEFORE], self.eval_timeout_s + timeout_s)[Report.EVAL_BEFORE]
        else:  # reported before the rollout's final report (``finish``)
            metrics = self._wait(t.iterations, [Report.EVAL_AFTER], timeout_s)[Report.EVAL_AFTER]
        logger.info("greedy test accuracy %s training: %.3f (format %.3f)", tag, metrics[f"eval/accuracy_{tag}"],
                    metrics[f"eval/format_rate_{tag}"])
        return metrics

    def run_iteration(self, iteration: int) -> dict[str, float]:
        metrics: dict[str, float] = {}
        for stage_metrics in self._wait(iteration, iteration_reports(self.cfg), self.cfg.dock.timeout_s).values():
            metrics |= stage_metrics
        return metrics

    def save_checkpoint(self, iteration: int, folder: Path) -> None:
        self._wait(iteration, checkpoint_reports(self.cfg), self.cfg.dock.timeout_s)  # the actor (and critic) wrote weights and optimizer there

    def generated(self, iterations: range) -> dict[int, dict[str, dict[str, float]]]:
        return {it: self._wait(it, [Report.ROLLOUT], self.cfg.dock.timeout_s) for it in iterations}

    def finish(self) -> None:
        """Every process ends its loop; the actor writes ``checkpoints/final``, the rollout evaluates (``trainer.eval_after``)."""
        t, timeout_s = self.cfg.trainer, self.cfg.dock.timeout_s
        self.dock.finish()
        evaluator, *others = stage_processes(self.cfg)
        self._wait(t.iterations, [final_report(p) for p in others], timeout_s)
        self._wait(t.iterations, [final_report(evaluator)], timeout_s + (self.eval_timeout_s if t.eval_after else 0))

    def close(self) -> None:
        self._stop()
