import math

import pytest
import torch

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
