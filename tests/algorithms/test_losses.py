import math

import pytest
import torch

from dockrl.algorithms import aggregate_loss, entropy_from_logits, kl_k3, policy_loss


def test_policy_loss_hand_computed():
    # ratios e^0.5=1.6487 (clipped to 1.28 for A>0), e^-0.5=0.6065 (clipped to 0.8 for A<0), 1
    log_prob = torch.tensor([[0.5, 0.0], [-0.5, 0.0]])
    old = torch.zeros(2, 2)
    adv = torch.tensor([1.0, -2.0])
    mask = torch.tensor([[1.0, 1.0], [1.0, 0.0]])
    loss, clip_hit = policy_loss(log_prob, old, adv, mask, clip_low=0.2, clip_high=0.28)
    # row 0: -min(1.6487*1, 1.28*1) = -1.28 ; -min(1, 1) = -1
    # row 1: -min(0.6065*-2, 0.8*-2) = -min(-1.2131, -1.6) = 1.6 ; masked token -> 0
    torch.testing.assert_close(loss, torch.tensor([[-1.28, -1.0], [1.6, 0.0]]), atol=1e-5, rtol=0)
    assert clip_hit.tolist() == [[1.0, 0.0], [1.0, 0.0]]


def test_policy_loss_unclipped_inside_range():
    log_prob = torch.tensor([[math.log(1.1)]])
    loss, clip_hit = policy_loss(log_prob, torch.zeros(1, 1), torch.tensor([2.0]), torch.ones(1, 1), clip_low=0.2, clip_high=0.2)
    assert loss.item() == pytest.approx(-2.2, abs=1e-6)
    assert clip_hit.item() == 0.0


def test_kl_k3_hand_computed_and_non_negative():
    log_prob = torch.tensor([[0.0, -1.0, -2.0]])
    ref = torch.tensor([[0.0, -2.0, -1.0]])
    kl = kl_k3(log_prob, ref)
    # d = ref - logp: 0, -1, 1 -> e^d - d - 1: 0, e^-1, e - 2
    torch.testing.assert_close(kl, torch.tensor([[0.0, math.exp(-1), math.e - 2]]), atol=1e-6, rtol=0)
    assert (kl_k3(torch.randn(4, 8), torch.randn(4, 8)) >= 0).all()


def test_entropy_of_uniform_and_one_hot():
    uniform = torch.zeros(1, 1, 8)
    one_hot = torch.tensor([[[100.0, 0.0, 0.0]]])
    assert entropy_from_logits(uniform).item() == pytest.approx(math.log(8), abs=1e-6)
    assert entropy_from_logits(one_hot).item() == pytest.approx(0.0, abs=1e-6)


def test_aggregate_token_and_sequence_mean():
    loss = torch.tensor([[1.0, 2.0, 3.0], [4.0, 0.0, 0.0]])
    mask = torch.tensor([[1.0, 1.0, 1.0], [1.0, 0.0, 0.0]])
    tok = aggregate_loss(loss, mask, "token", total_tokens=4, total_sequences=2)
    seq = aggregate_loss(loss, mask, "sequence", total_tokens=4, total_sequences=2)
    assert tok.item() == pytest.approx((1 + 2 + 3 + 4) / 4)
    assert seq.item() == pytest.approx((2.0 + 4.0) / 2)


def test_aggregate_rejects_unknown_mode():
    with pytest.raises(ValueError, match="algorithm.loss_agg: got 'seq'"):
        aggregate_loss(torch.zeros(1, 1), torch.ones(1, 1), "seq", total_tokens=1, total_sequences=1)
