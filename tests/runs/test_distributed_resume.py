"""A distributed run killed mid-iteration resumes from its last checkpoint to the uninterrupted result."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch
from test_distributed import workers_path  # noqa: F401 - fixture: fake scorers importable, no process left behind
from transformers import AutoModelForCausalLM

from dockrl import driver
from dockrl.config import load_config
from dockrl.launch.backend import WorkerFailed
from dockrl.checkpoint.resume import checkpoint_dir

ROWS_PER_ITERATION = 4 * 4  # trainer.global_batch × rollout.n
VARYING = ("timing_s/", "perf/", "dock/", "memory/", "weight_sync/seconds", "rollouts/wait_s")
"""Metrics that depend on the clock or count a process's traffic: not compared between runs."""
SAME_THREADS = "run.num_threads=1"
"""For runs compared across processes: one torch thread in the driver and in every stage process,
so that their reductions add in the same order and the runs agree to the bit where they compute the
same (a stage process takes torch's default, the test process whatever an earlier test left)."""
TOKEN_SHARES = ("clip_ratio", "clip_frac", "clipfrac")
"""Shares of tokens past a clip threshold: a step function of log-probs or values, so rounding that
differs between processes (their thread counts, hence their reduction order) can move a token across
the threshold. Compared to within 0.05 (3 tokens of a 64-token batch), every other metric to fp32 rounding."""


def metric_close(key: str, x: float, y: float) -> bool:
    """Whether two runs' values of the metric ``key`` agree (see ``TOKEN_SHARES``)."""
    if key.endswith(TOKEN_SHARES):
        return abs(x - y) <= 0.05
    return math.isclose(x, y, rel_tol=1e-4, abs_tol=1e-6)


def read_rows(run: Path) -> list[dict]:
    return [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]


def same_rows(a: list[dict], b: list[dict]) -> None:
    """Equal iteration indexes; every metric but the clock's and the traffic counters' equal to fp32 rounding."""
    assert [x["iteration"] for x in a] == [x["iteration"] for x in b]
    for x, y in zip(a, b):
        keys = sorted(k for k in x if not k.startswith(VARYING))
        assert keys == sorted(k for k in y if not k.startswith(VARYING))
        for k in keys:
            assert metric_close(k, x[k], y[k]), (x["iteration"], k, x[k], y[k])


def run_config(tiny_model_dir, tmp_path, name: str, *extra: str):
    return load_config(None, [
        f"model.path={tiny_model_dir}", f"run.output_dir={tmp_path / name}", f"run.cache_dir={tmp_path / 'cache'}",
        "run.progress=false", "dock.mode=distributed", "dock.shards=2", "dock.timeout_s=120",
        "trainer.iterations=3", "trainer.global_batch=4", "trainer.mini_batch=2", "trainer.micro_batch=4", "rollout.n=4",
        "rollout.max_response_length=12", "rollout.dtype=float32", "trainer.autocast_bf16=false", "trainer.lr=1e-2",
        "trainer.save_every=1", "trainer.eval_before=false", "algorithm.kl_loss_coef=0",
        "data.generate_train=40", "data.generate_test=8", "data.eval_size=8", SAME_THREADS, *extra,
    ])


@pytest.mark.slow  # three distributed runs of the tiny model: ~1-3 min on 2 busy cores
def test_a_run_killed_mid_iteration_resumes_without_losing_or_repeating_rows(tiny_model_dir, tmp_path, workers_path, monkeypatch):  # noqa: F811
    driver.train(run_config(tiny_model_dir, tmp_path, "straight", "algorithm.scorer=fake_scorers:FakeHashScorer"))

    # the reward process kills itself as it starts scoring iteration 2: the checkpoint after iteration 1 is complete
    monkeypatch.setenv("FAKE_KILL_AFTER_ROWS", str(2 * ROWS_PER_ITERATION))
    with pytest.raises(WorkerFailed) as err:
        driver.train(run_config(tiny_model_dir, tmp_path, "cut", "algorithm.scorer=fake_scorers:FakeKillingScorer"))
    assert err.value.member == "reward-0"
    cut = tmp_path / "cut"
    assert [x["iteration"] for x in read_rows(cut)] == [0, 1]
    state = json.loads((checkpoint_dir(cut, 2) / "driver_state.json").read_text())
    assert (state["next_iteration"], state["open_iteration"]) == (2, 2)  # the snapshot holds iteration 2's prompts
    assert (checkpoint_dir(cut, 2) / "optimizer.pt").is_file()

    driver.train(run_config(tiny_model_dir, tmp_path, "cut", "algorithm.scorer=fake_scorers:FakeHashScorer", "run.resume=latest"))
    rows = read_rows(cut)
    assert [x["iteration"] for x in rows] == [0, 1, 2]
    same_rows(rows, read_rows(tmp_path / "straight"))
    resumed = AutoModelForCausalLM.from_pretrained(cut / "checkpoints" / "final").state_dict()
    straight = AutoModelForCausalLM.from_pretrained(tmp_path / "straight" / "checkpoints" / "final").state_dict()
    for name, p in straight.items():
        torch.testing.assert_close(resumed[name], p, rtol=1e-5, atol=1e-6, msg=name)
    # the actor wrote final's optimizer, the driver its state: a finished run continues from there
    final = cut / "checkpoints" / "final"
    state = json.loads((final / "driver_state.json").read_text())
    assert (state["next_iteration"], state["open_iteration"], state["dock_snapshot"]) == (3, None, "")
    assert {float(v["step"]) for v in torch.load(final / "optimizer.pt", weights_only=True)["state"].values()} == {6.0}
