"""The advantage estimators' registry (``dockrl.config.estimators``): its keys are the names mypy knows, and a
toy estimator added by one entry reaches the config rules and a real in-process run."""

from __future__ import annotations

import json
import typing

import pytest
import torch

from dockrl import driver
from dockrl.algorithms.advantages import AdvantageInputs
from dockrl.config import AlgorithmConfig, ConfigError, load_config
from dockrl.config.estimators import ESTIMATORS, AdvEstimator, Estimator

CALLS: list[int] = []
"""Batch sizes the toy estimator was called with (an in-process run calls it in this process)."""


def test_the_literal_is_the_registry():
    assert typing.get_args(AdvEstimator) == tuple(ESTIMATORS)


# The toy estimator: everything a new estimator needs beyond this test is its function and one entry.
def mean_baseline(cfg: AlgorithmConfig, x: AdvantageInputs) -> tuple[torch.Tensor, torch.Tensor]:
    """The score minus its group's mean, on every response token."""
    CALLS.append(len(x.scores))
    groups = x.scores.view(-1, x.group_size)
    adv = (groups - groups.mean(dim=1, keepdim=True)).flatten().float().unsqueeze(1) * x.mask
    return adv, adv


TOY = Estimator(function=f"{__name__}:mean_baseline", grouped=True)


def test_a_toy_estimator_reaches_the_config_rules(monkeypatch):
    with pytest.raises(ConfigError, match="expected one of"):
        load_config(None, ["algorithm.adv_estimator=toy"])
    monkeypatch.setitem(ESTIMATORS, "toy", TOY)
    with pytest.raises(ConfigError, match=r"rollout\.n.*'toy' compares the responses to one prompt"):
        load_config(None, ["algorithm.adv_estimator=toy", "rollout.n=1"])
    with pytest.raises(ConfigError, match=r"kl_in_reward_coef.*'toy' scores whole responses"):
        load_config(None, ["algorithm.adv_estimator=toy", "algorithm.kl_in_reward_coef=0.1"])
    assert load_config(None, ["algorithm.adv_estimator=toy"]).algorithm.adv_estimator == "toy"


@pytest.mark.slow  # one short run of the tiny model
def test_a_toy_estimator_is_one_entry_and_its_function(tiny_model_dir, tmp_path, monkeypatch):
    monkeypatch.setitem(ESTIMATORS, "toy", TOY)
    CALLS.clear()
    cfg = load_config(None, [
        f"model.path={tiny_model_dir}", f"run.output_dir={tmp_path / 'run'}", f"run.cache_dir={tmp_path / 'cache'}",
        "run.progress=false", "trainer.iterations=2", "trainer.global_batch=2", "trainer.mini_batch=2", "trainer.micro_batch=4",
        "rollout.n=4", "rollout.max_response_length=8", "rollout.dtype=float32", "trainer.autocast_bf16=false",
        "trainer.eval_before=false", "trainer.eval_after=false", "data.generate_train=8", "data.generate_test=4", "data.eval_size=4",
        "algorithm.adv_estimator=toy",
    ])
    driver.train(cfg)
    assert CALLS == [8, 8]  # every iteration's whole batch: 2 prompts × 4 samples
    rows = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert [r["iteration"] for r in rows] == [0, 1]
