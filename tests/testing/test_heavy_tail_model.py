"""dockrl/testing/heavy_tail_model.py: the heavy-tailed tiny model samples the lengths its docstring states."""

from __future__ import annotations

import pytest
import torch

from dockrl.testing.heavy_tail_model import HEAVY_TAIL_RATES, HEAVY_TAIL_WEIGHTS, build_heavy_tail_model, heavy_tail_length_pmf


def quantile(lengths: list[int], q: float) -> int:
    return sorted(lengths)[min(int(q * len(lengths)), len(lengths) - 1)]


def test_the_length_distribution_by_hand():
    pmf = heavy_tail_length_pmf(4, rates=(0.5, 0.1), weights=(0.25, 0.75))
    # L = 2: EOS at the first chance; L = 3: one more content token; L = 4 (the limit): the rest
    assert pmf[:2] == [0.0, 0.0]
    assert pmf[2] == pytest.approx(0.25 * 0.5 + 0.75 * 0.1)
    assert pmf[3] == pytest.approx(0.25 * 0.5 * 0.5 + 0.75 * 0.9 * 0.1)
    assert pmf[4] == pytest.approx(0.25 * 0.25 + 0.75 * 0.81)
    assert sum(heavy_tail_length_pmf(64)) == pytest.approx(1.0)


@pytest.mark.parametrize("rates, weights, max_len, match", [
    ((0.5,), (0.5, 0.5), 8, "1 rates and 2 weights"),
    ((0.0, 0.5), (0.5, 0.5), 8, r"expected each in \(0, 1\)"),
    ((0.1, 0.5), (0.6, 0.6), 8, "summing to 1"),
    ((0.1,), (1.0,), 1, "max_len=1"),
])
def test_bad_distributions_are_refused(rates, weights, max_len, match):
    with pytest.raises(ValueError, match=match):
        heavy_tail_length_pmf(max_len, rates, weights)


@pytest.fixture(scope="module")
def heavy_model(tmp_path_factory):
    return build_heavy_tail_model(tmp_path_factory.mktemp("heavy-tail-model"), temperature=0.5)


def test_each_class_ends_at_its_rate(heavy_model):
    """One forward pass over every token: the EOS probability after a content token is its
    class's rate, and the first token's class (after a prompt's end) is drawn by the weights."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from dockrl.run.data import prompt_token_ids

    tokenizer = AutoTokenizer.from_pretrained(heavy_model)
    model = AutoModelForCausalLM.from_pretrained(heavy_model, dtype=torch.float32)
    with torch.no_grad():
        probs = torch.softmax(model(torch.arange(len(tokenizer))[:, None]).logits[:, 0] / 0.5, dim=-1)  # (V, V)
    eos = tokenizer.eos_token_id
    end = prompt_token_ids(tokenizer, "3 + 4", system_prompt="Solve.")[-1]
    content = [t for t in range(len(tokenizer)) if probs[end, t] > 1e-6]
    assert len(content) > 400 and eos not in content and end not in content
    rates = sorted({round(float(probs[t, eos]), 4) for t in content}, reverse=True)
    assert rates == pytest.approx(list(HEAVY_TAIL_RATES), abs=1e-4)
    classes: dict[float, list[int]] = {}  # EOS rate -> the class's tokens
    for t in content:
        classes.setdefault(round(float(probs[t, eos]), 4), []).append(t)
    for rate, members in classes.items():  # a class's token is followed by one of its class or by EOS
        assert probs[members][:, members].sum(dim=-1) == pytest.approx(torch.full((len(members),), 1 - rate), abs=1e-4)
    first = {rate: float(probs[end, members].sum()) for rate, members in classes.items()}  # the response's first class
    assert [first[r] for r in rates] == pytest.approx(list(HEAVY_TAIL_WEIGHTS), abs=1e-4)


@pytest.mark.slow  # 192 samples of up to 48 tokens: ~5 s on one core
def test_sampled_lengths_are_heavy_tailed(heavy_model):
    """The rollout engine's samples, fixed seed: a short median, the tail at the limit."""
    from dockrl.engines.hf.rollout import HFRolloutEngine
    from dockrl.run.data import generate_problems, prompt_token_ids

    engine = HFRolloutEngine(heavy_model, dtype="float32")
    prompts = [prompt_token_ids(engine.tokenizer, p["question"], system_prompt="Solve.") for p in generate_problems(64, seed=0)]
    torch.manual_seed(0)
    samples = engine.generate(prompts * 3, max_new_tokens=48, temperature=0.5, batch_size=192)
    lengths = [len(s.response_ids) for s in samples]
    pmf = heavy_tail_length_pmf(48)
    assert quantile(lengths, 0.5) <= 8 and quantile(lengths, 0.99) == max(lengths) == 48, sorted(lengths)
    assert all(s.truncated == (len(s.response_ids) == 48 and s.response_ids[-1] != engine.eos_id) for s in samples)
    assert sum(lengths) / len(lengths) == pytest.approx(sum(n * p for n, p in enumerate(pmf)), rel=0.2)
    assert sum(s.truncated for s in samples) / len(samples) == pytest.approx(pmf[48], abs=0.06)
