"""No dropout in any log-prob or update forward, whatever dropout the model's config sets.

Qwen2/Llama attention reads ``config.attention_dropout`` and applies it in train mode (not an
``nn.Dropout`` module); GPT-2 has ``nn.Dropout`` modules for ``resid_pdrop``/``embd_pdrop``/
``attn_pdrop``. With any of them on, two ``log_probs`` calls of one policy differed (0.176 nats
with ``attention_dropout=0.1``) and the on-policy ratio was not 1.
"""

from __future__ import annotations

import random

import pytest
import torch
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer, GPT2Config, GPT2LMHeadModel

from dockrl.config import AlgorithmConfig
from dockrl.engines.hf.train import HFTrainEngine
from dockrl.engines.megatron.convert import GPTArch
from dockrl.engines.megatron.model import transformer_config
from dockrl.stages.actor import accumulate_mini_batch


@pytest.fixture(scope="module", params=["qwen2-attention_dropout", "gpt2-pdrop"])
def dropout_model_dir(request, tiny_model_dir, tmp_path_factory):
    out = tmp_path_factory.mktemp(request.param)
    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)
    if request.param.startswith("qwen2"):
        config = AutoConfig.from_pretrained(tiny_model_dir, attention_dropout=0.5)
        model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, config=config)
    else:
        torch.manual_seed(0)
        config = GPT2Config(vocab_size=len(tokenizer), n_embd=64, n_layer=2, n_head=2, n_positions=256, resid_pdrop=0.5,
                            embd_pdrop=0.5, attn_pdrop=0.5, eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.eos_token_id)
        model = GPT2LMHeadModel(config)
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)
    return out


def _batch(engine, n=6):
    rng = random.Random(0)
    vocab = len(engine.tokenizer)
    prompts = [[rng.randrange(3, vocab) for _ in range(rng.randint(3, 9))] for _ in range(n)]
    responses = [[rng.randrange(3, vocab) for _ in range(rng.randint(2, 8))] for _ in range(n)]
    return prompts, responses


def test_log_prob_and_update_forwards_are_deterministic(dropout_model_dir):
    engine = HFTrainEngine(dropout_model_dir, trainable=True, lr=0.0)
    cfg = engine.model.config
    assert any(getattr(cfg, k, 0) == 0.5 for k in ("attention_dropout", "resid_pdrop")), "the model must set a dropout"
    prompts, responses = _batch(engine)
    first = engine.log_probs(prompts, responses, temperature=1.0, micro_batch=3)
    again = engine.log_probs(prompts, responses, temperature=1.0, micro_batch=3)
    assert first == again
    batch = {"prompt_ids": prompts, "response_ids": responses, "advantages": [0.5, -0.5] * 3, "old_log_prob": first}
    metrics = engine.optimizer_step(
        lambda: accumulate_mini_batch(engine, batch, algo=AlgorithmConfig(), temperature=1.0, micro_batch=3)
    )
    # the update's forward (with grad) sees the same policy: ratio exactly 1 on every token
    assert metrics["actor/ratio_max"] == pytest.approx(1.0, abs=1e-6)
    assert metrics["actor/ratio_mean"] == pytest.approx(1.0, abs=1e-6)
    assert metrics["actor/grad_norm"] > 0


def test_megatron_config_has_no_dropout_whatever_the_hf_config_says(tiny_model_dir):
    hf = AutoConfig.from_pretrained(tiny_model_dir, attention_dropout=0.5)
    cfg = transformer_config(GPTArch.from_hf(hf), tp=1, pp=1)
    assert (cfg.hidden_dropout, cfg.attention_dropout) == (0.0, 0.0)
