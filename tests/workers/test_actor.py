import random

import pytest
import torch

from dockrl.algorithms import policy_loss
from dockrl.config import AlgorithmConfig
from dockrl.engines.hf import HFTrainEngine, response_log_probs
from dockrl.workers.actor import accumulate_mini_batch, rollout_log_prob_diff


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


@pytest.mark.parametrize("loss_agg, kl_coef", [("token", 0.0), ("sequence", 0.1)])
def test_micro_batch_size_does_not_change_loss_or_gradients(tiny_model_dir, loss_agg, kl_coef):
    algo = AlgorithmConfig(loss_agg=loss_agg, kl_coef=kl_coef)
    results = []
    for micro in (1, 4):
        engine = HFTrainEngine(tiny_model_dir, trainable=True)
        batch = _batch(engine, kl=kl_coef > 0)
        # a second, shifted view so the ratio is not 1 and the clip and KL paths are exercised
        batch["old_log_prob"] = [[x - 0.25 for x in lp] for lp in batch["old_log_prob"]]
        engine.optimizer.zero_grad()
        m = accumulate_mini_batch(engine, batch, algo=algo, temperature=1.0, micro_batch=micro)
        results.append((m, {n: p.grad.clone() for n, p in engine.model.named_parameters() if p.grad is not None}))
    (m1, g1), (m4, g4) = results
    assert m1["actor/loss"] == pytest.approx(m4["actor/loss"], abs=1e-6)
    assert m1["actor/clip_ratio"] > 0
    assert g1.keys() == g4.keys() and len(g1) > 0
    for name in g1:
        torch.testing.assert_close(g1[name], g4[name], atol=1e-6, rtol=0, msg=name)


def test_rollout_log_prob_diff_by_hand():
    got = rollout_log_prob_diff([[-1.0, -2.0], [-0.5]], [[-1.5, -2.0], [-0.25]])
    assert got == {"actor/rollout_log_prob_diff_mean": 0.25, "actor/rollout_log_prob_diff_max": 0.5}


@pytest.mark.parametrize("loss_agg", ["token", "sequence"])
def test_pg_loss_is_aggregated_as_the_loss(tiny_model_dir, loss_agg):
    """Without KL, ``actor/pg_loss`` is ``actor/loss``: both follow ``algorithm.loss_agg`` (a token
    mean under ``sequence`` differed); with KL the two differ by β times the aggregated KL."""
    engine = HFTrainEngine(tiny_model_dir, trainable=True)
    batch = _batch(engine, kl=True)
    batch["old_log_prob"] = [[x - 0.25 for x in lp] for lp in batch["old_log_prob"]]
    m = accumulate_mini_batch(engine, dict(batch), algo=AlgorithmConfig(loss_agg=loss_agg), temperature=1.0, micro_batch=4)
    assert m["actor/pg_loss"] == pytest.approx(m["actor/loss"], rel=1e-6)
    with torch.no_grad():
        lp, mask, _ = response_log_probs(engine.model, batch["prompt_ids"], batch["response_ids"], pad_id=engine.pad_id,
                                         temperature=1.0, autocast_bf16=False)
        old = torch.zeros_like(lp)
        for i, row in enumerate(batch["old_log_prob"]):
            old[i, : len(row)] = torch.tensor(row)
        pg, _ = policy_loss(lp, old, torch.tensor(batch["advantages"]), mask, clip_low=0.2, clip_high=0.28)
        per_seq = pg.sum(1) / mask.sum(1)
        want = float(pg.sum() / mask.sum()) if loss_agg == "token" else float(per_seq.mean())
    assert m["actor/pg_loss"] == pytest.approx(want, rel=1e-5)
    m_kl = accumulate_mini_batch(engine, dict(batch), algo=AlgorithmConfig(loss_agg=loss_agg, kl_coef=0.5), temperature=1.0, micro_batch=4)
    assert m_kl["actor/pg_loss"] == pytest.approx(m["actor/pg_loss"], rel=1e-6)
    assert m_kl["actor/loss"] > m_kl["actor/pg_loss"]  # k3 ≥ 0
