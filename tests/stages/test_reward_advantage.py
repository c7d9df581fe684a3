"""Reward and advantage stages through the dock, with the real verifier."""

import pytest

from dockrl.config import AlgorithmConfig, DockConfig
from dockrl.dock import GRPO_SCHEMA, open_dock
from dockrl.rewards import RewardScorer
from dockrl.stages.advantage import AdvantageWorker
from dockrl.stages.reward import RewardWorker


class FakeTokenizer:
    """Fake tokenizer: token id k decodes to the k-th canned response."""

    def __init__(self, texts):
        self.texts = texts

    def batch_decode(self, ids, skip_special_tokens=True):
        return [self.texts[row[0]] for row in ids]


def test_reward_then_advantage_through_the_dock():
    texts = ["so #### 7", "#### 8", "no answer 7", "#### 7.", "#### 1,000", "#### 1000", "#### 999", "1000"]
    dock = open_dock(DockConfig(timeout_s=5), GRPO_SCHEMA, run="test")
    dock.open_iteration(0, 8, 4)
    dock.put(range(8), {"prompt_ids": [[1]] * 8, "ground_truth": ["7"] * 4 + ["1000"] * 4})
    dock.put(range(8), {"response_ids": [[k] + [9] * (k % 3) for k in range(8)]})
    with RewardScorer(timeout_s=5) as scorer:
        m = RewardWorker(scorer, FakeTokenizer(texts), correct_reward=1.0, batch_size=3).run_iteration(dock)
    got = dock.get(["rm_score", "correct"], range(8)).to_pydict()
    assert got["rm_score"] == pytest.approx([1.1, 0.1, 0.0, 1.1, 1.1, 1.1, 0.1, 0.0])
    assert got["correct"] == [True, False, False, True, True, True, False, False]
    assert m["reward/accuracy"] == pytest.approx(4 / 8)
    assert m["reward/verifier_timeouts"] == 0

    a = AdvantageWorker(AlgorithmConfig()).run_iteration(dock)
    per_token = dock.get(["advantages"], range(8)).column("advantages").to_pylist()
    assert [len(row) for row in per_token] == [1 + k % 3 for k in range(8)]  # one per response token
    assert all(len(set(row)) == 1 for row in per_token)  # the response's value repeated
    adv = [row[0] for row in per_token]
    assert a["rollout/frac_zero_std_groups"] == 0.0
    assert adv[0] > 0 and adv[2] < 0 and adv[1] < 0
    assert sum(adv[:4]) == pytest.approx(0.0, abs=1e-5)
    # both outputs of the stage are written (the rows are finished for it): an outcome estimator's
    # returns are its advantages, as verl's
    assert dock.get(["returns"], range(8)).column("returns").to_pylist() == per_token
    dock.close()


def _scored_dock(scores, responses, **columns):
    dock = open_dock(DockConfig(timeout_s=5), GRPO_SCHEMA, run="test")
    dock.open_iteration(0, len(scores), 2)
    dock.put(range(len(scores)), {"prompt_ids": [[1]] * len(scores), "response_ids": responses, "rm_score": scores, **columns})
    return dock


def test_kl_in_the_reward_through_the_dock_by_hand():
    """REINFORCE++ with β = 0.2, k1 = rollout - reference log-prob: row 0 (2 tokens) k1 = 0.5, 0;
    row 1 (1 token) k1 = -1. Rewards [-0.1, 1.0] and [0 + 0.2]; γ = 1 returns [0.9, 1.0], [0.2];
    whitened over the 3 tokens: mean 0.7, deviations 0.2, 0.3, -0.5, unbiased variance 0.38 / 2."""
    dock = _scored_dock([1.0, 0.0], [[5, 6], [7]], rollout_log_prob=[[-1.0, -1.0], [-2.0]], ref_log_prob=[[-1.5, -1.0], [-1.0]])
    cfg = AlgorithmConfig(adv_estimator="reinforce_plus_plus", kl_in_reward_coef=0.2, kl_penalty="kl", adv_eps=0.0)
    AdvantageWorker(cfg).run_iteration(dock)
    adv = dock.get(["advantages"], range(2)).column("advantages").to_pylist()
    std = (0.38 / 2) ** 0.5
    assert adv[0] == pytest.approx([0.2 / std, 0.3 / std], rel=1e-5) and adv[1] == pytest.approx([-0.5 / std], rel=1e-5)
    dock.close()


def test_gae_reads_the_values_and_puts_the_returns():
    """γ = λ = 1, no KL: the return of every token is the outcome; A = return - V, then whitened."""
    dock = _scored_dock([1.0, 0.0], [[5, 6], [7]], values=[[0.25, 0.5], [0.5]])
    AdvantageWorker(AlgorithmConfig(adv_estimator="gae", adv_eps=0.0)).run_iteration(dock)
    got = dock.get(["advantages", "returns"], range(2)).to_pydict()
    assert got["returns"] == [[1.0, 1.0], [0.0]]
    # A = 0.75, 0.5, -0.5: mean 0.25, deviations 0.5, 0.25, -0.75, unbiased variance 0.875 / 2
    std = (0.875 / 2) ** 0.5
    assert [x for row in got["advantages"] for x in row] == pytest.approx([0.5 / std, 0.25 / std, -0.75 / std], rel=1e-5)
    dock.close()
