"""On-policy distillation's advantage against the reverse KL computed by hand."""

from __future__ import annotations

import math

import pytest
import torch

from dockrl.algorithms.distillation import distillation_advantages, reverse_kl_advantages


def test_the_advantage_is_the_hand_computed_reverse_kl_of_each_token():
    # row 0: three tokens; row 1: two tokens and padding. Probabilities of the sampled tokens:
    teacher_p = [[0.5, 0.25, 0.8], [0.1, 0.9, 0.0]]
    student_p = [[0.25, 0.5, 0.4], [0.2, 0.3, 0.0]]
    mask = torch.tensor([[1.0, 1.0, 1.0], [1.0, 1.0, 0.0]])
    log = lambda rows: torch.tensor([[math.log(p) if p else 0.0 for p in r] for r in rows])  # noqa: E731
    adv = reverse_kl_advantages(log(teacher_p), log(student_p), mask)
    # log(0.5/0.25) = ln 2, log(0.25/0.5) = -ln 2, log(0.8/0.4) = ln 2; log(0.1/0.2) = -ln 2, log(0.9/0.3) = ln 3
    want = [[math.log(2), -math.log(2), math.log(2)], [-math.log(2), math.log(3), 0.0]]
    assert adv.tolist() == [pytest.approx(row, abs=1e-6) for row in want]
    # the per-token reverse KL estimate, KL(student ‖ teacher) ≈ mean over tokens of log p_S - log p_T, is the negated mean
    assert float(-(adv.sum() / mask.sum())) == pytest.approx(-(math.log(2) + math.log(3) - math.log(2)) / 5, abs=1e-6)


def test_the_task_advantages_and_the_teacher_s_add_with_their_weights():
    task = torch.tensor([[1.0, 1.0, 1.0], [-0.5, -0.5, 9.0]])  # an outcome estimator's, and junk on the padding
    teacher = torch.tensor([[-1.0, -2.0, -0.5], [-1.0, -1.0, -1.0]])
    student = torch.tensor([[-2.0, -1.0, -0.5], [-3.0, -1.0, -7.0]])
    mask = torch.tensor([[1.0, 1.0, 1.0], [1.0, 1.0, 0.0]])
    got = distillation_advantages(task, teacher, student, mask, coef=0.5, reward_weight=2.0)
    assert got.tolist() == [pytest.approx([2 + 0.5, 2 - 0.5, 2.0]), pytest.approx([-1 + 1.0, -1.0, 0.0])]
    alone = distillation_advantages(task, teacher, student, mask, coef=1.0, reward_weight=0.0)
    assert torch.equal(alone, reverse_kl_advantages(teacher, student, mask))


def test_shapes_that_differ_are_refused():
    with pytest.raises(ValueError, match=r"shapes differ: teacher \(2, 3\), student \(2, 2\)"):
        reverse_kl_advantages(torch.zeros(2, 3), torch.zeros(2, 2), torch.ones(2, 3))
