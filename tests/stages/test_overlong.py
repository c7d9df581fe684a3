"""DAPO's overlong reward shaping in the reward stage, through the dock, by hand; and overlong
filtering in the actor: the update equals the one without the truncated responses."""

import random

import pytest
import torch

from dockrl.config import AlgorithmConfig, DockConfig, OverlongBufferConfig
from dockrl.dock import GRPO_SCHEMA, open_dock
from dockrl.engines.hf.train import HFTrainEngine
from dockrl.stages.actor import accumulate_mini_batch
from dockrl.stages.reward import RewardWorker


class FakeTokenizer:
    def batch_decode(self, ids, skip_special_tokens=True):
        return [str(len(r)) for r in ids]


class FakeFlatScorer:
    """Fake: every response scores 1.1 (correct)."""

    def score(self, responses, ground_truths):
        return [1.1 for _ in responses]

    def counters(self):
        return {"timeouts": 0, "errors": 0, "scored": 0}


@pytest.mark.parametrize("enable", [True, False])
def test_overlong_shaping_lowers_the_reward_of_long_responses(enable):
    lengths = [4, 6, 7, 8]  # max_response_length 8, buffer 4: penalties 0, -0.5, -0.75, -1.0 at factor 1
    dock = open_dock(DockConfig(timeout_s=5), GRPO_SCHEMA, run="test")
    dock.open_iteration(0, 4, 2)
    dock.put(range(4), {"prompt_ids": [[1]] * 4, "ground_truth": ["1"] * 4, "response_ids": [[7] * k for k in lengths]})
    overlong = OverlongBufferConfig(enable=enable, len=4, penalty_factor=1.0)
    m = RewardWorker(FakeFlatScorer(), FakeTokenizer(), correct_reward=1.0, overlong=overlong, max_length=8).run_iteration(dock)
    got = dock.get(["rm_score", "correct"], range(4)).to_pydict()
    penalties = [0.0, -0.5, -0.75, -1.0] if enable else [0.0] * 4
    assert got["rm_score"] == pytest.approx([1.1 + p for p in penalties])
    assert got["correct"] == [True] * 4  # the verdict is the verifier's, before the shaping
    assert m["reward/mean"] == pytest.approx(1.1 + sum(penalties) / 4)
    assert ("reward/overlong_penalty_mean" in m) == enable
    dock.close()


def _batch(engine, n=8, seed=0):
    rng = random.Random(seed)
    vocab = len(engine.tokenizer)
    prompts = [[rng.randrange(3, vocab) for _ in range(rng.randint(3, 9))] for _ in range(n)]
    responses = [[rng.randrange(3, vocab) for _ in range(rng.randint(1, 7))] for _ in range(n)]
    batch = {"prompt_ids": prompts, "response_ids": responses, "advantages": [rng.uniform(-1, 1) for _ in range(n)]}
    old = engine.log_probs(prompts, responses, temperature=1.0, micro_batch=n)
    batch["old_log_prob"] = [[x - 0.25 for x in lp] for lp in old]  # ratio ≠ 1: the clip path runs too
    batch["ref_log_prob"] = [[x + rng.uniform(-0.3, 0.3) for x in lp] for lp in old]
    return batch


@pytest.mark.parametrize("loss_agg", ["token-mean", "seq-mean-token-mean"])
def test_overlong_filtering_trains_as_if_the_truncated_responses_were_not_there(tiny_model_dir, loss_agg):
    truncated = [False, True, False, False, True, False, False, True]
    results = []
    for drop in (False, True):
        engine = HFTrainEngine(tiny_model_dir, trainable=True)
        batch = _batch(engine)
        if drop:  # the reference: the same batch without the truncated rows, no filtering
            batch = {k: [v for v, t in zip(values, truncated) if not t] for k, values in batch.items()}
        else:
            batch["truncated"] = truncated
        algo = AlgorithmConfig(loss_agg_mode=loss_agg, kl_loss_coef=0.1, entropy_coeff=0.01, overlong_filter=not drop)
        engine.optimizer.zero_grad()
        m = accumulate_mini_batch(engine, batch, algo=algo, temperature=1.0, micro_batch=3)
        results.append((m, {n: p.grad.clone() for n, p in engine.model.named_parameters() if p.grad is not None}))
    (filtered, g_filtered), (dropped, g_dropped) = results
    for key in ("actor/loss", "actor/pg_loss", "actor/kl", "actor/entropy", "actor/clip_ratio"):
        assert filtered[key] == pytest.approx(dropped[key], abs=1e-6), key
    assert g_filtered.keys() == g_dropped.keys() and g_filtered
    for name in g_filtered:
        torch.testing.assert_close(g_filtered[name], g_dropped[name], atol=1e-6, rtol=1e-5, msg=name)
