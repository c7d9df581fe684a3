"""DAPO on the tiny model learns a reward it can please (``FakeDigitScorer``): clip-higher and the
token-level loss (the defaults) and dynamic sampling on the score; the mean reward of the last
iterations exceeds that of the first ones (fixed seed; ``tests/learning.py``). Overlong shaping and
filtering are left out here: at the harness's 8-token limit nearly every response of the random
model is truncated, so they would change the task (tests/stages/test_overlong.py tests them)."""

import json

import pytest
from learning import reward_curve, rises

DAPO = (
    "algorithm.adv_estimator=grpo", "algorithm.clip_ratio_high=0.28", "algorithm.loss_agg_mode=token-mean",
    "algorithm.filter_groups.enable=true", "algorithm.filter_groups.metric=score", "algorithm.filter_groups.max_num_gen_batches=3",
    "algorithm.filter_groups.on_exhausted=fill",  # once learned, most groups score all 1.0: train on what there is
)


@pytest.mark.slow
def test_dapo_reward_rises(tiny_model_dir, tmp_path, monkeypatch):
    curve = reward_curve(monkeypatch, tiny_model_dir, tmp_path, *DAPO)
    assert len(curve) == 6
    assert rises(curve), f"reward curve {[round(r, 3) for r in curve]} does not rise"
    for m in (json.loads(x) for x in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()):
        assert m["actor/sequences"] == 16  # trainer.global_batch × rollout.n after filter and refill
