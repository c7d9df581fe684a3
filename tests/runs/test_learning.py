"""The tiny random model learns a reward it can please (``FakeDigitScorer``) within a few
iterations under each outcome estimator, GSPO's sequence ratio and the loss's TIS weight,
dual-clip and entropy bonus together: the mean reward of the last iterations exceeds that of
the first ones (fixed seed; the shared harness in ``tests/learning.py``)."""

import pytest
from learning import reward_curve, rises


@pytest.mark.slow
@pytest.mark.parametrize("overrides", [
    ("algorithm.adv_estimator=grpo",),
    ("algorithm.adv_estimator=rloo",),
    ("algorithm.adv_estimator=reinforce_plus_plus",),
    ("algorithm.adv_estimator=dr_grpo", "algorithm.loss_agg_mode=seq-mean-token-sum-norm"),
    ("algorithm.ratio_level=sequence", "algorithm.loss_agg_mode=seq-mean-token-mean", "algorithm.clip_ratio_low=3e-4",
     "algorithm.clip_ratio_high=4e-4"),
    ("algorithm.tis_cap=2", "algorithm.clip_ratio_c=3", "algorithm.entropy_coeff=1e-3"),
], ids=["grpo", "rloo", "reinforce_plus_plus", "dr_grpo", "gspo", "tis_dual_clip_entropy"])
def test_reward_rises(tiny_model_dir, tmp_path, monkeypatch, overrides):
    curve = reward_curve(monkeypatch, tiny_model_dir, tmp_path, *overrides)
    assert len(curve) == 6
    assert rises(curve), f"reward curve {[round(r, 3) for r in curve]} does not rise"
