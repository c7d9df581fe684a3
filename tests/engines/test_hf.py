import pytest
import torch

from dockrl.algorithms import entropy_from_logits
from dockrl.engines.hf.logprobs import pack_rows, pack_sequences, response_log_probs
from dockrl.engines.hf.rollout import HFRolloutEngine
from dockrl.engines.hf.train import HFTrainEngine
from dockrl.engines.micro_batching import micro_batches


@pytest.fixture(scope="module")
def rollout(tiny_model_dir):
    return HFRolloutEngine(tiny_model_dir, dtype="float32")


@pytest.fixture(scope="module")
def prompts(rollout):
    tok = rollout.tokenizer
    questions = ["Tom has 3 apples. How many apples?", "Sara has 12 coins and gets 4 more.", "Ali has 7 cards."]
    return [tok.apply_chat_template([{"role": "user", "content": q}], add_generation_prompt=True, tokenize=True, return_dict=False)
            for q in questions]


def test_rollout_log_probs_match_teacher_forced_pass(tiny_model_dir, rollout, prompts):
    torch.manual_seed(0)
    samples = rollout.generate(prompts, max_new_tokens=12, temperature=0.7)
    trainer = HFTrainEngine(tiny_model_dir, trainable=False, autocast_bf16=False)
    recomputed = trainer.log_probs(prompts, [s.response_ids for s in samples], temperature=0.7, micro_batch=2)
    for s, lp in zip(samples, recomputed):
        assert len(lp) == len(s.response_ids) == len(s.log_probs)
        torch.testing.assert_close(torch.tensor(lp), torch.tensor(s.log_probs), atol=1e-5, rtol=0)


def test_truncated_response_is_flagged_without_fake_eos(rollout, prompts):
    greedy = rollout.generate(prompts[:1], max_new_tokens=4, greedy=True)[0].response_ids
    eos = rollout.eos_id
    try:
        rollout.eos_id = next(t for t in range(len(rollout.tokenizer)) if t not in greedy)
        cut = rollout.generate(prompts[:1], max_new_tokens=4, greedy=True)[0]
        assert cut.truncated and len(cut.response_ids) == 4
        assert rollout.eos_id not in cut.response_ids
        rollout.eos_id = greedy[1]  # the 2nd greedy token now ends the response
        ended = rollout.generate(prompts[:1], max_new_tokens=4, greedy=True)[0]
        assert not ended.truncated
        assert ended.response_ids == greedy[: greedy.index(greedy[1]) + 1]
        assert ended.response_ids[-1] == rollout.eos_id
    finally:
        rollout.eos_id = eos


def test_eos_stays_in_loss_mask_when_pad_equals_eos(rollout):
    eos = rollout.eos_id
    assert rollout.pad_id == eos  # the tiny tokenizer pads with its EOS token
    ids, attention, positions, mask = pack_sequences([[5, 6, 7], [8]], [[9, eos], [eos]], pad_id=eos)
    assert ids[1].tolist() == [8, eos, eos, eos, eos]  # the response EOS, then padding with the same id
    assert mask.tolist() == [[1, 1], [1, 0]]  # every EOS that ends a response counts; padding does not
    assert attention.tolist() == [[1, 1, 1, 1, 1], [1, 1, 0, 0, 0]]
    assert positions.tolist() == [[2, 3], [0, 0]]


def test_weight_sync_copies_every_parameter(tiny_model_dir, rollout):
    actor = HFTrainEngine(tiny_model_dir, trainable=True)
    with torch.no_grad():
        for p in actor.model.parameters():
            p.add_(0.01)
    nbytes = rollout.load_weights(actor.named_weights())
    assert nbytes == sum(p.numel() * 4 for p in actor.model.parameters())
    for (name, a), (_, b) in zip(actor.model.named_parameters(), rollout.model.named_parameters()):
        assert torch.equal(a, b), name
    with pytest.raises(KeyError, match="no parameter named 'nope'"):
        rollout.load_weights([("nope", torch.zeros(1))])


def test_pack_rows_fits_sequences_first_fit_decreasing_into_rows_of_the_longest():
    prompts, responses = [[1, 2], [3], [4, 5, 6], [7]], [[8, 9, 10, 11], [12], [13], [14, 15]]  # lengths 6, 2, 4, 3
    input_ids, position_ids, index, mask = pack_rows(prompts, responses, pad_id=0)
    assert input_ids.tolist() == [[1, 2, 8, 9, 10, 11], [4, 5, 6, 13, 3, 12], [7, 14, 15, 0, 0, 0]]
    assert position_ids.tolist() == [[0, 1, 2, 3, 4, 5], [0, 1, 2, 3, 0, 1], [0, 1, 2, 0, 1, 2]]
    # the logit predicting response token t sits one before it in the flat (R·L) row-major layout
    assert index.tolist() == [[1, 2, 3, 4], [10, 0, 0, 0], [8, 0, 0, 0], [12, 13, 0, 0]]
    assert mask.tolist() == [[1, 1, 1, 1], [1, 0, 0, 0], [1, 0, 0, 0], [1, 1, 0, 0]]


@pytest.mark.parametrize("pack", [True, False], ids=["packed", "right-padded"])
def test_packed_log_probs_and_entropy_equal_each_sequence_alone(tiny_model_dir, pack):
    engine = HFTrainEngine(tiny_model_dir, trainable=True)
    g = torch.Generator().manual_seed(0)
    lengths = [(5, 20), (7, 2), (6, 9), (5, 1), (8, 3)]  # packing saves rows: 25 fits 9+3, 13+4
    V = engine.model.config.vocab_size
    prompts = [torch.randint(3, V, (p,), generator=g).tolist() for p, _ in lengths]
    responses = [torch.randint(3, V, (r,), generator=g).tolist() for _, r in lengths]
    assert pack_rows(prompts, responses, engine.pad_id)[0].shape[0] < len(prompts)
    log_prob, mask, entropy = response_log_probs(engine.model, prompts, responses, pad_id=engine.pad_id, temperature=0.7,
                                                 autocast_bf16=False, with_entropy=True, pack=pack)
    for i, (p, r) in enumerate(zip(prompts, responses)):
        logits = engine.model(input_ids=torch.tensor([p + r])).logits[0, len(p) - 1 : -1].float() / 0.7
        alone = torch.log_softmax(logits, dim=-1).gather(-1, torch.tensor(r).unsqueeze(-1)).squeeze(-1)
        torch.testing.assert_close(log_prob[i, : len(r)], alone, rtol=1e-4, atol=1e-5)
        torch.testing.assert_close(entropy[i, : len(r)], entropy_from_logits(logits), rtol=1e-4, atol=1e-5)
        assert mask[i].sum() == len(r) and (log_prob[i, len(r):] == 0).all()
    log_prob.sum().backward()  # differentiable through the packed rows
    assert all(p.grad is not None for p in engine.model.parameters() if p.requires_grad)


def test_micro_batches_by_hand():
    """Without a token budget, consecutive rows; with one, sorted by length, at most that many tokens each."""
    lengths = [5, 9, 2, 9, 4]  # longest first, ties in the caller's order: rows 1, 3, 0, 4, 2
    assert micro_batches(lengths, 2) == [[0, 1], [2, 3], [4]]
    assert micro_batches(lengths, 5) == [[0, 1, 2, 3, 4]]
    assert micro_batches(lengths, 2, max_tokens=18) == [[1, 3], [0, 4, 2]]  # 2 × 9 = 18; 3 × 5 = 15
    assert micro_batches(lengths, 2, max_tokens=8) == [[1], [3], [0], [4, 2]]  # a row over the budget goes alone
    assert micro_batches([], 2) == []
    with pytest.raises(ValueError, match="micro_batch: got 0"):
        micro_batches(lengths, 0)
    with pytest.raises(ValueError, match="micro_batch_tokens: got -1"):
        micro_batches(lengths, 2, max_tokens=-1)


@pytest.mark.parametrize("micro_batch, budget", [(3, 0), (8, 40), (8, 10)], ids=["rows", "budget", "budget-below-longest"])
def test_log_probs_come_back_in_the_callers_order(tiny_model_dir, micro_batch, budget):
    engine = HFTrainEngine(tiny_model_dir, trainable=False)
    g = torch.Generator().manual_seed(1)
    lengths = [(3, 2), (6, 9), (4, 1), (5, 12), (2, 3), (7, 5), (3, 8)]
    V = engine.model.config.vocab_size
    prompts = [torch.randint(3, V, (p,), generator=g).tolist() for p, _ in lengths]
    responses = [torch.randint(3, V, (r,), generator=g).tolist() for _, r in lengths]
    got = engine.log_probs(prompts, responses, temperature=0.7, micro_batch=micro_batch, micro_batch_tokens=budget)
    for p, r, lp in zip(prompts, responses, got):
        alone = engine.log_probs([p], [r], temperature=0.7, micro_batch=1)[0]
        assert len(lp) == len(r)
        torch.testing.assert_close(torch.tensor(lp), torch.tensor(alone), atol=1e-5, rtol=1e-5)


def test_a_model_that_reads_a_packed_row_as_one_sequence_is_right_padded(tiny_model_dir, monkeypatch):
    from transformers import masking_utils

    assert HFTrainEngine(tiny_model_dir, trainable=False).pack
    monkeypatch.setattr(masking_utils, "find_packed_sequence_indices", lambda position_ids: None)  # packing ignored, like remote code
    assert not HFTrainEngine(tiny_model_dir, trainable=False).pack


def test_gradient_checkpointing_gives_the_same_gradients_and_recomputes_each_layer(tiny_model_dir, prompts, monkeypatch):
    responses = [[5, 6, 7, 8], [9, 10], [11, 12, 13]]

    def gradients(engine):
        def loss_fn(rows, log_probs, *_):
            return -log_probs.sum(), None

        engine.model.zero_grad(set_to_none=True)
        engine.forward_backward(prompts, responses, temperature=1.0, micro_batch=3, loss_fn=loss_fn)
        return {n: p.grad.clone() for n, p in engine.model.named_parameters() if p.requires_grad}

    plain = HFTrainEngine(tiny_model_dir, trainable=True)
    checkpointed = HFTrainEngine(tiny_model_dir, trainable=True, gradient_checkpointing=True)
    layers = checkpointed.model.model.layers
    calls = []
    func = layers[0]._gradient_checkpointing_func
    for layer in layers:  # a fake around transformers' checkpoint function: counts the layers it recomputes
        layer._gradient_checkpointing_func = lambda *a, **k: calls.append(1) or func(*a, **k)
    expected, got = gradients(plain), gradients(checkpointed)
    assert len(calls) == len(layers)  # every decoder layer went through the checkpoint
    assert expected.keys() == got.keys()
    for name in expected:
        torch.testing.assert_close(got[name], expected[name], atol=1e-6, rtol=1e-5, msg=name)
    # every other module stays in eval mode (no dropout), and generating with the shared module keeps its KV cache
    assert not any(m.training for m in checkpointed.model.modules() if m not in set(layers))
    shared = HFRolloutEngine.sharing(checkpointed.model, checkpointed.tokenizer, tiny_model_dir)
    calls.clear()
    shared.generate(prompts[:1], max_new_tokens=3, greedy=True)
    assert calls == [] and all(layer.training for layer in layers)


def test_gradient_checkpointing_refuses_a_model_without_checkpointable_layers():
    from dockrl.engines.hf.train import checkpoint_layers

    with pytest.raises(ValueError, match="trainer.gradient_checkpointing=true: the model at remote/model \\(Linear\\)"):
        checkpoint_layers(torch.nn.Linear(2, 2), "remote/model")  # no decoder layers transformers knows


def test_checkpointed_head_in_chunks_equals_the_whole_head_with_its_gradient():
    from dockrl.engines.hf.logprobs import head_log_probs

    torch.manual_seed(0)
    head = torch.nn.Linear(8, 11, bias=False)
    hidden = torch.randn(7, 8, requires_grad=True)
    targets = torch.randint(0, 11, (7,))
    log_prob, entropy = head_log_probs(head, hidden, targets, temperature=0.7, with_entropy=True, autocast_bf16=False, chunk_tokens=3)
    (log_prob * torch.arange(7.0)).sum().backward()
    got = hidden.grad.clone(), head.weight.grad.clone()
    hidden.grad, head.weight.grad = None, None
    whole = torch.log_softmax(head(hidden) / 0.7, dim=-1)  # by hand: the log-softmax of the whole (7, 11) logits
    expected = whole.gather(-1, targets[:, None]).squeeze(-1)
    (expected * torch.arange(7.0)).sum().backward()
    torch.testing.assert_close(log_prob, expected)
    torch.testing.assert_close(entropy, -(whole.exp() * whole).sum(-1).detach())
    torch.testing.assert_close(got[0], hidden.grad)
    torch.testing.assert_close(got[1], head.weight.grad)
