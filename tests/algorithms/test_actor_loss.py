"""``actor_loss`` on hand-computed micro-batches: aggregation modes, the clip, the KL term, the
entropy bonus, TIS, and that no argument is changed."""

import math

import pytest
import torch

from dockrl.algorithms import actor_loss
from dockrl.config import AlgorithmConfig

# two sequences of 3 and 1 response tokens
MASK = torch.tensor([[1.0, 1.0, 1.0], [1.0, 0.0, 0.0]])
ADV = torch.tensor([1.0, -2.0])


def _on_policy(algo: AlgorithmConfig, **kwargs):
    """Ratio exactly 1: each token's policy term is ``-A``."""
    log_prob = torch.full((2, 3), -0.5, requires_grad=True)
    return log_prob, actor_loss(log_prob, log_prob.detach(), ADV, MASK, torch.zeros(2, 3), algo=algo, **kwargs)


def test_token_mean_and_sequence_mean_by_hand():
    # token terms: row 0: -1, -1, -1; row 1: +2
    _, tok = _on_policy(AlgorithmConfig(loss_agg_mode="token-mean"), total_tokens=4, total_sequences=2)
    assert tok.loss.item() == pytest.approx((-3 + 2) / 4)
    _, seq = _on_policy(AlgorithmConfig(loss_agg_mode="seq-mean-token-mean"), total_tokens=4, total_sequences=2)
    assert seq.loss.item() == pytest.approx((-3 / 3 + 2 / 1) / 2)
    _, seq_sum = _on_policy(AlgorithmConfig(loss_agg_mode="seq-mean-token-sum"), total_tokens=4, total_sequences=2)
    assert seq_sum.loss.item() == pytest.approx((-3 + 2) / 2)
    _, norm = _on_policy(AlgorithmConfig(loss_agg_mode="seq-mean-token-sum-norm"), total_tokens=4, total_sequences=2, horizon=8)
    assert norm.loss.item() == pytest.approx((-3 + 2) / (2 * 8))


def test_share_of_the_mini_batch_and_its_gradient():
    # this micro-batch is half of a mini-batch of 8 tokens: its share is normalized by all 8
    log_prob, out = _on_policy(AlgorithmConfig(), total_tokens=8, total_sequences=4)
    assert out.loss.item() == pytest.approx((-3 + 2) / 8)
    assert out.sums["pg_loss"].item() == pytest.approx(out.loss.item())
    out.loss.backward()
    # d(-ρA)/dlogπ = -ρA = -A at ρ = 1, over the 8 tokens; 0 on padding
    torch.testing.assert_close(log_prob.grad, torch.tensor([[-1.0, -1.0, -1.0], [2.0, 0.0, 0.0]]) / 8)
    assert out.sums["ratio_mean"].item() == pytest.approx(4.0) and out.ratio_max.item() == pytest.approx(1.0)
    assert out.sums["clip_ratio"].item() == 0.0 and out.sums["kl"].item() == 0.0


def test_clip_by_hand():
    # ratio 1.5 with A = 1 is clipped at 1 + 0.2; ratio 0.5 with A = -1 at 1 - 0.2
    log_prob = torch.tensor([[math.log(1.5)], [math.log(0.5)]], requires_grad=True)
    algo = AlgorithmConfig(clip_ratio_low=0.2, clip_ratio_high=0.2)
    out = actor_loss(log_prob, torch.zeros(2, 1), torch.tensor([1.0, -1.0]), torch.ones(2, 1), torch.zeros(2, 1),
                     algo=algo, total_tokens=2, total_sequences=2)
    # -min(1.5, 1.2) = -1.2 ; -min(-0.5, -0.8) = 0.8
    assert out.loss.item() == pytest.approx((-1.2 + 0.8) / 2)
    assert out.sums["clip_ratio"].item() == 2.0
    assert out.sums["ratio_mean"].item() == pytest.approx(2.0) and out.ratio_max.item() == pytest.approx(1.5)
    out.loss.backward()
    assert log_prob.grad.abs().sum().item() == 0.0  # both tokens clipped: no gradient
    assert "dual_clip_frac" not in out.sums and "tis_weight_mean" not in out.sums


def test_dual_clip_bounds_the_loss():
    # ratio e^3 ≈ 20 with A = -1: the PPO loss 20 is bounded at c·|A| = 3
    out = actor_loss(torch.tensor([[3.0]]), torch.zeros(1, 1), torch.tensor([-1.0]), torch.ones(1, 1), torch.zeros(1, 1),
                     algo=AlgorithmConfig(clip_ratio_c=3.0), total_tokens=1, total_sequences=1)
    assert out.loss.item() == pytest.approx(3.0)
    assert out.sums["dual_clip_frac"].item() == 1.0


@pytest.mark.parametrize("kind, per_token", [("kl", 1.0), ("low_var_kl", math.exp(-1))])
def test_kl_term_by_hand(kind, per_token):
    # logπ = logπ_old = 0, logπ_ref = -1: k1 = 1, k3 = e^-1 - (-1) - 1 = e^-1
    algo = AlgorithmConfig(kl_loss_coef=0.5, kl_loss_type=kind)
    mask = torch.tensor([[1.0, 1.0, 0.0]])
    out = actor_loss(torch.zeros(1, 3), torch.zeros(1, 3), torch.tensor([1.0]), mask, torch.zeros(1, 3), algo=algo,
                     total_tokens=2, total_sequences=1, ref_log_prob=torch.full((1, 3), -1.0))
    assert out.sums["pg_loss"].item() == pytest.approx(-1.0)  # without the KL term
    assert out.loss.item() == pytest.approx(-1.0 + 0.5 * per_token)
    assert out.sums["kl"].item() == pytest.approx(2 * per_token)  # the padded token counts 0


def test_entropy_bonus_lowers_the_loss():
    entropy = torch.tensor([[0.5, 0.5, 0.5], [1.0, 9.0, 9.0]])  # 9.0 on padding must not count
    algo = AlgorithmConfig(entropy_coeff=0.1)
    out = actor_loss(torch.zeros(2, 3), torch.zeros(2, 3), ADV, MASK, entropy, algo=algo, total_tokens=4, total_sequences=2)
    assert out.sums["entropy"].item() == pytest.approx(2.5)
    assert out.loss.item() == pytest.approx((-3 + 2 - 0.1 * 2.5) / 4)
    assert out.sums["pg_loss"].item() == pytest.approx((-3 + 2) / 4)


def test_tis_weights_the_policy_term():
    # w = min(π_old / π_rollout, C) = min(e^1, 2) = 2 and min(e^-1, 2) = e^-1
    algo = AlgorithmConfig(tis_cap=2.0)
    out = actor_loss(torch.zeros(2, 1), torch.zeros(2, 1), torch.tensor([1.0, 1.0]), torch.ones(2, 1), torch.zeros(2, 1), algo=algo,
                     total_tokens=2, total_sequences=2, rollout_log_prob=torch.tensor([[-1.0], [1.0]]))
    assert out.loss.item() == pytest.approx(-(2 + math.exp(-1)) / 2)
    assert out.sums["tis_weight_mean"].item() == pytest.approx(2 + math.exp(-1))
    assert out.sums["tis_clip_frac"].item() == 1.0


def test_changes_no_argument_and_names_missing_inputs():
    args = [torch.randn(2, 3), torch.randn(2, 3), ADV.clone(), MASK.clone(), torch.rand(2, 3)]
    before = [a.clone() for a in args]
    ref = torch.randn(2, 3)
    algo = AlgorithmConfig(kl_loss_coef=0.1, entropy_coeff=0.01, clip_ratio_c=3.0)
    actor_loss(*args, algo=algo, total_tokens=4, total_sequences=2, ref_log_prob=ref)
    for a, b in zip(args, before):
        assert torch.equal(a, b)
    with pytest.raises(ValueError, match="kl_loss_coef"):
        actor_loss(*args, algo=algo, total_tokens=4, total_sequences=2)
    with pytest.raises(ValueError, match="tis_cap"):
        actor_loss(*args, algo=AlgorithmConfig(tis_cap=2.0), total_tokens=4, total_sequences=2)
