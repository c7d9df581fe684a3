"""The tiny random model learns a reward it can please (``FakeDigitScorer``) within a few
iterations under each outcome estimator: the mean reward of the last iterations exceeds that of
the first ones (fixed seed; the shared harness in ``tests/learning.py``)."""

import pytest
from learning import reward_curve, rises


@pytest.mark.slow
@pytest.mark.parametrize("overrides", [
    ("algorithm.adv_estimator=grpo",),
    ("algorithm.adv_estimator=rloo",),
    ("algorithm.adv_estimator=reinforce_plus_plus",),
], ids=["grpo", "rloo", "reinforce_plus_plus"])
def test_reward_rises(tiny_model_dir, tmp_path, monkeypatch, overrides):
    curve = reward_curve(monkeypatch, tiny_model_dir, tmp_path, *overrides)
    assert len(curve) == 6
    assert rises(curve), f"reward curve {[round(r, 3) for r in curve]} does not rise"
