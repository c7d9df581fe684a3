"""A distributed LoRA run (``trainer.lora`` with ``dock.mode=distributed``): the actor process sends the
adapter tensors alone over the weight channel, the rollout process's copy then samples with the
actor's policy, and the run continues from its final checkpoint (``run.resume``: adapter and optimizer)."""

from __future__ import annotations

import pytest
from safetensors.torch import load_file
from test_distributed import workers_path  # noqa: F401 - fixture: fake scorers importable, no process left behind
from test_distributed_resume import read_rows, run_config

from dockrl import driver
from dockrl.engines.hf.lora import ADAPTER_DIR
from dockrl.checkpoint.resume import final_dir

LORA = ("trainer.lora.rank=4", "trainer.lora.alpha=8", "rollout.engine=hf", "algorithm.scorer=fake_scorers:FakeHashScorer",
        "algorithm.entropy_coeff=0.01", "trainer.save_every=0")


@pytest.mark.slow  # two distributed runs of the tiny model
def test_a_distributed_lora_run_sends_adapters_and_resumes(tiny_model_dir, tmp_path, workers_path):  # noqa: F811 - the fixture
    driver.train(run_config(tiny_model_dir, tmp_path, "run", *LORA, "trainer.iterations=2"))
    run = tmp_path / "run"
    adapter = load_file(final_dir(run) / ADAPTER_DIR / "adapter_model.safetensors")
    adapter_bytes = sum(t.numel() for t in adapter.values()) * 4
    full_bytes = (final_dir(run) / "model.safetensors").stat().st_size
    driver.train(run_config(tiny_model_dir, tmp_path, "run", *LORA, "trainer.iterations=3", "run.resume=latest"))
    rows = read_rows(run)
    assert [r["iteration"] for r in rows] == [0, 1, 2]
    for r in rows:
        assert r["weight_sync/bytes"] == adapter_bytes < full_bytes / 10  # the fp32 adapter over the channel, nothing else
        # the fp32 rollout copy sampled with the actor's current policy (a missed or stale adapter: ~1e-1)
        assert r["actor/rollout_log_prob_diff_max"] < 1e-4, (r["iteration"], r["actor/rollout_log_prob_diff_max"])
    resumed = load_file(final_dir(run) / ADAPTER_DIR / "adapter_model.safetensors")
    assert any(not (resumed[k] == t).all() for k, t in adapter.items()), "the resumed run trained the adapter on"
