"""Worker backends: what a worker group is, how one fails, the backend protocol and its names.

A worker backend starts long-lived groups of stage workers for one run (actor, reference,
reward, dock shards), watches them, and tears them down. Two implement ``WorkerBackend``:
``LocalBackend`` (processes on this machine, ``local.py``) and ``KubernetesBackend``
(one JobSet per run, a replicated job per group, ``kubernetes.py``).

A backend also says how the members are addressed, so that the driver
(``distributed.py``) builds the same groups for either: the program that runs the ``dockrl``
command line in a member, the interface a serving member binds, the ports it serves on, the
``host:port`` of a member, the host at which members reach servers of the launcher (the
weight channel's ``TCPStore``), and the folder both see (``shared_dir``).

The backend's name (``WorkerBackendName``) is the one choice the pipeline compiles in and the
launcher and the exit handler dispatch on; ``worker_backend_name`` checks it. Choosing and
building a backend by name happens above this module (``train_task.run_training``,
``tasks.teardown_run``), so the backends import this interface and nothing imports back.
"""

from __future__ import annotations

import logging
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal, Protocol, Sequence, cast, get_args

logger = logging.getLogger(__name__)

WorkerBackendName = Literal["local", "kubernetes"]
"""Where a run's stage workers run: ``local`` processes (``local.py``) or ``kubernetes`` pods (``kubernetes.py``)."""
WORKER_BACKENDS: tuple[str, ...] = get_args(WorkerBackendName)


def worker_backend_name(value: str, where: str = "worker_backend") -> WorkerBackendName:
    """``value`` as a ``WorkerBackendName``.

    Raises:
        ValueError: ``value`` is not one of ``WORKER_BACKENDS`` (the message names ``where``).
    """
    if value not in WORKER_BACKENDS:
        raise ValueError(f"{where}: got {value!r}; expected one of {', '.join(map(repr, WORKER_BACKENDS))}")
    return cast(WorkerBackendName, value)


_NAME = re.compile(r"^[a-z]([-a-z0-9]{0,30}[a-z0-9])?$")

SANDBOX_GROUP_PREFIX = "sandbox-"
"""Name prefix of a sandbox executor's group (``env.sandbox.backend=pod``): ``sandbox-<stage>`` serves the members of
group ``<stage>``. A backend runs it as any other group, except that ``KubernetesBackend`` makes it an agent-sandbox
``Sandbox`` pod of its own (``sandbox_pod.py``) instead of a replicated job of the JobSet."""


def sandbox_group(stage: str) -> str:
    """The group of the sandbox executor of stage group ``stage``."""
    return SANDBOX_GROUP_PREFIX + stage


def served_stage(group: str) -> str:
    """The stage group whose sandbox executor ``group`` is; '' for a group that is no sandbox executor."""
    return group.removeprefix(SANDBOX_GROUP_PREFIX) if group.startswith(SANDBOX_GROUP_PREFIX) else ""


@dataclass(frozen=True, kw_only=True)
class WorkerGroup:
    """One group of identical stage workers (a replicated job of the run's JobSet, or N local processes)."""

    name: str
    """Group name (``actor``, ``reference``, ``reward``, ``dock-shard``, ``sandbox-reward``): DNS label, ≤ 32 chars."""
    command: tuple[str, ...]
    """Program and arguments of every member (``("dockrl", "worker", "reward")``)."""
    replicas: int = 1
    """Members of the group; each gets its index in ``DOCKRL_REPLICA``."""
    devices: int = 0
    """Accelerators of each member: a member is one rank process with one device (0 for a member
    that computes on CPU). Members with devices take the platform's image, extended resource,
    node selector, tolerations and pod size per device (``Platform.pod_requests``) instead of
    ``cpu``/``memory``/``ephemeral_storage``; on Kubernetes they are packed into pods shaped like
    nodes (``colocate``, ``Platform.devices_per_node``)."""
    colocate: int = 1
    """Consecutive members that must share a node (and so a pod): the actor's tensor-parallel
    groups, training and inference (``lcm(parallel.tp, parallel.infer_tp)``), whose collectives
    run on every layer. Members ``[k·c, (k+1)·c)`` are one such block."""
    object_store: bool = False
    """Members read and write the S3 warehouse (``dock.warehouse=s3``; shards also with ``run.rollouts_uri``): they get the platform's
    object-store credentials; otherwise no pod refers to that Secret, which need not exist."""
    cpu: str = "1"
    """CPU request of a member without devices (Kubernetes quantity)."""
    memory: str = "4Gi"
    """Memory request of a member without devices (Kubernetes quantity)."""
    ephemeral_storage: str = "2Gi"
    """Ephemeral-storage request of a member without devices (logs; Kubernetes quantity)."""
    port: int = 0
    """Port a member serves on (the headless Service exposes it); 0 for none."""
    env: dict[str, str] = field(default_factory=dict)
    """Extra environment of every member."""
    secret_env: dict[str, str] = field(default_factory=dict)
    """Environment of every member whose values are secrets (the dock's bearer tokens): a
    Kubernetes backend keeps them in a Secret of the run (``secretKeyRef``), never in a pod spec."""
    sidecar: WorkerGroup | None = None
    """A dock shard beside each pod of the group (``dock.placement=beside`` on a backend with ``sidecars``): its
    command, port, requests and secrets, run as a container of every pod of the group; None: none."""

    @property
    def accelerators(self) -> bool:
        """Members hold accelerators (``devices`` > 0)."""
        return self.devices > 0

    def __post_init__(self) -> None:
        if not _NAME.match(self.name):
            raise ValueError(f"worker group name: got {self.name!r}; "
                             "expected a DNS label of at most 32 lowercase letters, digits and '-'")
        if not self.command:
            raise ValueError(f"worker group {self.name!r}: command is empty; give the program and its arguments")
        if self.replicas < 1:
            raise ValueError(f"worker group {self.name!r}: replicas={self.replicas}; expected >= 1")
        if self.devices < 0:
            raise ValueError(f"worker group {self.name!r}: devices={self.devices}; expected >= 0")
        if self.colocate < 1 or self.replicas % self.colocate:
            raise ValueError(f"worker group {self.name!r}: colocate={self.colocate} with replicas={self.replicas}; "
                             "expected a block size >= 1 that divides the members")
        if not 0 <= self.port < 65536:
            raise ValueError(f"worker group {self.name!r}: port={self.port}; expected 0 (none) or 1-65535")


def stage_error(log_tail: str) -> str:
    """The exception that ended a worker, as the last traceback in its log states it (``Type: message``, the
    type without its module), or ``""`` when the log holds no traceback (nor the end of one)."""
    lines = log_tail.splitlines()
    # the traceback's header, or (a tail that cut it off) its last frame
    starts = [i for i, line in enumerate(lines) if line.startswith(("Traceback (most recent call last):", '  File "'))]
    if not starts:
        return ""
    for line in lines[starts[-1] + 1:]:
        if line.strip() and not line[0].isspace():  # the frames are indented; the exception's line is not
            return re.sub(r"^(?:[A-Za-z_]\w*\.)+(?=[A-Za-z_]\w*(?::|$))", "", line.strip())
    return ""


class WorkerFailed(RuntimeError):
    """A worker died or cannot start; carries the tail of its log."""

    def __init__(self, group: str, member: str, reason: str, log_tail: str = ""):
        self.group, self.member, self.reason, self.log_tail = group, member, reason, log_tail
        msg = f"worker {member} of group {group!r} failed: {reason}"
        own = stage_error(log_tail)
        if own:  # the stage's own words first: the line a user reads
            msg += f": {own}"
        if log_tail:
            msg += "\n--- last lines of its log ---\n" + log_tail.rstrip("\n")
        super().__init__(msg)


class WorkersSuspended(WorkerFailed):
    """The cluster took a run's workers away to run them later: Kueue preempted the run (it
    suspended the JobSet, whose pods go away). A pause, not a failure: the launcher keeps the run
    and resumes it from its newest checkpoint once it is admitted again (``dockrl.kubeflow.train_task``)."""

    def __init__(self, group: str, member: str, reason: str, log_tail: str = ""):
        super().__init__(group, member, reason, log_tail)
        self.args = (f"workers of {member} paused: {reason}",)  # not "failed": the run goes on


class WorkerBackend(Protocol):
    """Starts, watches and tears down the worker groups of one run, and addresses their members."""

    run_id: str
    """The run's id: labels every worker, names the run's objects."""
    bind_host: str
    """Interface a serving member binds (``127.0.0.1`` for local processes, ``0.0.0.0`` in a pod)."""
    start_timeout_s: float
    """Longest a started member may take to run (scheduling, image pull), seconds."""
    start_spread_s: float
    """Longest between the first and the last member of a run starting to run, seconds: how much
    longer than their own loading the stages may wait for the shards and the first iteration."""
    sidecars: bool
    """Whether a group's ``sidecar`` runs beside each of its pods (Kubernetes); else the launcher starts the shards of
    ``dock.placement=beside`` as a group of their own, one per stage group, on the stages' machine (local processes)."""

    def nodes(self, group: WorkerGroup) -> int:
        """Nodes the members of ``group`` are placed on: its pods on Kubernetes (``pod_spec.pod_shape``), 1 for local
        processes (one machine)."""

    @property
    def shared_dir(self) -> Path | None:
        """Folder the launcher and every member see at the same path (None: every path of the
        launcher's machine, as for local processes)."""

    @property
    def logs(self) -> str:
        """Where the members' logs are, for error messages (a folder, a ``kubectl logs`` command)."""

    @property
    def launcher_host(self) -> str:
        """Host at which members reach a server of the launcher's process (the weight channel's store)."""

    def program(self) -> tuple[str, ...]:
        """The command that runs the ``dockrl`` command line in a member (``dockrl worker ...``)."""

    def serve_ports(self, n: int) -> list[int]:
        """Ports for ``n`` serving groups (one member each), in order."""

    def address(self, group: str, replica: int, port: int) -> str:
        """``host:port`` at which the launcher and other members reach member ``replica`` of ``group``."""

    def start(self, groups: Sequence[WorkerGroup]) -> None:
        """Start every group of the run, all at once; returns without waiting for readiness."""

    def wait_ready(self, timeout_s: float) -> None:
        """Block until every member runs; raise ``WorkerFailed`` as soon as one fails, ``TimeoutError`` at the deadline."""

    def check(self) -> None:
        """Raise ``WorkerFailed`` (with its log tail) if any member has failed; cheap, call it often."""

    def teardown(self) -> int:
        """Stop and remove every worker of the run; safe to call twice. Returns how many
        workers (processes, or Kubernetes objects) were removed."""
