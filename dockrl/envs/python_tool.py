"""The ``python`` environment: the model calls a ``python`` tool with a program, which runs in the
sandbox (``dockrl.isolation.sandbox``, under ``env.sandbox.*``; here or in a sandbox executor's pod,
``env.sandbox.backend``, ``dockrl.isolation.runner``); what it prints is the next turn.

Every call starts a fresh interpreter in a fresh folder: nothing (variables, files) carries over
from one call to the next, as the tool's description tells the model.
"""

from __future__ import annotations

from dockrl.config.env_sections import EnvConfig, SandboxConfig
from dockrl.envs.tool_calls import ToolCall, ToolParser
from dockrl.envs.tool_episode import ToolEpisode, tool_schema
from dockrl.isolation.runner import require_layers, run_program
from dockrl.isolation.sandbox import SandboxResult


def describe_result(result: SandboxResult, limits: SandboxConfig) -> str:
    """The observation of one run: its stdout, its stderr (when any), and why it stopped when it failed."""
    parts = [result.stdout.rstrip("\n")] if result.stdout.strip() else []
    if result.stderr.strip():
        parts.append(result.stderr.rstrip("\n"))
    if result.truncated:
        parts.append(f"[output cut at {limits.output_bytes} bytes]")
    why = {
        "wall": f"it ran longer than {limits.wall_s:g} s and was stopped",
        "cpu": f"it used more than {limits.cpu_s} s of CPU time and was stopped",
        "memory": f"it asked for more than {limits.memory_mb} MiB of memory",
        "processes": f"it started more than {limits.max_processes} processes",
        "file_size": f"it wrote a file larger than {limits.file_mb} MiB",
        "disk": f"its files took more than {limits.disk_mb} MiB",
    }
    if result.limit is not None:
        parts.append(f"[{why[result.limit]}]")
    elif result.exit_code not in (0, None) and not result.stderr.strip():
        parts.append(f"[exit status {result.exit_code}]")
    return "\n".join(parts) if parts else "(no output)"


class PythonEnvironment:
    """``env.name=python``: the tool ``python(code)``, run in the sandbox.

    A call counts as a tool error when it cannot be read, names another tool, or its program fails
    (a non-zero exit status, an exception, a limit hit).

    Args:
        limits: ``env.sandbox``.
        tool_parser: ``env.tool_parser``; with ``fenced``, a ```` ```python ```` block's text is the program.
        call_reward: ``env.tool_call_reward``: the step reward of a turn whose calls all ran.
        reward_once: ``env.tool_call_reward_once``: only the first such turn of a trajectory earns it.
    """

    @classmethod
    def from_config(cls, e: EnvConfig) -> PythonEnvironment:
        """``env.name=python`` (``BUILT_IN_ENVIRONMENTS``): the sandbox's limits, the tool-call format and reward of ``env.*``."""
        return cls(e.sandbox, e.tool_parser, e.tool_call_reward, e.tool_call_reward_once)

    def __init__(self, limits: SandboxConfig, tool_parser: ToolParser = "hermes", call_reward: float = 0.0, reward_once: bool = True) -> None:
        """Raises:
            SandboxUnavailable: a layer of ``limits.require`` is not in force where programs run (``runner.require_layers``)."""
        require_layers(limits)  # fail closed: before the first program of the model
        self.limits, self.tool_parser, self.call_reward, self.reward_once = limits, tool_parser, call_reward, reward_once
        self.tools = [tool_schema(
            "python", f"Run a Python program and return what it prints (stdout and stderr). The standard library only; no network; "
            f"each call starts a fresh interpreter; at most {limits.wall_s:g} s.", "code", "The program; print the values you need.")]

    def open(self, ground_truth: str) -> ToolEpisode:
        return ToolEpisode(self.tool_parser, ("python", "code"), self._run, self.call_reward,
                           reward_once=self.reward_once, ground_truth=ground_truth)

    def _run(self, call: ToolCall) -> tuple[str, bool]:
        if call.name != "python":
            return f"Error: unknown tool {call.name!r}; the tool is 'python'.", True
        code = call.arguments.get("code")
        if not isinstance(code, str):
            return "Error: python takes one string argument 'code'.", True
        result = run_program(code, self.limits)
        return describe_result(result, self.limits), not result.ok

    def close(self) -> None:
        """Nothing to release: every call's process and folder are gone when it returns."""
