"""In process, an fp32 HF rollout generates with the actor's module itself: no copy, no sync."""

from __future__ import annotations

import pytest
import torch

from dockrl.config import load_config, resolve_auto
from dockrl.engines import factory
from dockrl.engines.hf.rollout import HFRolloutEngine

PROMPTS = [[1, 2, 3, 4], [5, 6, 7]]


def engines(tiny_model_dir, *overrides: str):
    cfg = resolve_auto(load_config(None, [f"model.path={tiny_model_dir}", "rollout.engine=hf", "trainer.autocast_bf16=false",
                                          "trainer.lr=1e-2", *overrides]))  # the engines are built here, not by a run
    ranks = factory.process_ranks(cfg, trains=True)
    actor = factory.build_train_engine(cfg, tiny_model_dir, ranks)
    return cfg, actor, factory.build_rollout_engine(cfg, tiny_model_dir, ranks, actor=actor)


def test_an_fp32_rollout_shares_the_actors_parameters(tiny_model_dir):
    cfg, actor, rollout = engines(tiny_model_dir, "rollout.dtype=float32")
    assert factory.shares_actor_module(cfg, actor)
    assert rollout.model is actor.model
    assert rollout.load_weights(actor.named_weights()) == 0  # nothing to copy: the very same tensors


def test_a_bf16_rollout_keeps_its_own_copy(tiny_model_dir):
    cfg, actor, rollout = engines(tiny_model_dir, "rollout.dtype=bfloat16")
    assert not factory.shares_actor_module(cfg, actor)
    own = {p.data_ptr() for p in rollout.model.parameters()}
    assert own.isdisjoint(p.data_ptr() for p in actor.model.parameters())
    assert rollout.load_weights(actor.named_weights()) > 0


def test_generation_leaves_the_actors_module_as_it_was(tiny_model_dir):
    _, actor, rollout = engines(tiny_model_dir, "rollout.dtype=float32")
    model = actor.model
    model.train()  # whatever mode the actor keeps, generation gives it back
    ids = torch.tensor([PROMPTS[0]])
    model(input_ids=ids).logits.sum().backward()  # grads exist: generation must neither clear nor add to them
    grads = [p.grad for p in model.parameters()]
    values = [g.clone() for g in grads]
    config, flags = model.generation_config, [p.requires_grad for p in model.parameters()]
    samples = rollout.generate(PROMPTS, max_new_tokens=6, temperature=1.0)
    assert len(samples) == 2 and all(s.response_ids for s in samples)
    assert model.training and model.generation_config is config
    assert [p.requires_grad for p in model.parameters()] == flags and all(flags)
    assert all(g is not None for g in grads) and any(bool(g.abs().sum() > 0) for g in grads)
    assert all(p.grad is g for p, g in zip(model.parameters(), grads))
    assert all(torch.equal(g, v) for g, v in zip(grads, values))
    model.eval()
    rollout.generate(PROMPTS, max_new_tokens=6, greedy=True)
    assert not model.training


def test_after_an_update_generation_samples_the_new_weights_without_a_copy(tiny_model_dir):
    _, actor, rollout = engines(tiny_model_dir, "rollout.dtype=float32")
    before = rollout.generate(PROMPTS, max_new_tokens=6, greedy=True)
    responses = [s.response_ids for s in before]

    def loss_fn(rows, log_prob, mask, entropy):
        return -(log_prob * mask).sum(), None

    def accumulate() -> dict[str, float]:
        actor.forward_backward(PROMPTS, responses, temperature=1.0, micro_batch=2, loss_fn=loss_fn)
        return {}

    actor.optimizer_step(accumulate)
    moved = actor.log_probs(PROMPTS, responses, temperature=1.0, micro_batch=2)
    assert all(sum(m) > sum(b.log_probs) + 1e-3 for m, b in zip(moved, before))  # the step moved the policy
    # no sync: what the rollout samples now, with its log-probs, is the trained actor's
    after = rollout.generate(PROMPTS, max_new_tokens=6, greedy=True)
    trained = actor.log_probs(PROMPTS, [s.response_ids for s in after], temperature=1.0, micro_batch=2)
    for a, t in zip(after, trained):
        assert a.log_probs == pytest.approx(t, abs=1e-5)


def test_sharing_builds_no_second_model(tiny_model_dir, monkeypatch):
    from dockrl.engines.hf import rollout as hf_rollout

    _, actor, _ = engines(tiny_model_dir, "rollout.dtype=float32")
    loads = []
    monkeypatch.setattr(hf_rollout, "load_model", lambda *a, **k: loads.append(a) or torch.nn.Linear(1, 1))
    engine = HFRolloutEngine.sharing(actor.model, actor.tokenizer, tiny_model_dir)
    assert loads == [] and engine.model is actor.model and engine.device == torch.device("cpu")


def test_generation_gives_each_submodule_its_own_mode_back(tiny_model_dir):
    _, actor, rollout = engines(tiny_model_dir, "rollout.dtype=float32")
    model = actor.model
    model.train()
    subs = [m for m in model.modules() if m is not model]
    for i, m in enumerate(subs):  # mixed modes under a root in train mode
        m.training = i % 2 == 0
    before = [m.training for m in model.modules()]
    assert True in before[1:] and False in before[1:]
    rollout.generate(PROMPTS, max_new_tokens=4, greedy=True)
    assert [m.training for m in model.modules()] == before
    model.eval()
    next(iter(subs)).training = True  # and under a root in eval mode
    before = [m.training for m in model.modules()]
    rollout.generate(PROMPTS, max_new_tokens=4, greedy=True)
    assert [m.training for m in model.modules()] == before


def test_load_weights_copies_a_view_of_the_parameter_with_other_strides():
    """Same start, dtype and shape but transposed: not the parameter, so it is copied."""
    model = torch.nn.Linear(3, 3, bias=False)
    engine = HFRolloutEngine.__new__(HFRolloutEngine)
    engine.model = model
    with torch.no_grad():
        model.weight.copy_(torch.arange(9.0).reshape(3, 3))
    w = model.weight
    expected = w.detach().t().clone()
    view = w.detach().t()
    assert view.data_ptr() == w.data_ptr() and view.shape == w.shape and view.stride() != w.stride()
    assert engine.load_weights([("weight", view)]) == 9 * 4
    assert torch.equal(model.weight.detach(), expected)
    assert engine.load_weights([("weight", model.weight.detach())]) == 0  # the very same tensor: nothing copied
    assert torch.equal(model.weight.detach(), expected)
