"""The rollout–trainer mismatch metrics and the masked corrections (Token-/Seq-MIS, IcePop), by hand.

Each case writes ``ρ_t = π_old/π_rollout`` directly: ``old_log_prob = log ρ`` and ``rollout_log_prob = 0``.
"""

import math

import pytest
import torch

from dockrl.algorithms import (
    actor_loss,
    correction_weight,
    icepop_weight,
    mis_sequence_weight,
    mis_token_weight,
    mismatch_metrics,
    token_staleness,
)
from dockrl.config import AlgorithmConfig


def _log(*ratios: float) -> torch.Tensor:
    return torch.tensor([[math.log(r) for r in ratios]])


def test_mis_token_masks_tokens_above_the_threshold_and_weights_the_rest_by_their_ratio():
    out = mis_token_weight(_log(0.5, 1.5, 3.0, 2.0), torch.zeros(1, 4), 2.0)
    torch.testing.assert_close(out.weight, torch.tensor([[0.5, 1.5, 0.0, 2.0]]))  # ρ = C stays (ρ ≤ C)
    torch.testing.assert_close(out.kept, torch.tensor([[1.0, 1.0, 0.0, 1.0]]))


def test_mis_token_of_an_overflowing_ratio_is_zero_not_nan():
    out = mis_token_weight(torch.tensor([[1000.0]]), torch.zeros(1, 1), 2.0)  # exp(1000) = inf; inf·0 would be nan
    assert out.weight.item() == 0.0 and out.kept.item() == 0.0


def test_mis_sequence_masks_whole_sequences_by_the_product_of_their_ratios():
    # row 0: 1.5 · 1.2 = 1.8 ≤ 2 (its padded token's ratio 10 does not count); row 1: 1.5 · 1.5 = 2.25 > 2
    old = torch.tensor([[math.log(1.5), math.log(1.2), math.log(10.0)], [math.log(1.5), math.log(1.5), 0.0]])
    mask = torch.tensor([[1.0, 1.0, 0.0], [1.0, 1.0, 0.0]])
    out = mis_sequence_weight(old, torch.zeros(2, 3), mask, 2.0)
    torch.testing.assert_close(out.weight, torch.tensor([[1.8] * 3, [0.0] * 3]))
    torch.testing.assert_close(out.kept, torch.tensor([[1.0] * 3, [0.0] * 3]))


def test_icepop_keeps_the_band_on_both_sides():
    # α = 0.5, β = 5 (Ring-1T): 0.4 and 6 are masked, the bounds themselves kept
    out = icepop_weight(_log(0.4, 0.5, 1.0, 5.0, 6.0), torch.zeros(1, 5), 0.5, 5.0)
    torch.testing.assert_close(out.weight, torch.tensor([[0.0, 0.5, 1.0, 5.0, 0.0]]))
    torch.testing.assert_close(out.kept, torch.tensor([[0.0, 1.0, 1.0, 1.0, 0.0]]))


def test_rollout_log_prob_enters_as_the_denominator():
    # π_old = e^-1, π_rollout = e^-2: ρ = e
    out = mis_token_weight(torch.tensor([[-1.0]]), torch.tensor([[-2.0]]), 3.0)
    assert out.weight.item() == pytest.approx(math.e)


def test_correction_weights_carry_no_gradient():
    old = torch.zeros(1, 2, requires_grad=True)
    for kind in ("mis_token", "mis_sequence", "icepop"):
        out = correction_weight(old, torch.zeros(1, 2), torch.ones(1, 2), kind=kind, low=0.5, high=2.0)
        assert not out.weight.requires_grad
        torch.testing.assert_close(out.weight, torch.ones(1, 2))  # on-policy: ρ = 1 everywhere, nothing masked


def test_correction_weight_dispatches_and_refuses_bad_input():
    old, mask = _log(0.4, 3.0), torch.ones(1, 2)
    assert correction_weight(old, torch.zeros(1, 2), mask, kind="mis_token", low=0.5, high=2.0).kept.tolist() == [[1.0, 0.0]]
    assert correction_weight(old, torch.zeros(1, 2), mask, kind="icepop", low=0.5, high=2.0).kept.tolist() == [[0.0, 0.0]]
    assert correction_weight(old, torch.zeros(1, 2), mask, kind="mis_sequence", low=0.5, high=2.0).kept.tolist() == [[1.0, 1.0]]  # 1.2
    with pytest.raises(ValueError, match="algorithm.rollout_correction: got 'none'"):
        correction_weight(old, torch.zeros(1, 2), mask, kind="none", low=0.5, high=2.0)
    with pytest.raises(ValueError, match="algorithm.rollout_ratio_low"):
        correction_weight(old, torch.zeros(1, 2), mask, kind="icepop", low=3.0, high=2.0)


def test_mismatch_metrics_by_hand():
    # ρ = 1, 2, 0.5 and a padded token of ratio e^10 that must not count
    old = torch.tensor([[0.0, math.log(2.0), math.log(0.5), 10.0]])
    mask = torch.tensor([[1.0, 1.0, 1.0, 0.0]])
    got = mismatch_metrics(old, torch.zeros(1, 4), mask, cap=1.5)
    # k3 = ρ - log ρ - 1: 0, 1 - ln 2, ln 2 - 0.5 → mean 0.5 / 3
    assert got["kl_k3"] == pytest.approx(0.5 / 3)
    assert got["ratio_max"] == pytest.approx(2.0)
    assert got["frac_beyond_cap"] == pytest.approx(1 / 3)
    assert mismatch_metrics(old, torch.zeros(1, 4), torch.zeros(1, 4), cap=2.0) == {"kl_k3": 0.0, "ratio_max": 0.0, "frac_beyond_cap": 0.0}


def test_mismatch_kl_is_that_of_the_rollout_policy_to_the_trainer():
    # one token sampled at π_rollout = 0.5 where π_old = 0.25: k3 of ρ = 0.5 is 0.5 + ln 2 - 1
    got = mismatch_metrics(torch.tensor([[math.log(0.25)]]), torch.tensor([[math.log(0.5)]]), torch.ones(1, 1), cap=2.0)
    assert got["kl_k3"] == pytest.approx(0.5 + math.log(2.0) - 1)
    assert got["ratio_max"] == pytest.approx(0.5) and got["frac_beyond_cap"] == 0.0


def test_token_staleness_by_hand():
    # update 3 trains on tokens of versions 3, 3 | 1, 2, 3: lags 0, 0, 2, 1, 0
    assert token_staleness(3, [[3, 3], [1, 2, 3]]) == {"staleness_mean": pytest.approx(0.6), "staleness_max": 2.0}
    # multi-turn: only the model's tokens count (the first token of row 1 is an observation's)
    assert token_staleness(3, [[3, 3], [1, 2, 3]], [[1, 1], [0, 1, 1]]) == {"staleness_mean": 0.25, "staleness_max": 1.0}
    assert token_staleness(0, []) == {"staleness_mean": 0.0, "staleness_max": 0.0}
    with pytest.raises(ValueError, match="weight version above the training update 1"):
        token_staleness(1, [[2]])


# --- in the actor's loss -------------------------------------------------------------------------

def _loss(correction: str, ratios: list[list[float]], mask: torch.Tensor, **bounds):
    """On-policy (logπ = logπ_old = 0) with A = 1, so each kept token's policy term is ``-w_t``."""
    log_prob = torch.zeros(mask.shape, requires_grad=True)
    rollout = -torch.tensor([[math.log(r) for r in row] for row in ratios])  # ρ = π_old / π_rollout
    algo = AlgorithmConfig(rollout_correction=correction, **bounds)
    out = actor_loss(log_prob, log_prob.detach(), torch.ones(mask.shape[0]), mask, torch.zeros(mask.shape), algo=algo,
                     total_tokens=float(mask.sum()), total_sequences=float(mask.shape[0]), rollout_log_prob=rollout)
    out.loss.backward()
    return out, log_prob.grad


def test_mis_token_in_the_loss_masks_the_token_and_keeps_it_in_the_normalizer():
    out, grad = _loss("mis_token", [[1.5, 3.0]], torch.ones(1, 2))
    assert out.loss.item() == pytest.approx((-1.5 + 0.0) / 2)  # token-mean over both tokens: the masked one counts 0
    torch.testing.assert_close(grad, torch.tensor([[-1.5 / 2, 0.0]]))  # no gradient through the masked token
    assert out.sums["rollout_weight_mean"].item() == pytest.approx(1.5)
    assert out.sums["rollout_masked_frac"].item() == 1.0
    assert "tis_weight_mean" not in out.sums


def test_mis_sequence_in_the_loss_drops_the_whole_sequence():
    # row 0: 1.2 · 1.5 = 1.8 kept; row 1: 1.5 · 1.5 = 2.25 masked
    mask = torch.tensor([[1.0, 1.0], [1.0, 1.0]])
    out, grad = _loss("mis_sequence", [[1.2, 1.5], [1.5, 1.5]], mask)
    assert out.loss.item() == pytest.approx(-1.8 * 2 / 4)
    torch.testing.assert_close(grad, torch.tensor([[-1.8 / 4, -1.8 / 4], [0.0, 0.0]]))
    assert out.sums["rollout_masked_frac"].item() == 2.0 and out.sums["rollout_weight_mean"].item() == pytest.approx(3.6)


def test_icepop_in_the_loss_masks_both_sides():
    out, grad = _loss("icepop", [[0.4, 0.8, 4.0, 6.0]], torch.ones(1, 4), rollout_ratio_low=0.5, rollout_ratio_high=5.0)
    assert out.loss.item() == pytest.approx(-(0.8 + 4.0) / 4)
    torch.testing.assert_close(grad, torch.tensor([[0.0, -0.8 / 4, -4.0 / 4, 0.0]]))
    assert out.sums["rollout_masked_frac"].item() == 2.0


def test_a_correction_needs_the_rollout_log_probs():
    with pytest.raises(ValueError, match="rollout_correction needs rollout_log_prob"):
        actor_loss(torch.zeros(1, 1), torch.zeros(1, 1), torch.ones(1), torch.ones(1, 1), torch.zeros(1, 1),
                   algo=AlgorithmConfig(rollout_correction="icepop"), total_tokens=1, total_sequences=1)
