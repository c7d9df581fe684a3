"""Shared fixtures: a tiny random Qwen2-architecture model and tokenizer, built offline once."""

from __future__ import annotations

import pytest


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory):
    from dockrl.models import build_tiny_model

    return build_tiny_model(tmp_path_factory.mktemp("tiny-model"))


@pytest.fixture(scope="session")
def tiny_reward_model_dir(tmp_path_factory, tiny_model_dir):
    """A random one-label Qwen2 reward model on the tiny model's tokenizer, built offline once."""
    from dockrl.models import build_tiny_reward_model

    return build_tiny_reward_model(tmp_path_factory.mktemp("tiny-reward-model"), tiny_model_dir)
