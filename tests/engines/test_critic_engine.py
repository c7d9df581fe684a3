"""The critic's engine: a value head on the policy's backbone (dockrl/engines/critic.py)."""

from __future__ import annotations

import pytest
import torch
from critic_helpers import engine_of, rows

from dockrl.engines.critic import HFCriticEngine


def test_a_value_is_the_head_on_the_state_before_its_token(tiny_model_dir):
    """By hand, one sequence at a time, unpadded: V_t = score(h_{P+t-1}) of the backbone's last hidden state."""
    engine = engine_of(tiny_model_dir)
    prompts, responses = rows(3, 300)
    got = engine.values(prompts, responses, micro_batch=2)  # padded, two micro-batches
    with torch.no_grad():
        for p, r, v in zip(prompts, responses, got):
            hidden = engine.model.model(input_ids=torch.tensor([p + r])).last_hidden_state[0]
            by_hand = engine.model.score(hidden).squeeze(-1)[len(p) - 1 : len(p) - 1 + len(r)]
            assert len(v) == len(r)
            torch.testing.assert_close(torch.tensor(v), by_hand, atol=1e-5, rtol=1e-5)


def test_a_saved_critic_loads_as_it_was_and_a_foreign_vocabulary_is_refused(tiny_model_dir, tmp_path):
    engine = engine_of(tiny_model_dir)
    prompts, responses = rows(2, 300)
    again = HFCriticEngine(engine.save(tmp_path / "critic"), pad_id=engine.pad_id, vocab_size=300)
    assert again.values(prompts, responses, micro_batch=2) == engine.values(prompts, responses, micro_batch=2)
    with pytest.raises(ValueError, match=r"critic.model_path .*a vocabulary of \d+ tokens, the policy's tokenizer has 100000"):
        HFCriticEngine(tiny_model_dir, pad_id=0, vocab_size=100000)


def test_packed_values_equal_right_padded_ones(tiny_model_dir):
    """Sequences of 3 to 9 tokens: the short ones share rows (fewer rows than sequences); every
    value equals the right-padded pass's, and so the gradient of a loss on them."""
    from dockrl.engines.critic import response_values

    engine = engine_of(tiny_model_dir)
    assert engine.pack  # the tiny Qwen2 keeps packed sequences apart
    prompts = [[5, 6, 7, 8, 9], [10], [11, 12], [13], [14, 15, 16]]
    responses = [[20, 21, 22, 23], [24, 25], [26], [27, 28], [29]]
    got = {}
    for pack in (True, False):
        engine.model.zero_grad()
        values, mask = response_values(engine.model, prompts, responses, pad_id=engine.pad_id, autocast_bf16=False, pack=pack)
        (values * mask).pow(2).sum().backward()
        got[pack] = values.detach(), engine.model.score.weight.grad.clone()
    torch.testing.assert_close(got[True][0], got[False][0], atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(got[True][1], got[False][1], atol=1e-5, rtol=1e-4)


def test_a_new_value_head_starts_at_zero_and_learns(tiny_model_dir):
    """From a causal LM the head is new: every value is exactly 0 (a zero baseline), and one
    step on a value loss moves the head, then the backbone gets gradients through it."""
    engine = engine_of(tiny_model_dir, lr=1e-2, random_head=False)
    prompts, responses = rows(3, 300)
    assert all(v == 0.0 for vs in engine.values(prompts, responses, micro_batch=3) for v in vs)

    def loss(start, values, mask):
        return ((values - 1.0) ** 2 * mask).sum() / mask.sum(), None

    for _ in range(2):
        engine.optimizer_step(lambda: (engine.forward_backward(prompts, responses, micro_batch=3, loss_fn=loss), {})[1])
    after = engine.values(prompts, responses, micro_batch=3)
    assert all(v != 0.0 for vs in after for v in vs)
    backbone = next(p for n, p in engine.model.named_parameters() if n.startswith("model.") and p.grad is not None)
    assert backbone.grad.abs().sum() > 0
