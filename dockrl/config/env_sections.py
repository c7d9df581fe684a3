"""The run configuration's ``env`` section: the environment of a multi-turn rollout, the format the
model calls tools in, and the sandbox that runs model-written code; frozen, keyword-only
dataclasses, one docstring per field.

The section's rules (a built-in environment or an import path, the sandbox's ranges) are beside it, below;
``Config`` (``dockrl.config.config``) holds it.
The environments themselves are ``dockrl.envs`` (docs/agents.md).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Literal

from dockrl.config.errors import IMPORT_PATH, fail, require_finite

SANDBOX_LAYERS = ("network", "mounts", "writes", "processes")
"""What the sandbox's layers keep from a program (``env.sandbox.require``): the network, the files and Unix
sockets other processes left in the shared folders, writes outside its folder, processes beyond its own count."""


@dataclass(frozen=True, kw_only=True)
class SandboxConfig:
    """Limits of one program run in the sandbox (``dockrl.isolation.sandbox``): a tool call of the
    ``python`` environment, or a response's program under the code-execution reward."""

    cpu_s: int = 5
    """CPU time of the program and its children, seconds (``RLIMIT_CPU``; past it the kernel kills it)."""
    wall_s: float = 10.0
    """Wall-clock time of the program, seconds; past it its whole process group is killed."""
    memory_mb: int = 512
    """Address space of each of the program's processes, MiB (``RLIMIT_AS``): a larger allocation raises ``MemoryError``;
    and the resident memory of all of them together, where a memory cgroup can be made (root)."""
    output_bytes: int = 4096
    """Bytes kept of each of stdout and stderr; the rest is read and dropped (the result says it was cut)."""
    file_mb: int = 16
    """Largest file the program may write in its working folder, MiB (``RLIMIT_FSIZE``)."""
    disk_mb: int = 64
    """All the files of its working folder together, MiB: the folder is a tmpfs of this size in the program's mount
    namespace (counted in its memory where a memory cgroup applies)."""
    max_processes: int = 16
    """Processes the program may hold at once, itself included, threads counted too (a pids cgroup where
    one is writable, else ``RLIMIT_NPROC`` in the program's user namespace, which counts its own processes only)."""
    require: tuple[str, ...] = SANDBOX_LAYERS
    """The layers that must be in force before any model-written program runs (``network``, ``mounts``,
    ``writes``, ``processes``): the environment and the code scorer refuse to start without them, naming what is
    missing and how a pod gets it (docs/agents.md). ``[]`` runs programs with whatever the machine gives:
    for trusted code only, and said loudly in the log."""
    backend: Literal["local", "pod"] = "local"
    """Where programs run: ``local``, in a child process of the stage that asks (the layers above, as this machine
    gives them); ``pod``, in a sandbox executor of its own (``dockrl sandbox serve``, ``dockrl.isolation.executor``) that
    the stage reaches over HTTP at ``DOCKRL_SANDBOX_URL`` with the run's secret ``DOCKRL_SANDBOX_SECRET``: on Kubernetes
    an agent-sandbox ``Sandbox`` pod per stage that runs programs, with no credential, no egress and a read-only root, for
    pods that cannot give the layers themselves (docs/reliability.md); ``require`` is then checked against that executor."""
    pod_slots: int = 4
    """Programs one sandbox executor runs at once (``backend=pod``); more wait for a free slot. Its pod's cpu, memory and
    disk limits are this many programs' (``cpu_s``'s one core, ``memory_mb``, ``disk_mb``) plus the server's own."""


@dataclass(frozen=True, kw_only=True)
class AgentConfig:
    """A user's agent served by the rollout's OpenAI-compatible gateway (``dockrl.stages.gateway``, docs/agents.md)."""

    command: str = ""
    """The agent's command line (``shlex`` syntax), run once per trajectory row with ``OPENAI_BASE_URL`` and
    ``OPENAI_API_KEY`` (its session's key) in its environment and its task (JSON: ``messages``, ``tools``, ``prompt``)
    on stdin. Set, the rollout serves the gateway instead of an environment (``env.name`` must be empty). "": none."""
    session_timeout_s: float = 300.0
    """Longest a session may last from its agent's start, seconds; past it the session fails and its agent is killed."""
    request_timeout_s: float = 120.0
    """Longest one request may wait for its generation, seconds; past it the session fails."""
    max_sessions: int = 16
    """Agents running at once in one rollout process."""
    batch_wait_s: float = 0.05
    """Longest a waiting request waits for the other live sessions' requests to join its generation, seconds."""
    failed_reward: float = 0.0
    """The reward of a failed session (its agent crashed, went past a limit or never asked): the scorer does not score it."""
    host: str = "127.0.0.1"
    """The address the gateway binds; the agents get ``http://<host>:<port>/v1`` (a free port)."""


@dataclass(frozen=True, kw_only=True)
class EnvConfig:
    name: str = ""
    """The rollout's environment: ``""`` (single-turn: no environment), ``python`` (a Python tool run in
    the sandbox), ``calculator`` (an arithmetic tool), or ``package.module:Class`` (a user's environment,
    built with no arguments in a process of its own; docs/agents.md)."""
    tool_parser: Literal["hermes", "fenced"] = "hermes"
    """How tool calls are read from a model turn: ``hermes``, the Qwen2.5/Hermes chat templates'
    ``<tool_call>{"name": ..., "arguments": {...}}</tool_call>``; ``fenced``, a fenced code block
    (```` ```python ````) calls the environment's one tool with the block's text."""
    tool_call_reward: float = 0.0
    """Reward of a model turn whose tool calls all ran (at least one call, none failed), in the built-in
    environments (``python``, ``calculator``): a shaping term for a model that seldom calls the tool, so
    a GRPO group has variance before any answer is right (rewarding the call's form and success, as
    ToolRL does with its format and correctness terms: Qian et al. 2025, arXiv 2504.13958). It is added to the trajectory's
    reward through ``turn_rewards``; ``correct`` stays the verifier's verdict. 0: no such reward."""
    tool_call_reward_once: bool = True
    """Pay ``tool_call_reward`` for the first model turn of a trajectory whose calls all ran only, so that calls
    cannot outweigh the answer however many turns they take (a model paid per turn learns to spend every turn on
    a call and none on the answer: docs/agents.md). false: every such turn earns it."""
    timeout_s: float = 60.0
    """Longest a user environment (``package.module:Class``) may take to answer one call (open, a step,
    close), seconds; past it the rollout fails naming the environment."""
    sandbox: SandboxConfig = field(default_factory=SandboxConfig)
    """Limits of the sandbox that runs the ``python`` environment's tool calls (``env.sandbox.*``)."""
    agent: AgentConfig = field(default_factory=AgentConfig)
    """A user's agent driving the model through the gateway (``env.agent.*``), in place of an environment."""


BUILT_IN_ENVIRONMENTS: dict[str, str] = {
    "python": "dockrl.envs.python_tool:PythonEnvironment.from_config",
    "calculator": "dockrl.envs.calculator:CalculatorEnvironment.from_config",
}
"""The environments ``env.name`` may name without an import path, each with the import path of its builder
``(EnvConfig) -> Environment`` (``dockrl.envs.registry.build_environment`` imports it where the rollout runs): adding
one is its class and one entry here."""


SANDBOX_MAX: dict[str, float] = {"wall_s": 3600.0, "cpu_s": 3600, "memory_mb": 65536, "output_bytes": 1 << 20, "file_mb": 1024,
                                 "disk_mb": 16384, "max_processes": 1024, "pod_slots": 64}
"""Upper bounds of ``env.sandbox.*``: no program of a rollout gets more than an hour, 64 GiB, a 1 GiB file,
16 GiB of files, 1,024 processes or 1 MiB of output (which the trainer keeps and tokenizes); no executor pod runs more than
64 programs at once."""


def check_env(e: EnvConfig) -> None:
    """The ``env`` section's ranges and names.

    Raises:
        ConfigError: names the field (``env.name``, ``env.timeout_s``, ``env.sandbox.*``), its value and the rule.
    """
    if e.name and e.name not in BUILT_IN_ENVIRONMENTS and not IMPORT_PATH.match(e.name):
        raise fail("env.name", e.name, f"expected '' (single-turn), one of {', '.join(repr(n) for n in BUILT_IN_ENVIRONMENTS)}, "
                    "or an import path 'package.module:Class' of a user environment")
    if not (0 < e.timeout_s < math.inf):
        raise fail("env.timeout_s", e.timeout_s, "expected a finite number of seconds > 0")
    require_finite({"env.tool_call_reward": e.tool_call_reward}, zero=True)
    g = e.agent
    if g.command and e.name:
        raise fail("env.agent.command", g.command, f"an agent drives the trajectories in place of an environment; env.name={e.name!r} "
                   "is set too: set one of them")
    for name in ("session_timeout_s", "request_timeout_s"):
        if not 0 < getattr(g, name) < math.inf:
            raise fail(f"env.agent.{name}", getattr(g, name), "expected a finite number of seconds > 0")
    if not 0 <= g.batch_wait_s <= 10:
        raise fail("env.agent.batch_wait_s", g.batch_wait_s, "expected seconds >= 0 and <= 10")
    if not 1 <= g.max_sessions <= 4096:
        raise fail("env.agent.max_sessions", g.max_sessions, "expected an integer >= 1 and <= 4096")
    if not math.isfinite(g.failed_reward):
        raise fail("env.agent.failed_reward", g.failed_reward, "expected a finite number (a penalty may be negative)")
    s = e.sandbox
    if not (0 < s.wall_s <= SANDBOX_MAX["wall_s"]):
        raise fail("env.sandbox.wall_s", s.wall_s, f"expected seconds > 0 and <= {SANDBOX_MAX['wall_s']:g}")
    unknown = [layer for layer in s.require if layer not in SANDBOX_LAYERS]
    if unknown or len(set(s.require)) != len(s.require):
        raise fail("env.sandbox.require", list(s.require), f"expected distinct names among {', '.join(SANDBOX_LAYERS)} "
                   "([] for none: trusted code only)")
    for name, low in (("cpu_s", 1), ("memory_mb", 64), ("output_bytes", 1), ("file_mb", 1), ("disk_mb", 1), ("max_processes", 1),
                      ("pod_slots", 1)):
        v, high = getattr(s, name), SANDBOX_MAX[name]
        if not low <= v <= high:
            why = " (the Python interpreter itself needs about that much address space)" if name == "memory_mb" and v < low else ""
            raise fail(f"env.sandbox.{name}", v, f"expected an integer >= {low}{why} and <= {high}")
