"""The critic stage through the dock: values, then the update on the returns (dockrl/stages/critic.py)."""

from __future__ import annotations

import pytest
import torch
from critic_helpers import engine_of, rows

from dockrl.config import AlgorithmConfig, CriticConfig, DockConfig
from dockrl.dock import GRPO_SCHEMA, DockTimeoutError, open_dock
from dockrl.engines.micro_batching import micro_batches
from dockrl.stages.advantage import AdvantageWorker
from dockrl.stages.critic import CriticWorker, accumulate_value_mini_batch


def test_values_then_returns_through_the_dock(tiny_model_dir):
    """The critic puts ``values`` for every row; its update waits for ``returns``, which it claims
    as a second consumer; the first step's loss is ½·mean((V - R)²) (no clipping at V = V_old)."""
    engine = engine_of(tiny_model_dir, lr=1e-4)
    worker = CriticWorker(engine, CriticConfig(enable=True, cliprange_value=0.5), mini_batch=2, micro_batch=3)
    dock = open_dock(DockConfig(timeout_s=2), GRPO_SCHEMA, run="test")
    prompts, responses = rows(8, 300)
    dock.open_iteration(0, 8, 4)
    dock.put(range(8), {"prompt_ids": prompts, "ground_truth": ["1"] * 8})
    dock.put(range(8), {"response_ids": responses})
    assert "timing_s/critic_values" in worker.compute_values(dock)
    values = dock.get(["values"], range(8)).column("values").to_pylist()
    for a, b in zip(values, engine.values(prompts, responses, micro_batch=8)):
        torch.testing.assert_close(torch.tensor(a), torch.tensor(b), atol=1e-5, rtol=1e-5)

    with pytest.raises(DockTimeoutError, match="returns"):  # the advantage stage has not put them yet
        worker.update(dock)
    targets = [[v + (0.25 if i % 2 else -0.5) for v in row] for i, row in enumerate(values)]
    dock.put(range(8), {"returns": targets})
    m = worker.update(dock)
    first_half = [(0.25 if i % 2 else -0.5) ** 2 for i in range(4) for _ in responses[i]]  # mini-batch 1: rows 0-3
    assert m["critic/values_mean"] == pytest.approx(sum(map(sum, values)) / sum(map(len, values)), abs=1e-5)
    assert m["critic/returns_mean"] == pytest.approx(sum(map(sum, targets)) / sum(map(len, targets)), abs=1e-5)
    assert m["critic/grad_norm"] > 0 and m["timing_s/critic"] > 0
    assert not dock.claim("critic_update", ["returns"], 8, timeout_s=1)  # every row acked: the consumer is done
    assert not dock.claim("critic", ["response_ids"], 8, timeout_s=1)

    # the first step by hand: the loss of rows 0-3 at the values before the update
    fresh = engine_of(tiny_model_dir, lr=1e-4)
    batch = {"prompt_ids": prompts[:4], "response_ids": responses[:4], "values": values[:4], "returns": targets[:4]}
    fresh.optimizer.zero_grad()
    step = accumulate_value_mini_batch(fresh, batch, cliprange_value=0.5, micro_batch=3)
    assert step["critic/vf_loss"] == pytest.approx(0.5 * sum(first_half) / len(first_half), rel=1e-4)
    assert step["critic/vf_clipfrac"] == 0.0
    after = engine.values(prompts, responses, micro_batch=8)  # two steps towards the targets
    err = lambda vs: sum(abs(a - b) for v, t in zip(vs, targets) for a, b in zip(v, t))  # noqa: E731
    assert err(after) < err(values)
    dock.close()


def test_the_value_loss_is_clipped_around_the_old_values(tiny_model_dir):
    """Old values far from the current ones (by 2 > ε_v = 0.5) and returns beyond them: the clipped
    term is the larger on every token, and its gradient is 0 (it does not depend on V)."""
    engine = engine_of(tiny_model_dir)
    prompts, responses = rows(4, 300, seed=1)
    now = engine.values(prompts, responses, micro_batch=4)
    batch = {"prompt_ids": prompts, "response_ids": responses, "values": [[v - 2.0 for v in r] for r in now],
             "returns": [[v + 1.0 for v in r] for r in now]}
    engine.optimizer.zero_grad()
    m = accumulate_value_mini_batch(engine, batch, cliprange_value=0.5, micro_batch=4)
    # clip(V, V_old ± 0.5) = V - 1.5, its error to R = V + 1 is 2.5: ½·2.5² on every token
    assert m["critic/vf_clipfrac"] == pytest.approx(1.0)
    assert m["critic/vf_loss"] == pytest.approx(0.5 * 2.5**2, rel=1e-5)
    assert all(p.grad is None or torch.count_nonzero(p.grad) == 0 for p in engine.model.parameters())


@pytest.mark.parametrize("micro, budget", [(2, 0), (6, 30)], ids=["consecutive", "token-budget"])
def test_micro_batches_do_not_change_the_critic_gradient(tiny_model_dir, micro, budget):
    """Against one micro-batch of all rows: micro-batches of 2 consecutive rows, or sorted by length
    at most 30 tokens each (two of 3 rows, not consecutive), give the same loss, gradient and
    values (in the caller's row order)."""
    prompts, responses = rows(6, 300, seed=2)
    if budget:
        lengths = [len(p) + len(r) for p, r in zip(prompts, responses)]
        assert micro_batches(lengths, micro, budget) == [[2, 3, 5], [1, 4, 0]]  # several rows each, out of order
    grads, losses, values_seen = [], [], []
    for m, b in ((6, 0), (micro, budget)):
        engine = engine_of(tiny_model_dir)
        values = engine.values(prompts, responses, micro_batch=m, micro_batch_tokens=b)
        values_seen.append(values)
        batch = {"prompt_ids": prompts, "response_ids": responses, "values": values,
                 "returns": [[v + 0.1 * (i + 1) for v in r] for i, r in enumerate(values)]}
        engine.optimizer.zero_grad()
        losses.append(accumulate_value_mini_batch(engine, batch, cliprange_value=0.5, micro_batch=m, micro_batch_tokens=b)["critic/vf_loss"])
        grads.append({n: p.grad.clone() for n, p in engine.model.named_parameters() if p.grad is not None})
    torch.testing.assert_close(torch.tensor(sum(values_seen[0], [])), torch.tensor(sum(values_seen[1], [])), atol=1e-5, rtol=1e-5)
    assert losses[0] == pytest.approx(losses[1], rel=1e-5)
    assert grads[0].keys() == grads[1].keys() and "score.weight" in grads[0]
    for name in grads[0]:
        torch.testing.assert_close(grads[0][name], grads[1][name], atol=1e-6, rtol=1e-4, msg=name)


def test_the_advantage_stage_turns_the_critics_values_into_gae_returns(tiny_model_dir):
    """critic (values) → advantage (gae, γ = 0.5, λ = 1) → critic update, through the dock. By hand:
    with λ = 1, A_t = G_t - V_t where G_t = γ^(R-1-t)·score (the score on the last token), so the
    returns are G_t whatever the values, and the advantages are A_t whitened over all tokens."""
    engine = engine_of(tiny_model_dir, lr=1e-4)
    worker = CriticWorker(engine, CriticConfig(enable=True), mini_batch=1, micro_batch=4)
    dock = open_dock(DockConfig(timeout_s=5), GRPO_SCHEMA, run="test")
    prompts, _ = rows(4, 300)
    responses = [[5, 6, 7], [8], [9, 10], [11, 12, 13]]
    scores = [1.0, 0.0, 2.0, 1.0]
    dock.open_iteration(0, 4, 2)
    dock.put(range(4), {"prompt_ids": prompts, "ground_truth": ["1"] * 4})
    dock.put(range(4), {"response_ids": responses})
    worker.compute_values(dock)
    dock.put(range(4), {"rm_score": scores, "correct": [True] * 4})
    AdvantageWorker(AlgorithmConfig(adv_estimator="gae", gamma=0.5, lam=1.0)).run_iteration(dock)
    got = dock.get(["values", "returns", "advantages"], range(4)).to_pydict()
    by_hand = [[0.25, 0.5, 1.0], [0.0], [1.0, 2.0], [0.25, 0.5, 1.0]]
    for r, want in zip(got["returns"], by_hand):
        assert r == pytest.approx(want, abs=1e-6)
    a = torch.tensor([g - v for gs, vs in zip(by_hand, got["values"]) for g, v in zip(gs, vs)], dtype=torch.float64)
    whitened = (a - a.mean()) / torch.sqrt(a.var() + 1e-6)  # unbiased variance, algorithm.adv_eps
    assert [x for row in got["advantages"] for x in row] == pytest.approx(whitened.tolist(), abs=1e-4)
    m = worker.update(dock)  # claims the returns: one step per prompt group
    assert m["critic/returns_mean"] == pytest.approx(sum(map(sum, by_hand)) / 9, abs=1e-6)
    dock.close()


def test_explained_variance_by_hand_and_with_equal_returns():
    from dockrl.stages.critic import value_metrics

    m = value_metrics([[0.0, 1.0], [2.0]], [[1.0, 1.0], [4.0]])  # R - V = 1, 0, 2: var 2/3; var R = 2
    assert m["critic/vf_explained_var"] == pytest.approx(1 - (2 / 3) / (2 + 1e-5))
    assert m["critic/values_mean"] == pytest.approx(1.0) and m["critic/returns_mean"] == pytest.approx(2.0)
    same = value_metrics([[0.5, 0.25]], [[1.0, 1.0]])  # every return equal: finite, not a division by zero
    assert same["critic/vf_explained_var"] == pytest.approx(1 - 0.015625 / 1e-5)
