"""The episode of a tool environment: each model turn's tool calls are read (``dockrl.envs.tool_calls``)
and run, and their outputs are the next turn; a turn without a tool call ends the trajectory.

The built-in environments (``python``, ``calculator``) differ only in their tool: a ``ToolEpisode``
takes the function that runs one call.
"""

from __future__ import annotations

from typing import Callable

from dockrl.envs.base import Step
from dockrl.envs.tool_calls import ToolCall, ToolCallError, ToolParser, calls_end, describe_error, parse_tool_calls

RunCall = Callable[[ToolCall], tuple[str, bool]]
"""Runs one call: ``(output text, failed)``; never raises for what the call asks."""


def tool_schema(name: str, description: str, argument: str, argument_description: str) -> dict:
    """A tool with one string argument, as an OpenAI-format function schema (what chat templates take as ``tools=``)."""
    return {"type": "function", "function": {
        "name": name, "description": description,
        "parameters": {"type": "object", "properties": {argument: {"type": "string", "description": argument_description}},
                       "required": [argument]},
    }}


def same_number(output: str, ground_truth: str) -> bool:
    """Whether a call's ``output`` is one number equal to the number ``ground_truth`` (``1,234`` and ``1234.0`` equal ``1234``)."""
    try:
        return float(output.strip().replace(",", "")) == float(ground_truth.strip().replace(",", ""))
    except ValueError:
        return False


class ToolEpisode:
    """One trajectory of a tool environment; the rollout steps an episode from one thread at a time (episodes of
    different trajectories share nothing, so a thread pool may step several).

    Args:
        parser: ``env.tool_parser``.
        fenced_tool: ``(tool, argument)`` a fenced block calls.
        run_call: runs one readable call.
        call_reward: ``env.tool_call_reward``: the step reward of a turn whose calls all ran.
        reward_once: ``env.tool_call_reward_once``: only the first such turn of the trajectory earns it.
        ground_truth: the row's reference answer: a call that ran and returned it counts in ``Step.tool_calls_right``.
    """

    def __init__(self, parser: ToolParser, fenced_tool: tuple[str, str], run_call: RunCall, call_reward: float = 0.0, *,
                 reward_once: bool = True, ground_truth: str = "") -> None:
        self.parser, self.fenced_tool, self.run_call, self.call_reward = parser, fenced_tool, run_call, call_reward
        self.reward_once, self.ground_truth, self.rewarded = reward_once, ground_truth, False

    def step(self, turn: str) -> Step:
        """The outputs of the turn's tool calls as the observation (numbered when more than one);
        ``done`` when the turn calls no tool. Unreadable calls and failed runs count in ``tool_errors``;
        the step's reward is ``call_reward`` when the turn held calls and none failed (with ``reward_once``, for the
        first such turn only), else 0."""
        calls = parse_tool_calls(turn, self.parser, fenced_tool=self.fenced_tool)
        if not calls:
            return Step(observation=None, done=True)
        outputs, errors, right = [], 0, 0
        for call in calls:
            if isinstance(call, ToolCallError):
                text, failed = describe_error(call), True
            else:
                text, failed = self.run_call(call)
            outputs.append(text)
            errors += failed
            right += not failed and same_number(text, self.ground_truth)
        observation = outputs[0] if len(outputs) == 1 else "\n\n".join(f"[{i}] {text}" for i, text in enumerate(outputs, start=1))
        paid = not errors and not (self.reward_once and self.rewarded)
        self.rewarded = self.rewarded or paid
        return Step(observation=observation, done=False, tool_calls=len(calls), tool_errors=errors, tool_calls_right=right,
                    reward=self.call_reward if paid else 0.0)

    def calls_end(self, turn: str) -> int | None:
        """Where the turn's tool calls end in its text (``dockrl.envs.tool_calls.calls_end``): the rollout ends the turn there."""
        return calls_end(turn, self.parser)

    def close(self) -> None:
        """Nothing to release: every call ran in its own process, already gone."""
