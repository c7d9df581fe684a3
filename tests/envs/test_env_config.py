"""The ``env`` section: defaults, loading, and each error naming its field."""

from __future__ import annotations

import pytest

from dockrl.config import ConfigError, load_config_text, multi_turn


def test_default_is_single_turn_with_sane_sandbox_limits():
    c = load_config_text("", "test.yaml")
    assert c.env.name == "" and c.env.tool_parser == "hermes"
    s = c.env.sandbox
    assert (s.cpu_s, s.wall_s, s.memory_mb, s.output_bytes, s.max_processes) == (5, 10.0, 512, 4096, 16)
    assert (s.backend, s.pod_slots) == ("local", 4)  # programs run in the stage's own sandbox unless a pod is asked for
    assert load_config_text("", "test.yaml", ["env.sandbox.backend=pod", "env.sandbox.pod_slots=8"]).env.sandbox.backend == "pod"


def test_env_loads_from_yaml_and_overrides():
    c = load_config_text("env:\n  name: python\n  sandbox:\n    wall_s: 3\n", "test.yaml",
                         ["env.tool_parser=fenced", "env.sandbox.memory_mb=256", "env.timeout_s=5"])
    assert (c.env.name, c.env.tool_parser, c.env.timeout_s) == ("python", "fenced", 5.0)
    assert (c.env.sandbox.wall_s, c.env.sandbox.memory_mb) == (3.0, 256)
    assert load_config_text("env:\n  name: my_pkg.envs:Shop\n", "test.yaml").env.name == "my_pkg.envs:Shop"


@pytest.mark.parametrize("override, message", [
    ("env.name=shell", r"env.name: got 'shell'; expected '' \(single-turn\), one of 'python', 'calculator', or an import path"),
    ("env.name=my pkg:Env", "env.name: got 'my pkg:Env'"),
    ("env.tool_parser=xml", "env.tool_parser: got 'xml'; expected one of 'hermes', 'fenced'"),
    ("env.timeout_s=0", r"env.timeout_s: got 0.0; expected a finite number of seconds > 0"),
    ("env.timeout_s=inf", "env.timeout_s: got inf"),
    ("env.sandbox.wall_s=-1", "env.sandbox.wall_s: got -1.0; expected seconds > 0 and <= 3600"),
    ("env.sandbox.wall_s=inf", "env.sandbox.wall_s: got inf; expected seconds > 0 and <= 3600"),
    ("env.sandbox.output_bytes=1048577", "env.sandbox.output_bytes: got 1048577; expected an integer >= 1 and <= 1048576"),
    ("env.sandbox.memory_mb=70000", "env.sandbox.memory_mb: got 70000; expected an integer >= 64 and <= 65536$"),
    ("env.sandbox.max_processes=5000", "env.sandbox.max_processes: got 5000; expected an integer >= 1 and <= 1024"),
    ("env.sandbox.cpu_s=0", "env.sandbox.cpu_s: got 0; expected an integer >= 1"),
    ("env.sandbox.cpu_s=1.5", "env.sandbox.cpu_s: got 1.5; expected an integer"),
    ("env.sandbox.memory_mb=16", r"env.sandbox.memory_mb: got 16; expected an integer >= 64 \(the Python interpreter"),
    ("env.sandbox.output_bytes=0", "env.sandbox.output_bytes: got 0; expected an integer >= 1"),
    ("env.sandbox.file_mb=0", "env.sandbox.file_mb: got 0"),
    ("env.sandbox.max_processes=0", "env.sandbox.max_processes: got 0"),
    ("env.sandbox.gpu_mb=5", r"env.sandbox: unknown field\(s\) \['gpu_mb'\]"),
    ("env.sandbox.backend=docker", "env.sandbox.backend: got 'docker'; expected one of 'local', 'pod'"),
    ("env.sandbox.pod_slots=0", "env.sandbox.pod_slots: got 0; expected an integer >= 1 and <= 64"),
    ("env.sandbox.pod_slots=65", "env.sandbox.pod_slots: got 65; expected an integer >= 1 and <= 64"),
    ("env.tool_call_reward=-0.1", "env.tool_call_reward: got -0.1; expected a finite number >= 0"),
    ("env.tool_call_reward=0.2", r"env.tool_call_reward: got 0.2; only the built-in environments \(python, calculator\) give it; "
                                 r"env.name='' is none"),
])
def test_bad_env_values_name_the_field(override, message):
    with pytest.raises(ConfigError, match=message):
        load_config_text("", "test.yaml", [override])


def test_the_tool_call_reward_is_for_built_in_environments_and_below_a_right_answer():
    c = load_config_text("", "test.yaml", ["env.name=calculator", "rollout.max_turns=2", "env.tool_call_reward=0.2"])
    assert c.env.tool_call_reward == 0.2
    with pytest.raises(ConfigError, match=r"env.tool_call_reward: got 0.2; .*env.name='my_pkg.envs:Shop' gives its own rewards"):
        load_config_text("", "test.yaml", ["env.name=my_pkg.envs:Shop", "env.tool_call_reward=0.2"])
    assert c.env.tool_call_reward_once  # paid once per trajectory by default: any number of turns stays below the answer
    assert load_config_text("", "test.yaml", ["env.name=python", "rollout.max_turns=8", "env.tool_call_reward=0.5"]).env.tool_call_reward == 0.5
    with pytest.raises(ConfigError, match=r"env.tool_call_reward: got 0.25; the most a trajectory can earn from tool calls "
                                          r"\(× rollout.max_turns=4\) must stay below algorithm.correct_reward=1"):
        load_config_text("", "test.yaml", ["env.name=python", "rollout.max_turns=4", "env.tool_call_reward=0.25",
                                           "env.tool_call_reward_once=false"])
    with pytest.raises(ConfigError, match=r"env.tool_call_reward: got 1.0; .*\(once: env.tool_call_reward_once\) must stay below"):
        load_config_text("", "test.yaml", ["env.name=python", "env.tool_call_reward=1.0"])


def test_the_documented_task_configurations_load():
    """docs/agents.md "Bundled tasks": the two configurations it gives."""
    data = "dockrl/envs/data/"
    c = load_config_text("", "test.yaml", ["env.name=python", "rollout.max_turns=4", f"data.train_path={data}tool_arithmetic_train.jsonl",
                                           f"data.test_path={data}tool_arithmetic_test.jsonl"])
    assert c.env.name == "python" and c.rollout.max_turns == 4
    c = load_config_text("", "test.yaml", ["algorithm.scorer=dockrl.rewards.code:CodeScorer", f"data.train_path={data}code_problems.jsonl",
                                           f"data.test_path={data}code_problems.jsonl"])
    assert c.algorithm.scorer == "dockrl.rewards.code:CodeScorer"


def test_an_agent_is_a_multi_turn_rollout_in_place_of_an_environment():
    c = load_config_text("", "test.yaml", ["env.agent.command=python my_agent.py", "rollout.max_turns=4", "env.agent.failed_reward=-0.5"])
    assert multi_turn(c.env) and c.env.agent.failed_reward == -0.5 and c.env.agent.max_sessions == 16
    with pytest.raises(ConfigError, match=r"env.agent.command: got 'python a.py'; an agent drives the trajectories in place of an "
                                          r"environment; env.name='calculator' is set too"):
        load_config_text("", "test.yaml", ["env.agent.command=python a.py", "env.name=calculator"])
    with pytest.raises(ConfigError, match=r"rollout.partial_tokens: got 8; not supported with an environment or an agent "
                                          r"\(env.agent.command='python a.py': a multi-turn rollout"):
        load_config_text("", "test.yaml", ["env.agent.command=python a.py", "rollout.partial_tokens=8", "dock.max_inflight=2",
                                           "dock.mode=distributed"])
    for override, message in (("env.agent.session_timeout_s=0", "env.agent.session_timeout_s: got 0"),
                              ("env.agent.max_sessions=0", "env.agent.max_sessions: got 0"),
                              ("env.agent.batch_wait_s=-1", "env.agent.batch_wait_s: got -1"),
                              ("env.agent.failed_reward=nan", "env.agent.failed_reward: got nan")):
        with pytest.raises(ConfigError, match=message):
            load_config_text("", "test.yaml", ["env.agent.command=python a.py", override])
