"""The multi-turn rollout's rules: ``rollout.max_turns`` and ``rollout.max_total_tokens``, and what
runs with an environment today (each refusal says why)."""

from __future__ import annotations

import math

from dockrl.config.algorithm_sections import AlgorithmConfig
from dockrl.config.env_rules import BUILT_IN_ENVIRONMENTS
from dockrl.config.env_sections import EnvConfig
from dockrl.config.errors import fail
from dockrl.config.sections import RolloutConfig, TrainerConfig


def multi_turn(env: EnvConfig) -> bool:
    """Whether the rollout runs the multi-turn loop (``dockrl.stages.multi_turn``): the run has an
    environment (``env.name``); its rows then carry ``loss_mask`` and the turn columns."""
    return bool(env.name)


def check_turns(r: RolloutConfig, env: EnvConfig, t: TrainerConfig, a: AlgorithmConfig) -> None:
    """``rollout.max_turns`` and ``rollout.max_total_tokens``: their ranges, read only with an
    environment, and the features a multi-turn rollout does not run with.

    Raises:
        ConfigError: names the field, its value, the rule and the fix.
    """
    if r.max_turns < 1:
        raise fail("rollout.max_turns", r.max_turns, "expected a positive integer (1: one model turn)")
    if r.max_total_tokens < 0:
        raise fail("rollout.max_total_tokens", r.max_total_tokens, "expected an integer >= 0 (0: no limit but the turns')")
    if not (0 <= env.tool_call_reward < math.inf):
        raise fail("env.tool_call_reward", env.tool_call_reward, "expected a finite number >= 0")
    if env.tool_call_reward and env.name not in BUILT_IN_ENVIRONMENTS:
        raise fail("env.tool_call_reward", env.tool_call_reward, f"only the built-in environments "
                    f"({', '.join(BUILT_IN_ENVIRONMENTS)}) give it; env.name={env.name!r} "
                    + ("is none" if not env.name else "gives its own rewards (Step.reward)") + ": set env.tool_call_reward=0")
    if env.tool_call_reward * r.max_turns >= a.correct_reward:
        raise fail("env.tool_call_reward", env.tool_call_reward, f"the most a trajectory can earn from tool calls "
                    f"(× rollout.max_turns={r.max_turns}) must stay below algorithm.correct_reward={a.correct_reward:g}, "
                    "so a right answer outweighs any number of calls")
    if not multi_turn(env):
        if r.max_turns != 1:
            raise fail("rollout.max_turns", r.max_turns, "a turn after the first follows an environment's observation, and "
                        "env.name is empty (no environment): set env.name, or rollout.max_turns=1")
        if r.max_total_tokens:
            raise fail("rollout.max_total_tokens", r.max_total_tokens, "only read by a multi-turn rollout (env.name set): "
                        "set env.name, or leave it 0")
        return
    refused = {
        "rollout.partial_tokens": (r.partial_tokens, r.partial_tokens > 0, "a trajectory is generated in one pass", 0),
        "trainer.hybrid": (t.hybrid, t.hybrid, "the hybrid actor's rollout generates single turns", False),
        "algorithm.overlong_buffer.enable": (a.overlong_buffer.enable, a.overlong_buffer.enable,
                                             "a trajectory's length counts observations, not rollout.max_response_length's tokens",
                                             False),
    }
    for where, (value, bad, why, off) in refused.items():
        if bad:
            raise fail(where, value, f"not supported with an environment (env.name={env.name!r}: a multi-turn rollout; {why}); "
                        f"set {where}={str(off).lower()}, or env.name=''")
