"""The adapter-only weight sync of a LoRA run (``trainer.lora.sync``): the HF rollout copy holds the
base weights and the actor's adapters, each sync moves the adapter tensors alone, and after each
sync the rollout's logits equal the actor's (fp32, 1e-5)."""

from __future__ import annotations

import logging

import pytest
import torch
from test_lora import LORA, PROMPTS, logits, lora_engine, update

from dockrl.config import ConfigError, LoraConfig, load_config
from dockrl.engines.factory import build_rollout_engine, build_train_engine, receive_params, weights_to_send
from dockrl.engines.hf.lora import adapter_numel
from dockrl.engines.hf.rollout import HFRolloutEngine
from dockrl.parallel.ranks import ProcessRanks


def lora_cfg(model_dir, *overrides: str):
    return load_config(None, [f"model.path={model_dir}", "trainer.lora.rank=4", "trainer.lora.alpha=8", "rollout.engine=hf",
                              "trainer.autocast_bf16=false", "parallel.device=cpu", *overrides])


def test_each_adapter_sync_gives_the_rollout_copy_the_actors_logits(tiny_model_dir):
    actor = lora_engine(tiny_model_dir)
    rollout = HFRolloutEngine(tiny_model_dir, dtype="float32", lora=LORA)
    base = {n: p.detach().clone() for n, p in rollout.model.named_parameters() if ".lora_" not in n}
    torch.testing.assert_close(logits(rollout.model), logits(actor.model), atol=1e-5, rtol=0)  # B = 0 on both: the base model
    adapter_bytes = adapter_numel(actor.model) * 4
    for _ in range(2):
        update(actor)
        assert not torch.allclose(logits(rollout.model), logits(actor.model), atol=1e-5), "the update moved the policy"
        assert rollout.load_weights(actor.adapter_weights()) == adapter_bytes
        torch.testing.assert_close(logits(rollout.model), logits(actor.model), atol=1e-5, rtol=0)
        samples = rollout.generate(PROMPTS, max_new_tokens=5, temperature=1.0)
        trained = actor.log_probs(PROMPTS, [s.response_ids for s in samples], temperature=1.0, micro_batch=3)
        for s, lp in zip(samples, trained):
            torch.testing.assert_close(torch.tensor(s.log_probs), torch.tensor(lp), atol=1e-5, rtol=0)
    assert all(torch.equal(p, base[n]) for n, p in rollout.model.named_parameters() if n in base), "the base weights never move"
    merged_bytes = sum(t.numel() * 4 for _, t in actor.named_weights())
    assert adapter_bytes < merged_bytes / 10  # the tiny model: 4.6% of its weights at rank 4


def test_a_bf16_copy_keeps_fp32_adapters_and_its_base_weights(tiny_model_dir):
    actor = lora_engine(tiny_model_dir)
    update(actor)
    rollout = HFRolloutEngine(tiny_model_dir, dtype="bfloat16", lora=LORA)
    assert {p.dtype for n, p in rollout.model.named_parameters() if ".lora_" in n} == {torch.float32}
    rollout.load_weights(actor.adapter_weights())
    sent = dict(actor.adapter_weights())
    assert all(torch.equal(p, sent[n]) for n, p in rollout.model.named_parameters() if ".lora_" in n)
    torch.testing.assert_close(logits(rollout.model).float(), logits(actor.model), atol=0.1, rtol=0)  # bf16 base weights, one rounding each


def test_the_rollout_adapters_leave_torchs_generator_as_it_was(tiny_model_dir):
    torch.manual_seed(3)
    HFRolloutEngine(tiny_model_dir, dtype="float32", lora=LORA)
    after = torch.rand(4)
    torch.manual_seed(3)
    assert torch.equal(torch.rand(4), after)


def test_the_factory_sends_adapters_or_merged_weights_by_config(tiny_model_dir, caplog):
    cfg = lora_cfg(tiny_model_dir, "rollout.dtype=bfloat16")
    ranks = ProcessRanks.alone(cfg.parallel)
    actor = build_train_engine(cfg, tiny_model_dir, ranks)
    rollout = build_rollout_engine(cfg, tiny_model_dir, ranks, actor=actor)
    named, dtype = weights_to_send(cfg, actor)
    names = [n for n, _ in named]
    assert dtype == torch.float32 and names and all(".lora_" in n for n in names)
    assert [n for n, _ in receive_params(rollout, cfg, tiny_model_dir)] == names  # the channel's receiving side: the same list

    merged_cfg = lora_cfg(tiny_model_dir, "rollout.dtype=bfloat16", "trainer.lora.sync=merged")
    with caplog.at_level(logging.WARNING, logger="dockrl.engines.factory"):
        merged_actor = build_train_engine(merged_cfg, tiny_model_dir, ranks)
    assert "trainer.lora.sync=merged" in caplog.text and "adapter parameters" in caplog.text
    copy = build_rollout_engine(merged_cfg, tiny_model_dir, ranks, actor=merged_actor)
    assert not any(".lora_" in n for n, _ in copy.model.named_parameters())
    named, dtype = weights_to_send(merged_cfg, merged_actor)
    assert dtype == torch.bfloat16 and [n for n, _ in named] == [n for n, _ in copy.model.named_parameters()]


def test_sync_is_a_lora_field():
    with pytest.raises(ConfigError, match=r"trainer.lora.sync: got 'merged'; is set but trainer.lora.rank is 0"):
        load_config(None, ["trainer.lora.sync=merged"])
    with pytest.raises(ConfigError, match=r"trainer.lora.sync: got 'both'"):
        load_config(None, ["trainer.lora.rank=4", "rollout.engine=hf", "trainer.lora.sync=both"])
    assert LoraConfig().sync == "adapter"
