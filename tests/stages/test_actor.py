import math
import random

import pytest
import torch

from dockrl.algorithms import policy_loss
from dockrl.config import AlgorithmConfig
from dockrl.engines.hf.logprobs import response_log_probs
from dockrl.engines.hf.train import HFTrainEngine
from dockrl.stages.actor import accumulate_mini_batch, rollout_log_prob_diff, rollout_mismatch


def _batch(engine, n=8, kl=False, seed=0):
    rng = random.Random(seed)
    vocab = len(engine.tokenizer)
    prompts = [[rng.randrange(3, vocab) for _ in range(rng.randint(3, 9))] for _ in range(n)]
    responses = [[rng.randrange(3, vocab) for _ in range(rng.randint(1, 7))] + [engine.pad_id] for _ in range(n)]
    batch = {"prompt_ids": prompts, "response_ids": responses, "advantages": [rng.uniform(-1, 1) for _ in range(n)]}
    batch["old_log_prob"] = engine.log_probs(prompts, responses, temperature=1.0, micro_batch=n)
    if kl:
        batch["ref_log_prob"] = [[x + rng.uniform(-0.3, 0.3) for x in lp] for lp in batch["old_log_prob"]]
    return batch


def test_first_on_policy_update_has_ratio_one(tiny_model_dir):
    engine = HFTrainEngine(tiny_model_dir, trainable=True)
    batch = _batch(engine)
    m = accumulate_mini_batch(engine, batch, algo=AlgorithmConfig(), temperature=1.0, micro_batch=4)
    assert abs(m["actor/ratio_mean"] - 1.0) < 1e-6
    assert abs(m["actor/ratio_max"] - 1.0) < 1e-6
    assert m["actor/clip_ratio"] == 0.0


@pytest.mark.parametrize("loss_agg, kl_coef, extra", [
    ("token-mean", 0.0, {}),
    ("seq-mean-token-mean", 0.1, {}),
    ("seq-mean-token-sum-norm", 0.1, {"kl_loss_type": "mse"}),
    ("seq-mean-token-mean", 0.0, {"ratio_level": "sequence", "clip_ratio_c": 1.5, "tis_cap": 1.1, "entropy_coeff": 0.01}),
], ids=["token-mean", "seq-mean-token-mean", "dr_grpo_norm", "gspo_dual_clip_tis_entropy"])
def test_micro_batch_size_does_not_change_loss_or_gradients(tiny_model_dir, loss_agg, kl_coef, extra):
    algo = AlgorithmConfig(loss_agg_mode=loss_agg, kl_loss_coef=kl_coef, **extra)
    results = []
    for micro in (1, 4):
        engine = HFTrainEngine(tiny_model_dir, trainable=True)
        batch = _batch(engine, kl=kl_coef > 0)
        # a second, shifted view so the ratio is not 1 and the clip and KL paths are exercised
        batch["old_log_prob"] = [[x - 0.25 for x in lp] for lp in batch["old_log_prob"]]
        batch["rollout_log_prob"] = [[x - 0.1 for x in lp] for lp in batch["old_log_prob"]]
        engine.optimizer.zero_grad()
        m = accumulate_mini_batch(engine, batch, algo=algo, temperature=1.0, micro_batch=micro, horizon=16)
        results.append((m, {n: p.grad.clone() for n, p in engine.model.named_parameters() if p.grad is not None}))
    (m1, g1), (m4, g4) = results
    assert m1["actor/loss"] == pytest.approx(m4["actor/loss"], abs=1e-6)
    assert m1["actor/clip_ratio"] > 0
    assert g1.keys() == g4.keys() and len(g1) > 0
    for name in g1:
        torch.testing.assert_close(g1[name], g4[name], atol=1e-6, rtol=0, msg=name)


def _consecutive(lengths, micro_batch, max_tokens=0):
    """Micro-batches of consecutive rows, whatever the token budget."""
    return [list(range(s, min(s + micro_batch, len(lengths)))) for s in range(0, len(lengths), micro_batch)]


def _by_length(lengths, micro_batch, max_tokens=0):
    """Micro-batches of ``micro_batch`` rows sorted by length, longest first, whatever the token budget."""
    order = sorted(range(len(lengths)), key=lambda i: -lengths[i])
    return [order[s : s + micro_batch] for s in range(0, len(order), micro_batch)]


@pytest.mark.parametrize("on_policy", [False, True], ids=["off-policy", "on-policy"])
@pytest.mark.parametrize("loss_agg, extra", [
    ("token-mean", {"kl_loss_coef": 0.1, "overlong_filter": True}),
    ("seq-mean-token-mean", {"ratio_level": "sequence", "clip_ratio_c": 1.5, "tis_cap": 1.1, "entropy_coeff": 0.01}),
    ("seq-mean-token-sum-norm", {}),
], ids=["token-mean_kl_overlong", "gspo_dual_clip_tis_entropy", "dr_grpo_norm"])
def test_micro_batches_by_length_give_the_loss_and_gradient_of_consecutive_ones(tiny_model_dir, monkeypatch, on_policy, loss_agg, extra):
    """Micro-batches of rows sorted by length (``micro_batch`` rows each, or the engine's under a
    token budget: more or fewer of them) give the loss, the metrics, the gradient and the
    on-policy old log-probs (in the mini-batch's row order) of micro-batches of consecutive rows
    (the engine's default), up to float rounding."""
    from dockrl.engines import micro_batching

    algo = AlgorithmConfig(loss_agg_mode=loss_agg, **extra)
    results = {}
    for mode in ("consecutive", "by length", "token budget"):
        engine = HFTrainEngine(tiny_model_dir, trainable=True)
        batch = _batch(engine, n=12, kl=True, seed=3)
        rng = random.Random(4)  # heavy-tailed response lengths, so that sorting changes the micro-batches
        batch["response_ids"] = [r * rng.choice([1, 1, 2, 6]) for r in batch["response_ids"]]
        batch["ref_log_prob"] = [[-1.0] * len(r) for r in batch["response_ids"]]
        batch["truncated"] = [i % 5 == 0 for i in range(12)]
        if on_policy:
            del batch["old_log_prob"]
        else:
            batch["old_log_prob"] = [[x - 0.25 for x in lp] for lp in engine.log_probs(
                batch["prompt_ids"], batch["response_ids"], temperature=1.0, micro_batch=12)]
        batch["rollout_log_prob"] = [[-2.0] * len(r) for r in batch["response_ids"]]
        lengths = [len(p) + len(r) for p, r in zip(batch["prompt_ids"], batch["response_ids"])]
        assert micro_batching.micro_batches(lengths, 4) == _consecutive(lengths, 4)  # the default
        assert _by_length(lengths, 4) != _consecutive(lengths, 4)
        assert micro_batching.micro_batches(lengths, 4, 60) not in (_consecutive(lengths, 4), _by_length(lengths, 4))
        with monkeypatch.context() as patch:
            if mode == "by length":
                patch.setattr(micro_batching, "micro_batches", _by_length)
            engine.optimizer.zero_grad()
            m = accumulate_mini_batch(engine, batch, algo=algo, temperature=1.0, micro_batch=4, horizon=32,
                                      micro_batch_tokens=60 if mode == "token budget" else 0)
        grads = {n: p.grad.clone() for n, p in engine.model.named_parameters() if p.grad is not None}
        results[mode] = m, grads, batch["old_log_prob"]
    m0, g0, old0 = results["consecutive"]
    assert len(g0) > 0
    for mode in ("by length", "token budget"):
        m, g, old = results[mode]
        assert m.keys() == m0.keys()
        for k in m0:
            assert m[k] == pytest.approx(m0[k], rel=1e-5, abs=1e-6), (mode, k)
        assert g.keys() == g0.keys()
        for name in g0:
            torch.testing.assert_close(g[name], g0[name], atol=1e-6, rtol=1e-5, msg=f"{mode}: {name}")
        assert [len(r) for r in old] == [len(r) for r in old0]
        torch.testing.assert_close(torch.tensor(sum(old, [])), torch.tensor(sum(old0, [])), atol=1e-5, rtol=0)


def test_rollout_log_prob_diff_by_hand():
    got = rollout_log_prob_diff([[-1.0, -2.0], [-0.5]], [[-1.5, -2.0], [-0.25]])
    assert got == {"actor/rollout_log_prob_diff_mean": 0.25, "actor/rollout_log_prob_diff_max": 0.5}


def test_rollout_mismatch_by_hand():
    # ρ = π_old/π_rollout of the three tokens: e^-0.5, 1, e^0.25; update 2 trains on versions 2, 2 | 1
    got = rollout_mismatch([[-1.0, -2.0], [-0.5]], [[-1.5, -2.0], [-0.25]], [[2, 2], [1]], iteration=2, cap=1.2)
    k3 = [math.exp(x) - x - 1 for x in (-0.5, 0.0, 0.25)]
    assert got == {"actor/rollout_kl_k3": pytest.approx(sum(k3) / 3), "actor/rollout_ratio_max": pytest.approx(math.exp(0.25)),
                   "actor/rollout_frac_beyond_cap": pytest.approx(1 / 3), "actor/rollout_staleness_mean": pytest.approx(1 / 3),
                   "actor/rollout_staleness_max": 1.0}
    # multi-turn rows: only the model's tokens (loss_mask 1) count; the token of ratio e^-0.5 is an observation's
    masked = rollout_mismatch([[-1.0, -2.0], [-0.5]], [[-1.5, -2.0], [-0.25]], [[2, 2], [1]], iteration=2, cap=1.2,
                              loss_mask=[[0, 1], [1]])
    assert masked["actor/rollout_kl_k3"] == pytest.approx(sum(k3[1:]) / 2) and masked["actor/rollout_frac_beyond_cap"] == 0.5


@pytest.mark.parametrize("loss_agg", ["token-mean", "seq-mean-token-mean"])
def test_pg_loss_is_aggregated_as_the_loss(tiny_model_dir, loss_agg):
    """Without KL, ``actor/pg_loss`` is ``actor/loss``: both follow ``algorithm.loss_agg_mode`` (a
    token mean under ``seq-mean-token-mean`` differed); with KL the two differ by β times the aggregated KL."""
    engine = HFTrainEngine(tiny_model_dir, trainable=True)
    batch = _batch(engine, kl=True)
    batch["old_log_prob"] = [[x - 0.25 for x in lp] for lp in batch["old_log_prob"]]
    m = accumulate_mini_batch(engine, dict(batch), algo=AlgorithmConfig(loss_agg_mode=loss_agg), temperature=1.0, micro_batch=4)
    assert m["actor/pg_loss"] == pytest.approx(m["actor/loss"], rel=1e-6)
    with torch.no_grad():
        lp, mask, _ = response_log_probs(engine.model, batch["prompt_ids"], batch["response_ids"], pad_id=engine.pad_id,
                                         temperature=1.0, autocast_bf16=False)
        old = torch.zeros_like(lp)
        for i, row in enumerate(batch["old_log_prob"]):
            old[i, : len(row)] = torch.tensor(row)
        pg, _, _ = policy_loss(lp, old, torch.tensor(batch["advantages"]), mask, clip_low=0.2, clip_high=0.28)
        per_seq = pg.sum(1) / mask.sum(1)
        want = float(pg.sum() / mask.sum()) if loss_agg == "token-mean" else float(per_seq.mean())
    assert m["actor/pg_loss"] == pytest.approx(want, rel=1e-5)
    m_kl = accumulate_mini_batch(engine, dict(batch), algo=AlgorithmConfig(loss_agg_mode=loss_agg, kl_loss_coef=0.5), temperature=1.0, micro_batch=4)
    assert m_kl["actor/pg_loss"] == pytest.approx(m["actor/pg_loss"], rel=1e-6)
    assert m_kl["actor/loss"] > m_kl["actor/pg_loss"]  # k3 ≥ 0


def test_per_token_advantages_give_the_per_sequence_update_bit_for_bit(tiny_model_dir):
    """The dock's per-token ``advantages`` (the sequence's value repeated over its tokens) give the
    same loss and gradients, to the bit, as one float per sequence (the GRPO update before)."""
    results = []
    for per_token in (False, True):
        engine = HFTrainEngine(tiny_model_dir, trainable=True)
        batch = _batch(engine, kl=True)
        batch["old_log_prob"] = [[x - 0.25 for x in lp] for lp in batch["old_log_prob"]]
        if per_token:
            batch["advantages"] = [[a] * len(r) for a, r in zip(batch["advantages"], batch["response_ids"])]
        engine.optimizer.zero_grad()
        m = accumulate_mini_batch(engine, batch, algo=AlgorithmConfig(kl_loss_coef=0.1), temperature=1.0, micro_batch=4)
        results.append((m, {n: p.grad.clone() for n, p in engine.model.named_parameters() if p.grad is not None}))
    (m1, g1), (m2, g2) = results
    assert m1 == m2
    assert g1.keys() == g2.keys() and all(torch.equal(g1[n], g2[n]) for n in g1)


def _shifted(engine, **kw):
    batch = _batch(engine, **kw)
    batch["old_log_prob"] = [[x - 0.25 for x in lp] for lp in batch["old_log_prob"]]
    return batch


def test_entropy_bonus_lowers_the_loss_by_its_aggregate_and_reaches_the_gradient(tiny_model_dir):
    """``entropy_coeff`` c: ``loss = pg_loss - c·H`` (token-mean), and the entropy is differentiable."""
    grads, metrics = [], []
    for coeff in (0.0, 0.1):
        engine = HFTrainEngine(tiny_model_dir, trainable=True)
        engine.optimizer.zero_grad()
        m = accumulate_mini_batch(engine, _shifted(engine), algo=AlgorithmConfig(entropy_coeff=coeff), temperature=1.0, micro_batch=4)
        metrics.append(m)
        grads.append(torch.cat([p.grad.flatten() for p in engine.model.parameters() if p.grad is not None]))
    (m0, m1), (g0, g1) = metrics, grads
    assert m1["actor/pg_loss"] == pytest.approx(m0["actor/pg_loss"], rel=1e-6)
    assert m1["actor/loss"] == pytest.approx(m1["actor/pg_loss"] - 0.1 * m1["actor/entropy"], rel=1e-5)
    assert not torch.allclose(g0, g1)


def test_tis_and_dual_clip_metrics(tiny_model_dir):
    """TIS weights exp(old - rollout) = e^0.1 ≈ 1.105 on every token: under a cap of 2 their mean, under
    1.05 the cap on every token. Dual-clip reports the fraction of tokens at its bound."""
    engine = HFTrainEngine(tiny_model_dir, trainable=True)
    batch = _batch(engine)
    batch["rollout_log_prob"] = [[x - 0.1 for x in lp] for lp in batch["old_log_prob"]]
    on_policy = {k: v for k, v in batch.items() if k != "old_log_prob"}  # old = this forward's log-probs
    m = accumulate_mini_batch(engine, dict(on_policy), algo=AlgorithmConfig(tis_cap=2.0), temperature=1.0, micro_batch=4)
    assert m["actor/tis_weight_mean"] == pytest.approx(math.exp(0.1), rel=1e-4) and m["actor/tis_clip_frac"] == 0.0
    m = accumulate_mini_batch(engine, dict(on_policy), algo=AlgorithmConfig(tis_cap=1.05), temperature=1.0, micro_batch=4)
    assert m["actor/tis_weight_mean"] == pytest.approx(1.05, rel=1e-6) and m["actor/tis_clip_frac"] == 1.0
    assert "actor/dual_clip_frac" not in m
    far = dict(batch, old_log_prob=[[x - 3.0 for x in lp] for lp in batch["old_log_prob"]],  # ratio e^3 ≈ 20 > c
               advantages=[-1.0] * len(batch["advantages"]))
    m = accumulate_mini_batch(engine, far, algo=AlgorithmConfig(clip_ratio_c=3.0), temperature=1.0, micro_batch=4)
    assert m["actor/dual_clip_frac"] == pytest.approx(1.0)
    assert m["actor/pg_loss"] == pytest.approx(3.0, rel=1e-6)  # -c·A = 3 on every token


def test_dr_grpo_normalizer_in_the_update(tiny_model_dir):
    """``seq-mean-token-sum-norm`` with horizon L is the token sum over N·L: L/mean-length times the token mean."""
    engine = HFTrainEngine(tiny_model_dir, trainable=True)
    batch = _shifted(engine)
    tok = accumulate_mini_batch(engine, dict(batch), algo=AlgorithmConfig(), temperature=1.0, micro_batch=4)
    norm = accumulate_mini_batch(engine, dict(batch), algo=AlgorithmConfig(loss_agg_mode="seq-mean-token-sum-norm"),
                                 temperature=1.0, micro_batch=4, horizon=16)
    tokens, n = sum(len(r) for r in batch["response_ids"]), len(batch["response_ids"])
    assert norm["actor/pg_loss"] == pytest.approx(tok["actor/pg_loss"] * tokens / (n * 16), rel=1e-5)


class FakeEngineNeverCalled:
    """A fake train engine: the actor must not compute anything when it has no rows."""

    def __getattr__(self, name):
        raise AssertionError(f"the engine's {name} was used")


def test_an_iteration_whose_rows_were_all_dropped_trains_nothing():
    """Dynamic sampling's reward stage drops every row when it fails the iteration: the actor's claim
    ends empty and it reports no sequences (its IndexError on the empty batch once hid the
    reward stage's, the run's real error)."""
    from dockrl.config import DockConfig, RolloutConfig, TrainerConfig
    from dockrl.dock import GRPO_SCHEMA, open_dock
    from dockrl.stages.actor import ActorWorker

    dock = open_dock(DockConfig(), GRPO_SCHEMA, run="test")
    dock.open_iteration(0, 4, 2)
    dock.drop(range(4))
    worker = ActorWorker(FakeEngineNeverCalled(), trainer=TrainerConfig(global_batch=2, mini_batch=2, micro_batch=4),
                         algo=AlgorithmConfig(), rollout=RolloutConfig(n=2))
    metrics = worker.run_iteration(dock)
    assert metrics["actor/sequences"] == 0 and metrics["timing_s/actor"] >= 0
    dock.close()
