"""End-to-end (``dock.mode=inprocess``, the tiny model): the rollout–trainer mismatch metrics are in
every run's metrics, and each masked correction (Token-/Seq-MIS, IcePop) trains with its own.

A bf16 rollout beside the fp32 actor gives a real mismatch (its own bf16 copy of the weights,
``dockrl.engines.factory.shares_actor_module``): each token's ``π_old/π_rollout`` lies near 1 on
either side, so bounds at 1 mask a part of the tokens, and the masked fraction is measured, not set.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
from fake_scorers import FakeRandomScorer  # noqa: E402

from dockrl import driver
from dockrl.config import load_config
from dockrl.rewards import guard

MISMATCH = ["actor/rollout_log_prob_diff_mean", "actor/rollout_log_prob_diff_max", "actor/rollout_kl_k3", "actor/rollout_ratio_max",
            "actor/rollout_frac_beyond_cap", "actor/rollout_staleness_mean", "actor/rollout_staleness_max"]


def run(tiny_model_dir, tmp_path: Path, monkeypatch, *extra: str) -> list[dict]:
    monkeypatch.setattr(guard, "RewardScorer", FakeRandomScorer)
    cfg = load_config(None, [
        f"model.path={tiny_model_dir}", f"run.output_dir={tmp_path / 'run'}", f"run.cache_dir={tmp_path / 'cache'}",
        "run.progress=false", "trainer.iterations=2", "trainer.global_batch=2", "trainer.mini_batch=2",
        "trainer.micro_batch=4", "rollout.n=4", "rollout.max_response_length=12", "rollout.dtype=bfloat16",
        "trainer.autocast_bf16=false", "trainer.lr=1e-2", "trainer.save_every=0", "trainer.eval_before=false",
        "trainer.eval_after=false", "data.generate_train=20", "data.generate_test=4", "data.eval_size=4", *extra,
    ])
    driver.train(cfg)
    return [json.loads(x) for x in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]


@pytest.mark.slow  # two iterations of the tiny model: ~20 s
def test_the_mismatch_metrics_are_in_every_run_by_default(tiny_model_dir, tmp_path, monkeypatch):
    rows = run(tiny_model_dir, tmp_path, monkeypatch)
    assert [x["iteration"] for x in rows] == [0, 1]
    for x in rows:
        assert all(k in x and math.isfinite(x[k]) for k in MISMATCH), sorted(set(MISMATCH) - x.keys())
        # bf16 sampling, fp32 training: a mismatch small but not 0; in-process runs are on-policy (staleness 0)
        assert 0 < x["actor/rollout_kl_k3"] < 0.05 and 1 < x["actor/rollout_ratio_max"] < 2, x
        assert 0 <= x["actor/rollout_frac_beyond_cap"] < 0.5  # the cap: algorithm.rollout_ratio_high = 2
        assert x["actor/rollout_staleness_mean"] == x["actor/rollout_staleness_max"] == 0.0
        assert "actor/rollout_masked_frac" not in x and "actor/tis_weight_mean" not in x  # no correction asked for


@pytest.mark.slow  # three runs of two iterations of the tiny model: ~60 s
@pytest.mark.parametrize(("correction", "bounds"), [
    ("mis_token", ["algorithm.rollout_ratio_high=1"]),  # tokens with ρ > 1 leave the loss
    ("mis_sequence", ["algorithm.rollout_ratio_high=1"]),  # sequences with Π ρ > 1 leave it whole
    ("icepop", ["algorithm.rollout_ratio_low=1", "algorithm.rollout_ratio_high=2"]),  # tokens with ρ < 1 (or > 2) leave
])
def test_each_masked_correction_trains_and_reports_what_it_masked(tiny_model_dir, tmp_path, monkeypatch, correction, bounds):
    rows = run(tiny_model_dir, tmp_path, monkeypatch, f"algorithm.rollout_correction={correction}", *bounds)
    for x in rows:
        assert math.isfinite(x["actor/loss"]) and x["actor/grad_norm"] >= 0
        assert all(k in x for k in MISMATCH)
        # the fraction masked lies strictly between none and all: ρ falls on both sides of 1
        assert 0 < x["actor/rollout_masked_frac"] < 1, (correction, x["actor/rollout_masked_frac"])
        # kept tokens weigh their ratio (near 1), masked ones 0: the mean weight is about the kept fraction
        assert x["actor/rollout_weight_mean"] == pytest.approx(1 - x["actor/rollout_masked_frac"], abs=0.05)
        if correction == "mis_token":  # exactly the tokens beyond the cap of 1 were masked
            assert x["actor/rollout_masked_frac"] == pytest.approx(x["actor/rollout_frac_beyond_cap"], abs=1e-6)
