"""LoRA on the hf engine (``trainer.lora``; ``dockrl.engines.hf.lora``): adapters only train, the
reference is the base model exactly, the rollout gets the current policy, checkpoints are merged
HF weights plus the adapter."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM

from dockrl.checkpoint.optimizer_state import save_optimizer
from dockrl.config import LoraConfig, load_config
from dockrl.engines.factory import build_reference_engine, build_rollout_engine, build_train_engine
from dockrl.engines.hf.lora import ADAPTER_DIR, adapter_numel
from dockrl.engines.hf.rollout import HFRolloutEngine
from dockrl.engines.hf.train import AdaptersDisabled, HFTrainEngine
from dockrl.parallel.ranks import ProcessRanks

PROMPTS = [[5, 6, 7, 8], [9, 10, 11], [12, 13, 14, 15, 16]]
RESPONSES = [[20, 21, 22], [23, 24], [25, 26, 27, 28]]
LORA = LoraConfig(rank=4, alpha=8.0)


def lora_engine(model_dir, lora: LoraConfig = LORA) -> HFTrainEngine:
    torch.manual_seed(0)
    return HFTrainEngine(model_dir, trainable=True, lr=1e-2, lora=lora)


def update(engine: HFTrainEngine) -> None:
    """One optimizer step that raises the responses' log-probs (B, the zero half of each adapter, moves)."""
    def loss_fn(rows, log_prob, mask, entropy):
        return -(log_prob * mask).sum() / mask.sum(), None

    engine.optimizer_step(lambda: (engine.forward_backward(PROMPTS, RESPONSES, temperature=1.0, micro_batch=2, loss_fn=loss_fn), {})[1])


def log_probs(engine) -> list[torch.Tensor]:
    return [torch.tensor(lp) for lp in engine.log_probs(PROMPTS, RESPONSES, temperature=1.0, micro_batch=2)]


def logits(model: torch.nn.Module) -> torch.Tensor:
    ids = torch.tensor([PROMPTS[2] + RESPONSES[2]])
    with torch.no_grad():
        return model(input_ids=ids).logits


def test_only_the_adapters_train_and_the_base_weights_stay(tiny_model_dir):
    engine = lora_engine(tiny_model_dir)
    assert engine.pack, "packing must work on the adapted module (hf_logprobs.packing_works)"
    trained = [n for n, p in engine.model.named_parameters() if p.requires_grad]
    assert trained and all(".lora_A." in n or ".lora_B." in n for n in trained)
    targets = {n.split(".lora_")[0].rsplit(".", 1)[-1] for n in trained}
    assert targets == set(LORA.target_modules)
    in_optimizer = sum(p.numel() for g in engine.optimizer.param_groups for p in g["params"])
    assert in_optimizer == adapter_numel(engine.model) < sum(p.numel() for p in engine.model.parameters()) // 10
    base = {n: p.detach().clone() for n, p in engine.model.named_parameters() if not p.requires_grad}
    adapters = {n: p.detach().clone() for n, p in engine.model.named_parameters() if p.requires_grad}
    update(engine)
    assert all(torch.equal(p, base[n]) for n, p in engine.model.named_parameters() if n in base)
    assert any(not torch.equal(p, adapters[n]) for n, p in engine.model.named_parameters() if n in adapters)


def test_target_modules_by_name_suffix(tiny_model_dir):
    engine = lora_engine(tiny_model_dir, LoraConfig(rank=2, target_modules=("q_proj", "v_proj")))
    trained = {n.split(".lora_")[0].rsplit(".", 1)[-1] for n, p in engine.model.named_parameters() if p.requires_grad}
    assert trained == {"q_proj", "v_proj"}
    with pytest.raises(ValueError, match="no_such_proj"):
        lora_engine(tiny_model_dir, LoraConfig(rank=2, target_modules=("no_such_proj",)))


def test_the_reference_is_the_base_model_exactly_before_and_after_an_update(tiny_model_dir):
    cfg = load_config(None, [f"model.path={tiny_model_dir}", "trainer.lora.rank=4", "rollout.engine=hf", "trainer.autocast_bf16=false",
                             "parallel.device=cpu"])
    ranks = ProcessRanks.alone(cfg.parallel)
    torch.manual_seed(0)
    actor = build_train_engine(cfg, tiny_model_dir, ranks)
    reference = build_reference_engine(cfg, tiny_model_dir, ranks, actor=actor)
    assert isinstance(reference, AdaptersDisabled)  # no second model
    base = HFTrainEngine(tiny_model_dir, trainable=False)
    expected = log_probs(base)
    assert all(torch.equal(a, b) for a, b in zip(log_probs(reference), expected))
    update(actor)
    assert all(torch.equal(a, b) for a, b in zip(log_probs(reference), expected))
    assert any(not torch.allclose(a, b) for a, b in zip(log_probs(actor), expected)), "the update moved the policy"
    assert all(p.requires_grad for n, p in actor.model.named_parameters() if ".lora_" in n)  # adapters back on after the call


def test_the_shared_fp32_rollout_generates_with_the_adapters(tiny_model_dir):
    cfg = load_config(None, [f"model.path={tiny_model_dir}", "trainer.lora.rank=4", "rollout.engine=hf", "rollout.dtype=float32",
                             "trainer.autocast_bf16=false", "parallel.device=cpu"])
    ranks = ProcessRanks.alone(cfg.parallel)
    torch.manual_seed(0)
    actor = build_train_engine(cfg, tiny_model_dir, ranks)
    rollout = build_rollout_engine(cfg, tiny_model_dir, ranks, actor=actor)
    assert isinstance(rollout, HFRolloutEngine) and rollout.model is actor.model
    update(actor)
    samples = rollout.generate(PROMPTS, max_new_tokens=6, temperature=1.0)
    responses = [s.response_ids for s in samples]
    trained = actor.log_probs(PROMPTS, responses, temperature=1.0, micro_batch=3)
    base = actor.reference().log_probs(PROMPTS, responses, temperature=1.0, micro_batch=3)
    for s, lp in zip(samples, trained):
        torch.testing.assert_close(torch.tensor(s.log_probs), torch.tensor(lp), atol=1e-5, rtol=0)
    assert any(not torch.allclose(torch.tensor(lp), torch.tensor(ref)) for lp, ref in zip(trained, base))


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_a_rollout_copy_gets_the_merged_policy_on_sync(tiny_model_dir, dtype):
    actor = lora_engine(tiny_model_dir)
    update(actor)
    rollout = HFRolloutEngine(tiny_model_dir, dtype=dtype)
    before = dict((n, p.detach().clone()) for n, p in actor.model.named_parameters())
    copied = rollout.load_weights(actor.named_weights())
    assert copied == sum(p.numel() * p.element_size() for p in rollout.model.parameters())
    assert all(torch.equal(p, before[n]) for n, p in actor.model.named_parameters())  # the sync leaves the actor as it was
    if dtype == "float32":
        torch.testing.assert_close(logits(rollout.model), logits(actor.model), atol=1e-5, rtol=0)
    else:  # a bf16 copy holds the merged weights rounded once
        merged = dict(actor.named_weights())
        assert all(torch.equal(p, merged[n].to(torch.bfloat16)) for n, p in rollout.model.named_parameters())


def test_the_checkpoint_is_merged_hf_weights_plus_the_adapter(tiny_model_dir, tmp_path):
    actor = lora_engine(tiny_model_dir)
    update(actor)
    folder = actor.save(tmp_path / "ckpt")
    optimizer = save_optimizer(actor, folder)
    reloaded = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
    assert not any("lora" in n or "base_layer" in n for n, _ in reloaded.named_parameters())
    torch.testing.assert_close(logits(reloaded), logits(actor.model), atol=1e-5, rtol=0)
    adapter = folder / ADAPTER_DIR
    assert (adapter / "adapter_config.json").is_file() and (adapter / "adapter_model.safetensors").is_file()
    full = (folder / "model.safetensors").stat().st_size
    assert (adapter / "adapter_model.safetensors").stat().st_size < full // 10
    state = torch.load(optimizer, weights_only=True)["state"]
    assert len(state) == sum(1 for n, _ in actor.model.named_parameters() if ".lora_" in n)  # the adapters' moments only

    from peft import PeftModel

    base = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32)
    with_adapter = PeftModel.from_pretrained(base, adapter)
    torch.testing.assert_close(logits(with_adapter), logits(actor.model), atol=1e-5, rtol=0)
