"""Checks of end-to-end runs shared by the in-process and the distributed tests."""

from __future__ import annotations

import json
import math

import torch
from pytest import approx
from transformers import AutoModelForCausalLM


def check_hybrid_run(run, tiny_model_dir) -> None:
    """What a 2-iteration hybrid run must leave: synced metrics, on-policy ratios, a changed, loadable checkpoint."""
    lines = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
    assert [x["iteration"] for x in lines] == [0, 1]
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir)
    synced = (sum(p.numel() for p in model.parameters()) + model.get_output_embeddings().weight.numel()) * 4  # + vLLM's head
    for x in lines:
        assert math.isfinite(x["actor/loss"]) and x["actor/grad_norm"] > 0 and x["rollout/response_length_mean"] > 0
        assert x["weight_sync/bytes"] == synced and x["weight_sync/buckets"] > 1 and x["weight_sync/seconds"] > 0
        assert x["reshard/swapped_out_bytes"] > synced and x["timing_s/reference"] > 0
        # vLLM sampled with the weights megatron trains (iteration 1: after the sync): the same log-probs (fp32)
        assert x["actor/rollout_log_prob_diff_max"] < 1e-3 and x["actor/rollout_log_prob_diff_mean"] < 1e-4
    assert lines[0]["weight_sync/checksum"] != lines[1]["weight_sync/checksum"]
    assert (run / "checkpoints" / "iter_000001" / "model.safetensors").is_file()
    before = model.state_dict()
    after = AutoModelForCausalLM.from_pretrained(run / "checkpoints" / "final")
    assert [n for n, p in after.named_parameters() if torch.equal(p, before[n])] == []
    assert json.loads((run / "summary.json").read_text())["eval/test_prompts"] == 4


def check_reward_model_run(run_dir) -> None:
    """A 2-iteration run with reward_model.model_weight=0.5, rule_weight=2: rm_score is their weighted sum."""
    lines = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [x["iteration"] for x in lines] == [0, 1]
    for x in lines:  # means are linear: the run's reward is the weighted sum of the rule's and the model's
        assert math.isfinite(x["reward_model/score_mean"]) and x["reward_model/score_std"] > 0
        assert x["reward/mean"] == approx(2.0 * x["reward/rule_mean"] + 0.5 * x["reward_model/score_mean"], abs=1e-5)
        assert x["timing_s/reward_model"] > 0 and math.isfinite(x["actor/loss"])
