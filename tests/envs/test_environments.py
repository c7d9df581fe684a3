"""The built-in environments (python, calculator), a user's environment in its own process, and
build_environment from the config."""

from __future__ import annotations

import dataclasses
import json
import os
import time
from concurrent.futures import ThreadPoolExecutor

import psutil
import pytest

from dockrl.config import Config, ConfigError
from dockrl.config.env_sections import EnvConfig, SandboxConfig
from dockrl.envs.base import Environment, EnvironmentFailure, Episode, Step
from dockrl.envs.calculator import CalculationError, CalculatorEnvironment, evaluate
from dockrl.envs.python_tool import PythonEnvironment
from dockrl.envs.registry import build_environment
from dockrl.envs.user import UserEnvironment


def hermes(name: str, **arguments: str) -> str:
    return f"<tool_call>\n{json.dumps({'name': name, 'arguments': arguments})}\n</tool_call>"


def config(**env) -> Config:
    return dataclasses.replace(Config(), env=EnvConfig(**env))


@pytest.mark.parametrize("expression, value", [
    ("123456 * 789", 97406784), ("2 ** 100", 1267650600228229401496703205376), ("(7 - 10) // 2", -2), ("7 / 2", 3.5),
    ("-3 % 5", 2), ("sqrt(16) + abs(-2)", 6.0), ("max(3, 9, 4) - min(1, 2)", 8), ("round(2.567, 2)", 2.57),
])
def test_calculator_evaluates_arithmetic(expression, value):
    assert evaluate(expression) == value


@pytest.mark.parametrize("expression, reason", [
    ("__import__('os').system('true')", "not allowed"), ("x + 1", "not allowed"), ("(1).__class__", "not allowed"),
    ("9 ** 9 ** 9", "digits"), ("1 / 0", "ZeroDivisionError"), ("2 +", "not an expression"), ("'a' * 3", "not a number"),
    ("sqrt(-1)", "math domain"),
])
def test_calculator_refuses_what_is_not_bounded_arithmetic(expression, reason):
    start = time.monotonic()
    with pytest.raises(CalculationError, match=reason):
        evaluate(expression)
    assert time.monotonic() - start < 1


def test_calculator_environment_steps():
    env = CalculatorEnvironment("hermes")
    assert isinstance(env, Environment) and env.tools[0]["function"]["name"] == "calculator"
    episode = env.open("97406784")
    assert isinstance(episode, Episode)
    step = episode.step("I will use the tool. " + hermes("calculator", expression="123456 * 789"))
    assert (step.observation, step.done, step.tool_calls, step.tool_errors) == ("97406784", False, 1, 0)
    step = episode.step(hermes("python", code="1") + hermes("calculator", expression="1/0") + "<tool_call>{oops}</tool_call>")
    assert step.tool_calls == 3 and step.tool_errors == 3 and step.observation.startswith("[1] Error: unknown tool 'python'")
    assert "[2] Error: ZeroDivisionError" in step.observation and "[3] Error: the tool call could not be read" in step.observation
    step = episode.step("The answer is #### 97406784")
    assert step.done and step.observation is None and step.tool_calls == 0
    fenced = CalculatorEnvironment("fenced").open("")
    assert fenced.step("```\n2 ** 10\n```").observation == "1024"


@pytest.mark.parametrize("make, call", [
    (lambda reward, once=True: CalculatorEnvironment("fenced", reward, once), "```\n6 * 7\n```"),
    (lambda reward, once=True: PythonEnvironment(SandboxConfig(wall_s=5.0), "fenced", reward, once), "```python\nprint(6 * 7)\n```"),
])
def test_a_turn_whose_calls_all_ran_earns_the_tool_call_reward(make, call):
    assert make(0.0).open("42").step(call).reward == 0.0  # off by default
    episode = make(0.2, False).open("42")
    ran = episode.step(call)
    assert (ran.observation, ran.tool_calls, ran.tool_errors, ran.tool_calls_right, ran.reward) == ("42", 1, 0, 1, 0.2)
    failed = episode.step(call + "\n```\n1 / 0\n```")  # one of the two calls fails: no reward
    assert (failed.tool_calls, failed.tool_errors, failed.tool_calls_right, failed.reward) == (2, 1, 1, 0.0)
    assert episode.step(call).reward == 0.2  # every turn whose calls ran, with reward_once off
    assert episode.step("#### 42") == Step(observation=None, done=True)  # the answer turn: no call, no reward


@pytest.mark.parametrize("make, call", [
    (lambda: CalculatorEnvironment("fenced", 0.2), "```\n6 * 7\n```"),
    (lambda: PythonEnvironment(SandboxConfig(wall_s=5.0), "fenced", 0.2), "```python\nprint(6 * 7)\n```"),
])
def test_the_tool_call_reward_is_paid_once_and_right_calls_are_counted(make, call):
    """By default only the first turn whose calls ran earns the reward, whatever turns follow; a call that returns
    the reference answer counts as right, one that returns another number does not."""
    episode = make().open("42")
    assert episode.step(call + "\n```\n1 / 0\n```").reward == 0.0  # a failed call earns nothing, and is not the one paid
    first, again = episode.step(call), episode.step(call)
    assert (first.reward, first.tool_calls_right, again.reward, again.tool_calls_right) == (0.2, 1, 0.0, 1)
    other = make().open("43")
    assert (other.step(call).tool_calls_right, other.step(call.replace("7", "7.0")).tool_calls_right) == (0, 0)
    assert make().open("42.0").step(call).tool_calls_right == 1  # the same number, written otherwise


def test_python_environment_runs_calls_in_the_sandbox_and_counts_failures():
    limits = SandboxConfig(cpu_s=1, wall_s=3.0, output_bytes=200)
    env = PythonEnvironment(limits, "hermes")
    assert env.tools[0]["function"]["name"] == "python" and env.tools[0]["function"]["parameters"]["required"] == ["code"]
    episode = env.open("440040051")
    step = episode.step(hermes("python", code="print(48213 * 9127)"))
    assert (step.observation, step.done, step.tool_calls, step.tool_errors) == ("440040051", False, 1, 0)
    step = episode.step(hermes("python", code="while True: pass"))
    assert step.tool_errors == 1 and "more than 1 s of CPU time" in step.observation
    step = episode.step(hermes("python", code="x = bytearray(10 * 1024**3)"))
    assert step.tool_errors == 1 and "MemoryError" in step.observation
    step = episode.step(hermes("python", code="print('y' * 10_000)"))
    assert step.tool_errors == 0 and "[output cut at 200 bytes]" in step.observation
    step = episode.step(hermes("python", code="pass") + hermes("python", script="print(1)"))
    assert step.observation == "[1] (no output)\n\n[2] Error: python takes one string argument 'code'." and step.tool_errors == 1
    step = episode.step(hermes("python", code="print(1 + 1)"))  # the episode goes on after every failure
    assert step.observation == "2" and step.tool_errors == 0
    assert episode.step("So the answer is #### 440040051").done
    episode.close()
    episode.close()
    env.close()


def test_python_environment_with_fenced_blocks():
    episode = PythonEnvironment(SandboxConfig(wall_s=5.0), "fenced").open("")
    step = episode.step("Compute it:\n```python\nprint(sum(range(101)))\n```")
    assert step.observation == "5050" and step.tool_calls == 1


def test_build_environment_from_the_config():
    assert build_environment(Config()) is None
    assert isinstance(build_environment(config(name="python", sandbox=SandboxConfig(wall_s=2.0))), PythonEnvironment)
    assert isinstance(build_environment(config(name="calculator", tool_parser="fenced")), CalculatorEnvironment)
    with pytest.raises(ConfigError, match=r"env.name: got 'no_such_module_x:Env', which does not import"):
        build_environment(config(name="no_such_module_x:Env"))


def test_a_user_environment_runs_in_its_own_process():
    env = build_environment(config(name="fake_user_envs:FakeEchoEnvironment", timeout_s=10.0))
    try:
        assert isinstance(env, UserEnvironment) and env.tools[0]["function"]["name"] == "echo"
        first, second = env.open("7"), env.open("8")
        step = first.step("hello")
        assert step.observation.startswith("echo hello (turn 1, truth 7, pid ") and step.tool_calls == 1
        assert int(step.observation.rsplit(" ", 1)[1].rstrip(")")) != os.getpid()
        assert second.step("x").observation.startswith("echo x (turn 1, truth 8")
        assert first.step("again").observation.startswith("echo again (turn 2, truth 7")
        assert first.calls_end("call(1); and on") == len("call(1);") and first.calls_end("no call") is None  # the episode's, over the pipe
        final = first.step("the answer")
        assert final.done and final.reward == 1.0
        first.close()
        first.close()
        with pytest.raises(EnvironmentFailure, match="(?s)raised during a step:.*RuntimeError: the fake environment raised on purpose"):
            second.step("raise")
        with pytest.raises(EnvironmentFailure, match="expected dockrl.envs.base.Step"):
            second.step("wrong")
    finally:
        env.close()
        env.close()


def test_a_user_environment_that_hangs_fails_naming_it_and_the_wait():
    env = UserEnvironment("fake_user_envs:FakeEchoEnvironment", timeout_s=1.0)
    child = env._child.proc.pid
    episode = env.open("1")
    start = time.monotonic()
    with pytest.raises(EnvironmentFailure, match=r"env.name='fake_user_envs:FakeEchoEnvironment': no answer to a step within 1 s"):
        episode.step("hang")
    assert time.monotonic() - start < 5
    assert not psutil.pid_exists(child) or psutil.Process(child).status() == psutil.STATUS_ZOMBIE
    with pytest.raises(EnvironmentFailure, match="its process is gone"):
        episode.step("hello")
    episode.close()  # quiet: the process is gone
    env.close()


def test_a_user_environment_that_dies_or_does_not_build():
    env = UserEnvironment("fake_user_envs:FakeEchoEnvironment", timeout_s=10.0)
    with pytest.raises(EnvironmentFailure, match=r"its process died during a step \(exit code 3\)"):
        env.open("1").step("die")
    env.close()
    with pytest.raises(EnvironmentFailure, match="(?s)raised during its start.*ValueError: the fake environment cannot be built"):
        UserEnvironment("fake_user_envs:FakeBrokenEnvironment", timeout_s=10.0)


def test_episodes_step_from_a_thread_pool():
    python = PythonEnvironment(SandboxConfig(wall_s=5.0), "hermes")
    user = UserEnvironment("fake_user_envs:FakeEchoEnvironment", timeout_s=10.0)
    try:
        def trajectory(i: int) -> tuple[str, str]:
            ours, theirs = python.open(str(i)), user.open(str(i))
            return ours.step(hermes("python", code=f"print({i} * 1000003)")).observation, theirs.step(f"t{i}").observation

        with ThreadPoolExecutor(max_workers=8) as pool:
            results = list(pool.map(trajectory, range(16)))
        for i, (ours, theirs) in enumerate(results):
            assert ours == str(i * 1000003) and theirs.startswith(f"echo t{i} (turn 1, truth {i},")
    finally:
        user.close()
