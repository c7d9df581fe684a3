import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from dockrl.algorithms import (
    compute_advantages,
    discounted_returns,
    gae,
    grpo_advantages,
    masked_whiten,
    reinforce_plus_plus_advantages,
    rloo_advantages,
    token_rewards,
)
from dockrl.config import AlgorithmConfig


def test_grpo_advantages_hand_computed():
    # group 1: rewards 1, 0, 0, 1 -> mean 0.5, unbiased std sqrt(1/3)
    # group 2: rewards 1.1, 0.1, 0.1, 0.1 -> mean 0.35, unbiased std 0.5
    scores = torch.tensor([1.0, 0.0, 0.0, 1.0, 1.1, 0.1, 0.1, 0.1])
    adv = grpo_advantages(scores, 4, eps=0.0)
    s1 = math.sqrt(1 / 3)
    expected = [0.5 / s1, -0.5 / s1, -0.5 / s1, 0.5 / s1, 0.75 / 0.5, -0.25 / 0.5, -0.25 / 0.5, -0.25 / 0.5]
    assert adv.tolist() == pytest.approx(expected, abs=1e-6)


def test_grpo_advantages_without_std_normalization():
    adv = grpo_advantages(torch.tensor([3.0, 1.0, 2.0, 2.0]), 2, norm_by_std=False)
    assert adv.tolist() == pytest.approx([1.0, -1.0, 0.0, 0.0])


def test_equal_reward_group_gives_zero_advantages_not_nan():
    adv = grpo_advantages(torch.tensor([0.1, 0.1, 0.1, 1.0, 0.0, 0.0]), 3)
    assert torch.isfinite(adv).all()
    assert adv[:3].tolist() == [0.0, 0.0, 0.0]
    assert adv[3] > 0 and adv[4] < 0


@pytest.mark.parametrize("group_size, n", [(1, 4), (3, 4)])
def test_grpo_advantages_rejects_bad_groups(group_size, n):
    with pytest.raises(ValueError, match="group_size"):
        grpo_advantages(torch.zeros(n), group_size)


finite_rewards = st.floats(min_value=-1e6, max_value=1e6, allow_nan=False, allow_infinity=False, width=32)


@settings(max_examples=300, deadline=None)
@given(n=st.integers(2, 64), reward=finite_rewards, other=st.lists(finite_rewards, min_size=2, max_size=64), norm=st.booleans())
def test_equal_reward_groups_get_exactly_zero_for_every_size_and_value(n, reward, other, norm):
    """A group of n equal rewards gets exact zeros (fp32 input, as the dock stores rewards), whatever
    the group beside it holds; the other group's advantages are the float64 formula's."""
    mixed = (other * n)[:n]
    scores = torch.tensor([reward] * n + mixed, dtype=torch.float32)
    adv = grpo_advantages(scores, n, norm_by_std=norm)
    assert adv[:n].tolist() == [0.0] * n
    group = scores[n:].double()
    want = group - group.mean()
    if norm:
        want = want / (group.std() + 1e-6)
    if group.max() == group.min():
        want = torch.zeros_like(want)
    torch.testing.assert_close(adv[n:], want.float(), rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("n", [10, 12, 13, 15])
def test_twelve_rewards_of_one_point_one_are_not_pushed_down(n):
    """The reported case: fp32 groups of 1.1 gave ±0.106–0.119 before."""
    assert grpo_advantages(torch.full((n,), 1.1), n).tolist() == [0.0] * n


# ---- RLOO, REINFORCE++, GAE, Dr. GRPO and the dispatch: numbers computed by hand in the comments ----

def test_rloo_hand_computed():
    # group [1, 0, 0, 1]: A_0 = 1 - (0+0+1)/3 = 2/3, A_1 = 0 - (1+0+1)/3 = -2/3
    # group [3, 1, 2, 2]: A = 3 - 5/3 = 4/3, 1 - 7/3 = -4/3, 2 - 6/3 = 0, 0; group [5, 5, 5, 5]: exactly 0
    scores = torch.tensor([1.0, 0.0, 0.0, 1.0, 3.0, 1.0, 2.0, 2.0, 5.0, 5.0, 5.0, 5.0])
    adv = rloo_advantages(scores, 4)
    assert adv[:8].tolist() == pytest.approx([2 / 3, -2 / 3, -2 / 3, 2 / 3, 4 / 3, -4 / 3, 0.0, 0.0], abs=1e-6)
    assert adv[8:].tolist() == [0.0] * 4


def test_rloo_is_the_group_centered_reward_times_n_over_n_minus_one():
    scores = torch.tensor([0.3, 1.7, -0.4, 2.2, 0.9])
    torch.testing.assert_close(rloo_advantages(scores, 5), grpo_advantages(scores, 5, norm_by_std=False) * 5 / 4)


def test_token_rewards_put_the_score_on_the_last_token_and_subtract_the_kl():
    # β = 0.5: row 0 -0.05, -0.1, 1 - 0.15 = 0.85; row 1 (two tokens) -0.2, 0.5 - 0.25 = 0.25, padding 0
    mask = torch.tensor([[1.0, 1.0, 1.0], [1.0, 1.0, 0.0]])
    kl = torch.tensor([[0.1, 0.2, 0.3], [0.4, 0.5, 0.6]])
    got = token_rewards(torch.tensor([1.0, 0.5]), mask, kl, 0.5)
    torch.testing.assert_close(got, torch.tensor([[-0.05, -0.1, 0.85], [-0.2, 0.25, 0.0]]))
    torch.testing.assert_close(token_rewards(torch.tensor([1.0, 0.5]), mask), torch.tensor([[0.0, 0.0, 1.0], [0.0, 0.5, 0.0]]))


def test_discounted_returns_hand_computed():
    # γ = 0.5: row 0 G2 = 1, G1 = 0.5, G0 = 0.25; row 1 G1 = 2, G0 = 1 + 0.5·2 = 2, padding 0
    rewards = torch.tensor([[0.0, 0.0, 1.0], [1.0, 2.0, 7.0]])
    mask = torch.tensor([[1.0, 1.0, 1.0], [1.0, 1.0, 0.0]])
    torch.testing.assert_close(discounted_returns(rewards, mask, 0.5), torch.tensor([[0.25, 0.5, 1.0], [2.0, 2.0, 0.0]]))


def test_reinforce_plus_plus_hand_computed():
    # scores [1, 0], KL [[0.2, 0.2], [0, 0.4]], β = 0.5, γ = 0.5:
    # rewards [[-0.1, 0.9], [0, -0.2]] → returns [[-0.1 + 0.45, 0.9], [-0.1, -0.2]] = [[0.35, 0.9], [-0.1, -0.2]]
    # batch mean 0.95/4 = 0.2375; deviations 0.1125, 0.6625, -0.3375, -0.4375; squares sum 0.756875,
    # unbiased variance 0.756875 / 3
    mask = torch.ones(2, 2)
    rewards = token_rewards(torch.tensor([1.0, 0.0]), mask, torch.tensor([[0.2, 0.2], [0.0, 0.4]]), 0.5)
    adv, returns = reinforce_plus_plus_advantages(rewards, mask, gamma=0.5, eps=0.0)
    torch.testing.assert_close(returns, torch.tensor([[0.35, 0.9], [-0.1, -0.2]]))
    std = math.sqrt(0.756875 / 3)
    torch.testing.assert_close(adv, torch.tensor([[0.1125, 0.6625], [-0.3375, -0.4375]]) / std)


def test_reinforce_plus_plus_whitens_over_the_batch_not_the_group_and_skips_padding():
    # returns [[1, 1], [0, pad]] (γ = 1, no KL): mean 2/3, unbiased variance ((1/3)²·2 + (2/3)²)/2 = 1/3
    mask = torch.tensor([[1.0, 1.0], [1.0, 0.0]])
    adv, _ = reinforce_plus_plus_advantages(token_rewards(torch.tensor([1.0, 0.0]), mask), mask, gamma=1.0, eps=0.0)
    s = math.sqrt(3)
    torch.testing.assert_close(adv, torch.tensor([[s / 3, s / 3], [-2 * s / 3, 0.0]]))


def test_gae_hand_computed():
    # row 0, γ = 0.9, λ = 0.8 (γλ = 0.72), V = 0.5, 0.6, 0.7, r = 0, 0, 1:
    #   δ2 = 1 - 0.7 = 0.3; δ1 = 0.9·0.7 - 0.6 = 0.03; δ0 = 0.9·0.6 - 0.5 = 0.04
    #   A2 = 0.3; A1 = 0.03 + 0.72·0.3 = 0.246; A0 = 0.04 + 0.72·0.246 = 0.21712; returns = A + V
    # row 1, two tokens, V = 1.0, 0.5 (padding's 9 is never read), r = 0, 2:
    #   δ1 = 2 - 0.5 = 1.5 = A1; δ0 = 0.9·0.5 - 1 = -0.55, A0 = -0.55 + 0.72·1.5 = 0.53
    rewards = torch.tensor([[0.0, 0.0, 1.0], [0.0, 2.0, 0.0]])
    values = torch.tensor([[0.5, 0.6, 0.7], [1.0, 0.5, 9.0]])
    mask = torch.tensor([[1.0, 1.0, 1.0], [1.0, 1.0, 0.0]])
    adv, returns = gae(rewards, values, mask, 0.9, 0.8)
    torch.testing.assert_close(adv, torch.tensor([[0.21712, 0.246, 0.3], [0.53, 1.5, 0.0]]))
    torch.testing.assert_close(returns, torch.tensor([[0.71712, 0.846, 1.0], [1.53, 2.0, 0.0]]))


def test_gae_with_gamma_and_lambda_one_is_the_return_minus_the_value():
    rewards, values, mask = torch.tensor([[0.5, -1.0, 2.0]]), torch.tensor([[0.3, 0.1, -0.2]]), torch.ones(1, 3)
    adv, returns = gae(rewards, values, mask, 1.0, 1.0)
    torch.testing.assert_close(adv, torch.tensor([[1.5 - 0.3, 1.0 - 0.1, 2.0 + 0.2]]))
    torch.testing.assert_close(returns, torch.tensor([[1.5, 1.0, 2.0]]))


def _algo(**kw):
    return AlgorithmConfig(**kw)


def test_compute_advantages_repeats_outcome_advantages_over_the_tokens():
    scores = torch.tensor([1.0, 0.0, 3.0, 1.0])
    mask = torch.tensor([[1.0, 1.0, 0.0], [1.0, 0.0, 0.0], [1.0, 1.0, 1.0], [1.0, 1.0, 0.0]])
    for cfg, per_seq in [
        (_algo(), grpo_advantages(scores, 2)),
        (_algo(adv_estimator="dr_grpo", loss_agg_mode="seq-mean-token-sum-norm"), torch.tensor([0.5, -0.5, 1.0, -1.0])),
        (_algo(adv_estimator="rloo"), torch.tensor([1.0, -1.0, 2.0, -2.0])),
    ]:
        adv, returns = compute_advantages(cfg, scores, mask, group_size=2)
        torch.testing.assert_close(adv, per_seq.unsqueeze(1) * mask)
        assert returns is adv or torch.equal(returns, adv)


def test_compute_advantages_of_reinforce_plus_plus_and_gae():
    scores, mask = torch.tensor([1.0, 0.0]), torch.tensor([[1.0, 1.0], [1.0, 0.0]])
    kl = torch.tensor([[0.2, 0.4], [0.6, 0.0]])
    cfg = _algo(adv_estimator="reinforce_plus_plus", kl_in_reward_coef=0.5, gamma=0.9, adv_eps=0.0)
    adv, returns = compute_advantages(cfg, scores, mask, group_size=2, kl=kl)
    rewards = torch.tensor([[-0.1, 0.8], [-0.3, 0.0]])
    torch.testing.assert_close(returns, torch.tensor([[-0.1 + 0.9 * 0.8, 0.8], [-0.3, 0.0]]))
    torch.testing.assert_close(adv, reinforce_plus_plus_advantages(rewards, mask, gamma=0.9, eps=0.0)[0])
    cfg = _algo(adv_estimator="gae", gamma=1.0, lam=1.0, adv_eps=0.0)
    with pytest.raises(ValueError, match="needs the critic's values"):
        compute_advantages(cfg, scores, mask, group_size=2)
    values = torch.tensor([[0.25, 0.5], [0.5, 0.0]])
    adv, returns = compute_advantages(cfg, scores, mask, group_size=2, values=values)
    torch.testing.assert_close(returns, torch.tensor([[1.0, 1.0], [0.0, 0.0]]))  # A + V = the undiscounted return
    raw = torch.tensor([[0.75, 0.5], [-0.5, 0.0]])  # returns - values, then whitened over the 3 tokens
    torch.testing.assert_close(adv, masked_whiten(raw, mask, 0.0))
    assert abs(float(adv[mask.bool()].mean())) < 1e-6


def test_compute_advantages_rejects_an_unknown_estimator():
    with pytest.raises(ValueError, match="algorithm.adv_estimator: got 'ppo'"):
        compute_advantages(_algo(adv_estimator="ppo"), torch.zeros(2), torch.ones(2, 1), group_size=2)
