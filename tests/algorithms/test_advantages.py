import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from dockrl.algorithms import grpo_advantages


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
