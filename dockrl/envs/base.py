"""The interface between a multi-turn rollout and an environment: an ``Environment`` opens one
``Episode`` per trajectory; the rollout hands the episode each model turn's text and gets back a
``Step``: the observation to append as the next turn (text; the rollout tokenizes it), a reward
and whether the trajectory is done.

The rollout owns the tokens (it never re-tokenizes the conversation: docs/agents.md); an
environment sees and returns text only.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol, runtime_checkable


@dataclass(frozen=True, kw_only=True)
class Step:
    """What an environment returns for one model turn."""

    observation: str | None = None
    """Text of the environment's turn that follows (a tool's output); ``None``: no turn follows."""
    reward: float = 0.0
    """This turn's reward (added to the trajectory's per-turn rewards; 0 when the environment gives none)."""
    done: bool = False
    """The trajectory ends after this turn (no tool call, an answer given, or the environment's own end)."""
    tool_calls: int = 0
    """Tool calls the turn held (parsed from its text)."""
    tool_errors: int = 0
    """Of those, the calls that failed: unparsable, unknown tool, an error, a timeout or a limit hit in the sandbox."""
    tool_calls_right: int = 0
    """Of those, the calls that ran and whose value is the trajectory's reference answer (the call computed what the
    question asks: a metric, never a reward; 0 where the environment does not check)."""


@runtime_checkable
class Episode(Protocol):
    """One trajectory's environment state.

    An episode may also define ``calls_end(turn: str) -> int | None``, the offset in a turn's text just after
    its tool calls (None without a complete one): the rollout then ends a turn that went on past its calls
    there (``dockrl.stages.multi_turn``). The built-in tool episodes do (``dockrl.envs.tool_calls.calls_end``).
    """

    def step(self, turn: str) -> Step:
        """The environment's answer to the model's turn ``turn`` (its decoded text, special tokens removed).

        Raises:
            EnvironmentFailure: never for a bad model turn (that is a counted ``tool_errors``); only
                when the environment itself broke (then the rollout fails naming it).
        """
        ...

    def close(self) -> None:
        """Release what the episode holds (a sandbox's folder, processes); idempotent."""
        ...


@runtime_checkable
class Environment(Protocol):
    """Opens episodes; one instance serves a whole run in the rollout's process."""

    tools: list[dict]
    """The tools' JSON schemas (OpenAI function format) given to the chat template (``tools=``); may be empty."""

    def open(self, ground_truth: str) -> Episode:
        """An episode for a trajectory of the prompt whose reference answer is ``ground_truth``."""
        ...

    def close(self) -> None:
        """Release everything the environment holds (worker processes); idempotent."""
        ...


class EnvironmentFailure(RuntimeError):
    """The environment itself failed (its process died or did not answer in time): names the environment and what it waited for."""
