import math

import pytest
import torch

from dockrl.algorithms import (
    aggregate_loss,
    entropy_from_logits,
    kl_k3,
    kl_penalty,
    nll_loss,
    policy_loss,
    sequence_ratio_log,
    tis_weight,
    value_loss,
)


def test_policy_loss_hand_computed():
    # ratios e^0.5=1.6487 (clipped to 1.28 for A>0), e^-0.5=0.6065 (clipped to 0.8 for A<0), 1
    log_prob = torch.tensor([[0.5, 0.0], [-0.5, 0.0]])
    old = torch.zeros(2, 2)
    adv = torch.tensor([1.0, -2.0])
    mask = torch.tensor([[1.0, 1.0], [1.0, 0.0]])
    loss, clip_hit, _ = policy_loss(log_prob, old, adv, mask, clip_low=0.2, clip_high=0.28)
    # row 0: -min(1.6487*1, 1.28*1) = -1.28 ; -min(1, 1) = -1
    # row 1: -min(0.6065*-2, 0.8*-2) = -min(-1.2131, -1.6) = 1.6 ; masked token -> 0
    torch.testing.assert_close(loss, torch.tensor([[-1.28, -1.0], [1.6, 0.0]]), atol=1e-5, rtol=0)
    assert clip_hit.tolist() == [[1.0, 0.0], [1.0, 0.0]]


def test_policy_loss_unclipped_inside_range():
    log_prob = torch.tensor([[math.log(1.1)]])
    loss, clip_hit, _ = policy_loss(log_prob, torch.zeros(1, 1), torch.tensor([2.0]), torch.ones(1, 1), clip_low=0.2, clip_high=0.2)
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
    tok = aggregate_loss(loss, mask, "token-mean", total_tokens=4, total_sequences=2)
    seq = aggregate_loss(loss, mask, "seq-mean-token-mean", total_tokens=4, total_sequences=2)
    assert tok.item() == pytest.approx((1 + 2 + 3 + 4) / 4)
    assert seq.item() == pytest.approx((2.0 + 4.0) / 2)


def test_aggregate_rejects_unknown_mode():
    with pytest.raises(ValueError, match="algorithm.loss_agg_mode: got 'seq'"):
        aggregate_loss(torch.zeros(1, 1), torch.ones(1, 1), "seq", total_tokens=1, total_sequences=1)


# ---- GSPO, dual-clip, TIS, value loss, KL estimators, Dr. GRPO's normalizer: by hand ----

def test_gspo_sequence_ratio_hand_computed():
    # row 0 log-ratios 0.5, -0.1 → mean 0.2 → s = e^0.2 ≈ 1.2214 on both tokens; row 1: 0 → s = 1
    log_prob = torch.tensor([[-1.0, -2.0, 0.0], [-0.5, 0.0, 0.0]], requires_grad=True)
    old = torch.tensor([[-1.5, -1.9, 0.0], [-0.5, 0.0, 0.0]])
    mask = torch.tensor([[1.0, 1.0, 0.0], [1.0, 0.0, 0.0]])
    s0 = math.exp(0.2)
    torch.testing.assert_close(torch.exp(sequence_ratio_log(log_prob, old, mask)) * mask,
                               torch.tensor([[s0, s0, 0.0], [1.0, 0.0, 0.0]]))
    adv = torch.tensor([1.0, -1.0])
    loss, clip_hit, _ = policy_loss(log_prob, old, adv, mask, clip_low=0.2, clip_high=0.28, ratio_level="sequence")
    # row 0: -min(1.2214·1, 1.2214·1) (inside 1.28); row 1: -min(1·-1, 1·-1) = 1
    torch.testing.assert_close(loss, torch.tensor([[-s0, -s0, 0.0], [1.0, 0.0, 0.0]]))
    assert clip_hit.sum() == 0
    # the gradient of each token is s_i·∇logπ_t (GSPO-token), not its own ratio's e^0.5, e^-0.1
    loss.sum().backward()
    torch.testing.assert_close(log_prob.grad, torch.tensor([[-s0, -s0, 0.0], [1.0, 0.0, 0.0]]))
    # clip_high 0.1: the sequence's ratio is clipped at 1.1 on every token at once
    clipped, clip_hit, _ = policy_loss(log_prob, old, adv, mask, clip_low=0.2, clip_high=0.1, ratio_level="sequence")
    torch.testing.assert_close(clipped[0], torch.tensor([-1.1, -1.1, 0.0]))
    assert clip_hit[0].tolist() == [1.0, 1.0, 0.0]


def test_dual_clip_hand_computed():
    # ratios 4, 0.5, 2; advantages -1, -1, 1; ε 0.2/0.28; c = 3
    # token 0: PPO loss -min(-4, -1.28) = 4, dual bound -c·A = 3 → 3 (dual-clipped)
    # token 1: -min(-0.5, -0.8) = 0.8 < 3 → 0.8 (the ordinary clip); token 2 (A > 0): -min(2, 1.28) = -1.28
    log_prob = torch.tensor([[math.log(4.0), math.log(0.5), math.log(2.0)]], requires_grad=True)
    adv, mask = torch.tensor([[-1.0, -1.0, 1.0]]), torch.ones(1, 3)
    loss, clip_hit, dual_hit = policy_loss(log_prob, torch.zeros(1, 3), adv, mask, clip_low=0.2, clip_high=0.28, clip_c=3.0)
    torch.testing.assert_close(loss, torch.tensor([[3.0, 0.8, -1.28]]))
    assert dual_hit.tolist() == [[1.0, 0.0, 0.0]] and clip_hit.tolist() == [[0.0, 1.0, 1.0]]
    loss.sum().backward()
    assert log_prob.grad.tolist() == [[0.0, 0.0, 0.0]]  # the bound and the clips are constants
    plain, _, none = policy_loss(log_prob, torch.zeros(1, 3), adv, mask, clip_low=0.2, clip_high=0.28)
    assert plain[0, 0].item() == pytest.approx(4.0) and none.sum() == 0  # off: the loss grows with the ratio
    with pytest.raises(ValueError, match="clip_c=1.0"):  # a bound of 1 would cut below the clipped loss
        policy_loss(log_prob, torch.zeros(1, 3), adv, mask, clip_low=0.2, clip_high=0.28, clip_c=1.0)


def test_tis_weight_and_weighted_loss_hand_computed():
    # old - rollout = 0.5, -0.5, 0 → e^0.5 = 1.6487 capped at 1.5, e^-0.5 = 0.60653, 1
    old = torch.tensor([[-1.0, -1.0, -2.0]])
    w = tis_weight(old, torch.tensor([[-1.5, -0.5, -2.0]]), 1.5)
    torch.testing.assert_close(w, torch.tensor([[1.5, math.exp(-0.5), 1.0]]))
    log_prob = old.clone().requires_grad_(True)  # ratio 1, A = 2: loss -2 per token, times w
    loss, _, _ = policy_loss(log_prob, old, torch.tensor([2.0]), torch.ones(1, 3), clip_low=0.2, clip_high=0.28, weight=w)
    torch.testing.assert_close(loss, torch.tensor([[-3.0, -2 * math.exp(-0.5), -2.0]]))
    loss.sum().backward()
    torch.testing.assert_close(log_prob.grad, -2 * w)  # w carries no gradient of its own


def test_value_loss_hand_computed():
    # clip c = 0.2:
    # token 0: V 1.0, old 0.5 → clipped 0.7; (1-2)² = 1, (0.7-2)² = 1.69 → ½·1.69 = 0.845, clipped term chosen
    # token 1: V 2.4, old 2.5 → inside: (2.4-1)² = 1.96 both → 0.98
    # token 2: V 3.0, old 2.0 → clipped 2.2; (3-0)² = 9, (2.2-0)² = 4.84 → ½·9 = 4.5, the unclipped term
    # token 3: padding
    values = torch.tensor([[1.0, 2.4, 3.0, 7.0]], requires_grad=True)
    old, returns = torch.tensor([[0.5, 2.5, 2.0, 0.0]]), torch.tensor([[2.0, 1.0, 0.0, 0.0]])
    mask = torch.tensor([[1.0, 1.0, 1.0, 0.0]])
    loss, clip_hit = value_loss(values, old, returns, mask, clip_range=0.2)
    torch.testing.assert_close(loss, torch.tensor([[0.845, 0.98, 4.5, 0.0]]))
    assert clip_hit.tolist() == [[1.0, 0.0, 0.0, 0.0]]
    loss.sum().backward()
    torch.testing.assert_close(values.grad, torch.tensor([[0.0, 1.4, 3.0, 0.0]]))  # ∂½(V-R)²/∂V = V - R where unclipped


def test_kl_estimators_hand_computed():
    # logπ - logπ_ref = 0, 1, -1
    lp, ref = torch.tensor([[0.0, -1.0, -2.0]]), torch.tensor([[0.0, -2.0, -1.0]])
    assert kl_penalty(lp, ref, "kl").tolist() == [[0.0, 1.0, -1.0]]
    assert kl_penalty(lp, ref, "abs").tolist() == [[0.0, 1.0, 1.0]]
    assert kl_penalty(lp, ref, "mse").tolist() == [[0.0, 0.5, 0.5]]
    torch.testing.assert_close(kl_penalty(lp, ref, "low_var_kl"), torch.tensor([[0.0, math.exp(-1), math.e - 2]]))
    with pytest.raises(ValueError, match="algorithm.kl_loss_type: got 'k9'"):
        kl_penalty(lp, ref, "k9")


def test_aggregate_modes_and_dr_grpo_constant_normalizer():
    # per-token losses: sequence 0 has 3 tokens (1, 2, 3), sequence 1 has one (4); N = 2, L = 8
    loss = torch.tensor([[1.0, 2.0, 3.0], [4.0, 0.0, 0.0]], requires_grad=True)
    mask = torch.tensor([[1.0, 1.0, 1.0], [1.0, 0.0, 0.0]])
    totals = dict(total_tokens=4, total_sequences=2, horizon=8)
    assert aggregate_loss(loss, mask, "seq-mean-token-sum", **totals).item() == pytest.approx((6 + 4) / 2)
    norm = aggregate_loss(loss, mask, "seq-mean-token-sum-norm", **totals)
    assert norm.item() == pytest.approx((6 + 4) / (2 * 8))  # Σ over tokens / (N · L)
    norm.backward()
    # every token weighs 1/(N·L), whatever its response's length (seq-mean-token-mean gives 1/6 vs 1/2)
    torch.testing.assert_close(loss.grad, mask / 16)
    with pytest.raises(ValueError, match="needs the constant horizon"):
        aggregate_loss(loss, mask, "seq-mean-token-sum-norm", total_tokens=4, total_sequences=2)


def test_nll_loss_is_the_masked_tokens_nll_over_the_mini_batch_count():
    log_prob = torch.tensor([[-1.0, -2.0, -3.0], [-0.5, -7.0, 0.0]], requires_grad=True)
    mask = torch.tensor([[1.0, 0.0, 1.0], [1.0, 0.0, 0.0]])
    assert nll_loss(log_prob, mask, 3.0).item() == pytest.approx((1.0 + 3.0 + 0.5) / 3)
    assert nll_loss(log_prob, mask, 6.0).item() == pytest.approx(4.5 / 6)  # a micro-batch's share of a bigger mini-batch
    nll_loss(log_prob, mask, 3.0).backward()
    assert torch.equal(log_prob.grad, -mask / 3)
    assert nll_loss(log_prob, torch.zeros_like(mask), 0.0).item() == 0.0  # no counted token: 0, not NaN
