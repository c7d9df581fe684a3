"""Reward-model stage: the scorer on the tiny random reward model, its stage through the dock, the
weighted sum the reward stage writes, its config errors, and whole runs with it in-process and as processes."""

from __future__ import annotations

import json

import pytest
import torch
from e2e_checks import check_reward_model_run
from fake_scorers import FakeRandomScorer

from dockrl import driver
from dockrl.config import AlgorithmConfig, ConfigError, DockConfig, RewardModelConfig, load_config
from dockrl.dock import GRPO_SCHEMA, open_dock
from dockrl.engines.hf.load import load_tokenizer
from dockrl.engines.reward_model import HFRewardModel
from dockrl.rewards import guard
from dockrl.run.models import build_tiny_model, build_tiny_reward_model
from dockrl.run.setup import plan_run
from dockrl.stages.loop import Report
from dockrl.stages.reward import RewardWorker
from dockrl.stages.reward_model import RewardModelWorker
from dockrl.stages.table import iteration_reports, stage_processes

PROMPTS = [[1, 5, 6, 7, 9], [8, 9], [3, 4, 5]]
RESPONSES = [[10, 11, 12], [12], [20, 21, 22, 23, 24, 25]]  # no EOS: the HF forward pools at the same token


@pytest.fixture(scope="module")
def reward_model(tiny_model_dir, tiny_reward_model_dir):
    return HFRewardModel(tiny_reward_model_dir, policy_tokenizer=load_tokenizer(tiny_model_dir))


def test_a_batch_scores_each_row_as_the_hf_classifier_does_alone(reward_model):
    assert reward_model.same_vocab
    batched = reward_model.score(PROMPTS, RESPONSES, micro_batch=2)
    for p, r, got in zip(PROMPTS, RESPONSES, batched):
        alone = reward_model.model(input_ids=torch.tensor([p + r])).logits  # (1, 1): HF's own pooling, no padding
        assert got == pytest.approx(float(alone[0, 0]), abs=1e-5)
    assert max(batched) - min(batched) > 1e-3  # a random head still tells the rows apart
    eos = reward_model.tokenizer.eos_token_id  # == pad: read at the row's length, not at the first pad
    with_eos = reward_model.score([PROMPTS[1], PROMPTS[2]], [RESPONSES[1] + [eos], RESPONSES[2]], micro_batch=2)
    assert with_eos[1] == pytest.approx(batched[2], abs=1e-5) and with_eos[0] != pytest.approx(batched[1], abs=1e-5)


def test_a_reward_model_with_another_vocabulary_reads_the_text(tmp_path, tiny_model_dir):
    other = build_tiny_model(tmp_path / "other", vocab_size=400)
    rm_dir = build_tiny_reward_model(tmp_path / "rm", other)
    policy = load_tokenizer(tiny_model_dir)
    model = HFRewardModel(rm_dir, policy_tokenizer=policy)
    assert not model.same_vocab
    text = policy.decode(PROMPTS[0] + RESPONSES[0])
    ids = model.tokenizer(text, add_special_tokens=False)["input_ids"]
    assert model.rows(PROMPTS[:1], RESPONSES[:1]) == [ids]
    assert model.score(PROMPTS[:1], RESPONSES[:1], micro_batch=1) == pytest.approx(
        [float(model.model(input_ids=torch.tensor([ids])).logits[0, 0])], abs=1e-5)


def open_rows(n=4):
    dock = open_dock(DockConfig(timeout_s=5), GRPO_SCHEMA, run="test")
    dock.open_iteration(0, n, 2)
    dock.put(range(n), {"prompt_ids": [[1, 2]] * n, "ground_truth": ["7"] * n})
    dock.put(range(n), {"response_ids": [[k + 3] for k in range(n)]})
    return dock


class FakeTokenizer:
    """Fake tokenizer: token id k decodes to the k-th canned response."""

    def batch_decode(self, ids, skip_special_tokens=True):
        return [["#### 7", "#### 8", "no answer", "#### 7"][row[0] - 3] for row in ids]


class FakeRuleScorer:
    """Fake rule verifier: 1.1 for '#### 7', 0.1 for another '#### n', else 0 (the built-in's values)."""

    def score(self, texts, truths):
        return [1.1 if t == "#### 7" else 0.1 if t.startswith("####") else 0.0 for t in texts]

    def counters(self):
        return {"timeouts": 0, "errors": 0, "scored": 0}


def test_the_reward_stage_writes_the_weighted_sum_of_rule_and_model_scores():
    dock = open_rows()
    dock.put(range(4), {"rm_model_score": [0.5, -1.0, 2.0, 0.25]})
    worker = RewardWorker.from_config(FakeRuleScorer(), FakeTokenizer(), AlgorithmConfig(),
                                      RewardModelConfig(enable=True, model_weight=0.5, rule_weight=2.0))
    m = worker.run_iteration(dock)
    got = dock.get(["rm_score", "correct"], range(4)).to_pydict()
    # rule [1.1, 0.1, 0, 1.1]: 2·1.1 + 0.5·0.5 = 2.45, 2·0.1 - 0.5 = -0.3, 0 + 1 = 1, 2.2 + 0.125 = 2.325
    assert got["rm_score"] == pytest.approx([2.45, -0.3, 1.0, 2.325], abs=1e-6)
    assert got["correct"] == [True, False, False, True]  # the rule's verdict, whatever the model says
    assert m["reward/rule_mean"] == pytest.approx(2.3 / 4) and m["reward/mean"] == pytest.approx(5.475 / 4)
    assert m["reward/accuracy"] == 0.5
    dock.close()


def test_the_reward_stage_without_the_reward_model_neither_waits_for_nor_adds_its_score():
    dock = open_rows()
    m = RewardWorker.from_config(FakeRuleScorer(), FakeTokenizer(), AlgorithmConfig(), RewardModelConfig()).run_iteration(dock)
    assert dock.get(["rm_score"], range(4)).column("rm_score").to_pylist() == pytest.approx([1.1, 0.1, 0.0, 1.1])
    assert "reward/rule_mean" not in m
    dock.close()


def test_the_reward_model_stage_puts_one_score_per_row(reward_model):
    dock = open_rows(6)
    m = RewardModelWorker(reward_model, micro_batch=2).run_iteration(dock)  # claims of 8 rows: one claim, three passes
    got = dock.get(["rm_model_score"], range(6)).column("rm_model_score").to_pylist()
    want = reward_model.score([[1, 2]] * 6, [[k + 3] for k in range(6)], micro_batch=6)
    assert got == pytest.approx(want, abs=1e-5)
    assert m["reward_model/score_mean"] == pytest.approx(sum(want) / 6, abs=1e-5) and m["timing_s/reward_model"] > 0
    dock.close()


def test_the_reward_model_stage_is_in_the_run_only_when_enabled(tiny_reward_model_dir):
    on = load_config(None, ["reward_model.enable=true", f"reward_model.model.path={tiny_reward_model_dir}"])
    assert stage_processes(on) == ["rollout", "reward-model", "reward", "actor"]
    assert iteration_reports(on) == [Report.ROLLOUT, Report.REWARD_MODEL, Report.REWARD, Report.ACTOR, Report.WEIGHT_SYNC]
    assert "reward-model" not in stage_processes(load_config(None, []))


def test_config_errors_name_the_reward_model_fields(tmp_path, tiny_model_dir):
    with pytest.raises(ConfigError, match=r"reward_model.model.path: got ''; reward_model.enable=true needs"):
        load_config(None, ["reward_model.enable=true"])
    with pytest.raises(ConfigError, match=r"reward_model.model_weight: got 0.0"):
        load_config(None, ["reward_model.enable=true", "reward_model.model.path=rm", "reward_model.model_weight=0"])
    with pytest.raises(ConfigError, match=r"reward_model.micro_batch_size: got 0"):
        load_config(None, ["reward_model.enable=true", "reward_model.model.path=rm", "reward_model.micro_batch_size=0"])
    with pytest.raises(ConfigError, match=r"reward_model.model: unknown field\(s\) \['pth'\]"):
        load_config(None, ["reward_model.model.pth=rm"])
    base = [f"model.path={tiny_model_dir}", f"run.output_dir={tmp_path / 'run'}", f"run.cache_dir={tmp_path / 'cache'}",
            "data.generate_train=20", "data.generate_test=4", "reward_model.enable=true"]
    with pytest.raises(ConfigError, match=r"reward_model.model.path: got '.*nowhere'; expected a local HF folder"):
        plan_run(load_config(None, [*base, f"reward_model.model.path={tmp_path / 'nowhere'}"]))
    with pytest.raises(ConfigError, match=r"reward_model.model.path: .* holds \['Qwen2ForCausalLM'\]; expected a sequence-classification"):
        plan_run(load_config(None, [*base, f"reward_model.model.path={tiny_model_dir}"]))  # a policy is no reward model
    assert not (tmp_path / "run" / "config.yaml").exists()  # refused before anything of the run is written


def run_overrides(tiny_model_dir, tiny_reward_model_dir, tmp_path, *extra):
    return [
        f"model.path={tiny_model_dir}", f"run.output_dir={tmp_path / 'run'}", f"run.cache_dir={tmp_path / 'cache'}",
        "run.progress=false", "trainer.iterations=2", "trainer.global_batch=2", "trainer.mini_batch=2",
        "trainer.micro_batch=4", "rollout.n=4", "rollout.max_response_length=8", "rollout.dtype=float32",
        "trainer.autocast_bf16=false", "trainer.save_every=0", "data.generate_train=20", "data.generate_test=4",
        "data.eval_size=4", "reward_model.enable=true", f"reward_model.model.path={tiny_reward_model_dir}",
        "reward_model.micro_batch_size=3", "reward_model.model_weight=0.5", "reward_model.rule_weight=2.0", *extra,
    ]


@pytest.mark.slow
def test_a_run_in_process_adds_the_reward_model(tiny_model_dir, tiny_reward_model_dir, tmp_path, monkeypatch):
    monkeypatch.setattr(guard, "RewardScorer", FakeRandomScorer)
    driver.train(load_config(None, run_overrides(tiny_model_dir, tiny_reward_model_dir, tmp_path)))
    check_reward_model_run(tmp_path / "run")


def test_a_value_head_per_token_scores_the_last_token(tmp_path, tiny_model_dir):
    rm_dir = build_tiny_reward_model(tmp_path / "value-head", tiny_model_dir, value_head=True)
    model = HFRewardModel(rm_dir, policy_tokenizer=load_tokenizer(tiny_model_dir))
    got = model.score(PROMPTS, RESPONSES, micro_batch=3)
    for p, r, score in zip(PROMPTS, RESPONSES, got):
        values = model.model(input_ids=torch.tensor([p + r])).logits  # (1, L, 1): a value per token
        assert score == pytest.approx(float(values[0, -1, 0]), abs=1e-5)


@pytest.mark.slow
def test_dynamic_sampling_filters_groups_on_the_combined_reward(tiny_model_dir, tiny_reward_model_dir, tmp_path, monkeypatch):
    monkeypatch.setattr(guard, "RewardScorer", FakeRandomScorer)
    driver.train(load_config(None, run_overrides(tiny_model_dir, tiny_reward_model_dir, tmp_path, "algorithm.filter_groups.enable=true",
                                                 "algorithm.filter_groups.metric=score", "algorithm.filter_groups.on_exhausted=fill")))
    check_reward_model_run(tmp_path / "run")  # the rounds' rows scored by the reward model are those the reward stage combines
    lines = [json.loads(x) for x in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert all(x["rollout/kept_groups"] + x["rollout/filled_groups"] >= 2 and x["rollout/gen_batches"] >= 1 for x in lines)
