"""An in-process GRPO run with LoRA (``trainer.lora``) on the tiny model: it completes, only the
adapters train (the base weights stay the initial model's), the reference is the base model, and
the checkpoint is the merged policy plus the adapter."""

from __future__ import annotations

import json
import time

import pytest
import torch
from safetensors.torch import load_file

from dockrl import driver
from dockrl.config import load_config
from dockrl.engines.hf.lora import ADAPTER_DIR


@pytest.mark.slow  # one short run of the tiny model
def test_a_lora_grpo_run_trains_the_adapters_only(tiny_model_dir, tmp_path):
    run = tmp_path / "run"
    cfg = load_config(None, [
        f"model.path={tiny_model_dir}", f"run.output_dir={run}", f"run.cache_dir={tmp_path / 'cache'}",
        "run.progress=false", "trainer.iterations=2", "trainer.global_batch=2", "trainer.mini_batch=2", "trainer.micro_batch=4",
        "rollout.n=4", "rollout.max_response_length=8", "rollout.engine=hf", "rollout.dtype=bfloat16", "trainer.autocast_bf16=false",
        "trainer.eval_before=false", "trainer.eval_after=false", "data.generate_train=8", "data.generate_test=4", "data.eval_size=4",
        "trainer.lr=1e-2", "algorithm.kl_loss_coef=0.1", "algorithm.entropy_coeff=0.01", "trainer.lora.rank=4", "trainer.lora.alpha=8",
    ])
    start = time.perf_counter()
    driver.train(cfg)
    wall = time.perf_counter() - start
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert [r["iteration"] for r in rows] == [0, 1]
    for r in rows:
        assert r["timing_s/reference"] > 0  # the base model scored
        assert all(v == v for v in r.values() if isinstance(v, float)), "no NaN metric"
    assert rows[0]["actor/kl"] == pytest.approx(0.0, abs=1e-6)  # the first update's policy is the base model

    initial = load_file(tiny_model_dir / "model.safetensors")
    final = run / "checkpoints" / "final"
    merged = load_file(final / "model.safetensors")
    adapter = load_file(final / ADAPTER_DIR / "adapter_model.safetensors")
    a_b = {}
    for k, t in adapter.items():  # base_model.model.<layer>.lora_A.weight: (rank, in); lora_B: (out, rank)
        layer, part = k.removeprefix("base_model.model.").split(".lora_")
        a_b.setdefault(f"{layer}.weight", {})[part.split(".")[0]] = t
    assert a_b and set(merged) == set(initial)
    scale = cfg.trainer.lora.alpha / cfg.trainer.lora.rank
    for name, w in initial.items():  # the base weights are the initial ones: merged = W0 + scale·B·A, the rest W0 exactly
        if name in a_b:
            torch.testing.assert_close(merged[name], w + scale * a_b[name]["B"] @ a_b[name]["A"], atol=1e-6, rtol=0)
        else:
            assert torch.equal(merged[name], w), name
    assert any(torch.count_nonzero(ab["B"]) for ab in a_b.values()), "the adapters trained"
    adapter_bytes = sum(t.numel() for t in adapter.values()) * 4
    assert all(r["weight_sync/bytes"] == adapter_bytes for r in rows)  # the bf16 copy got the fp32 adapter alone (trainer.lora.sync)
    # the random tiny model rarely earns a reward: the entropy bonus gives every step a gradient
    print(f"LoRA run: {wall:.1f} s wall; adapter {sum(t.numel() for t in adapter.values())} parameters, "
          f"{(final / ADAPTER_DIR / 'adapter_model.safetensors').stat().st_size} bytes vs "
          f"{(final / 'model.safetensors').stat().st_size} bytes of merged weights")
