"""DAPO in distributed mode: the rollout, reward (with the advantage) and actor as processes, dynamic
sampling through the dock; the trained batch is exactly the configured one, and a dataset the model
always solves fails the run within the bound of rollout rounds."""

from __future__ import annotations

import json
import math
import os
import time
from pathlib import Path

import pytest

from dockrl import driver
from dockrl.config import load_config
from dockrl.launch.backend import WorkerFailed

FAKES = Path(__file__).parents[1]  # tests/fake_scorers.py, importable by the worker processes


@pytest.fixture
def fakes_path(monkeypatch):
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join(p for p in [str(FAKES), os.environ.get("PYTHONPATH", "")] if p))


def dapo_config(tiny_model_dir, tmp_path: Path, *extra: str):
    return load_config(None, [
        f"model.path={tiny_model_dir}", f"run.output_dir={tmp_path / 'run'}", f"run.cache_dir={tmp_path / 'cache'}",
        "run.progress=false", "dock.mode=distributed", "dock.timeout_s=60", "trainer.iterations=2", "trainer.global_batch=4",
        "trainer.mini_batch=2", "trainer.micro_batch=4", "rollout.n=4", "rollout.max_response_length=12",
        "rollout.dtype=float32", "trainer.autocast_bf16=false", "trainer.lr=1e-2", "trainer.save_every=0",
        "trainer.eval_before=false", "trainer.eval_after=false", "data.generate_train=40", "data.generate_test=8",
        "data.eval_size=8", "algorithm.filter_groups.enable=true", "algorithm.filter_groups.max_num_gen_batches=3", *extra,
    ])


@pytest.mark.slow
def test_dapo_processes_train_exactly_the_configured_batch(tiny_model_dir, tmp_path, fakes_path):
    cfg = dapo_config(tiny_model_dir, tmp_path, "algorithm.scorer=fake_scorers:FakeRandomScorer", "algorithm.kl_loss_coef=0.05",
                      "algorithm.overlong_buffer.enable=true", "algorithm.overlong_buffer.len=4")
    driver.train(cfg)
    lines = [json.loads(x) for x in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert [x["iteration"] for x in lines] == [0, 1]
    for m in lines:
        assert m["actor/sequences"] == 16 and 1 <= m["rollout/gen_batches"] <= 3
        assert m["rollout/responses"] == m["rollout/gen_batches"] * 16
        assert math.isfinite(m["actor/loss"]) and m["timing_s/reference"] > 0


@pytest.mark.slow
def test_a_dataset_the_model_always_solves_fails_the_run_within_the_bound(tiny_model_dir, tmp_path, fakes_path):
    cfg = dapo_config(tiny_model_dir, tmp_path, "algorithm.scorer=fake_scorers:FakeSolvedScorer")
    start = time.monotonic()
    with pytest.raises(WorkerFailed) as err:
        driver.train(cfg)
    assert err.value.member == "reward-0"
    assert "DynamicSamplingExhausted" in err.value.log_tail and "max_num_gen_batches=3" in err.value.log_tail
    assert "DynamicSamplingExhausted" in str(err.value).splitlines()[0]  # the stage's own reason is the first line
    assert time.monotonic() - start < 120  # well before dock.timeout_s would let any stage give up waiting
