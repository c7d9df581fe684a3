"""Teacher stage (on-policy distillation): its log-probs against a fresh load of the teacher, the advantages it
leads to, the tokenizer rule, its config errors, and whole runs with it in-process and as a process."""

from __future__ import annotations

import json
import math
import shutil

import pytest
import torch
from fake_scorers import FakeRandomScorer
from transformers import AutoModelForCausalLM

from dockrl import driver
from dockrl.config import AlgorithmConfig, ConfigError, DockConfig, TeacherConfig, load_config
from dockrl.dock import GRPO_SCHEMA, open_dock
from dockrl.engines.hf.train import HFTrainEngine
from dockrl.rewards import guard
from dockrl.run.models import build_tiny_model
from dockrl.run.setup import plan_run
from dockrl.stages.advantage import AdvantageWorker
from dockrl.stages.loop import Report
from dockrl.stages.table import iteration_reports, stage_processes
from dockrl.stages.teacher import teacher_worker

PROMPTS = [[1, 5, 6, 7, 9], [8, 9], [3, 4, 5], [7]]
RESPONSES = [[10, 11, 12], [12], [20, 21, 22, 23, 24, 25], [30, 31]]


@pytest.fixture(scope="session")
def tiny_teacher_dir(tmp_path_factory, tiny_model_dir):
    """Another tiny model on the student's tokenizer: three layers, other random weights."""
    out = build_tiny_model(tmp_path_factory.mktemp("tiny-teacher"), num_layers=3, seed=0)
    assert (out / "tokenizer.json").read_bytes() == (tiny_model_dir / "tokenizer.json").read_bytes()
    return out


def open_rows():
    dock = open_dock(DockConfig(timeout_s=5), GRPO_SCHEMA, run="test")
    dock.open_iteration(0, len(PROMPTS), 2)
    dock.put(range(len(PROMPTS)), {"prompt_ids": PROMPTS, "ground_truth": ["7"] * len(PROMPTS)})
    dock.put(range(len(PROMPTS)), {"response_ids": RESPONSES})
    return dock


def test_the_teacher_s_log_probs_are_those_of_a_fresh_load_of_the_teacher(tiny_teacher_dir):
    cfg = load_config(None, ["teacher.enable=true", f"teacher.model.path={tiny_teacher_dir}", "rollout.temperature=0.7",
                             "trainer.micro_batch=2", "trainer.autocast_bf16=false"])
    engine = HFTrainEngine(tiny_teacher_dir, trainable=False)
    dock = open_rows()
    m = teacher_worker(cfg, engine).run_iteration(dock)
    got = dock.get(["teacher_log_prob"], range(len(PROMPTS))).column("teacher_log_prob").to_pylist()
    fresh = AutoModelForCausalLM.from_pretrained(tiny_teacher_dir, dtype=torch.float32).eval()
    for p, r, row in zip(PROMPTS, RESPONSES, got):
        with torch.no_grad():
            logits = fresh(input_ids=torch.tensor([p + r])).logits[0, len(p) - 1 : -1] / 0.7  # the logits that predict each response token
        want = torch.log_softmax(logits.double(), dim=-1)[torch.arange(len(r)), torch.tensor(r)]
        assert row == pytest.approx(want.tolist(), abs=1e-5)
    assert m["timing_s/teacher"] > 0
    dock.close()


def test_the_advantage_stage_adds_the_reverse_kl_of_the_teacher():
    dock = open_rows()
    student = [[-1.0, -2.0, -3.0], [-0.5], [-1.0] * 6, [-2.0, -2.0]]
    teacher = [[-2.0, -2.0, -1.0], [-0.25], [-1.5] * 6, [-1.0, -3.0]]
    dock.put(range(4), {"rollout_log_prob": student, "teacher_log_prob": teacher, "rm_score": [1.0, 0.0, 0.0, 0.0]})
    m = AdvantageWorker(AlgorithmConfig(), teacher=TeacherConfig(enable=True, coef=0.5, reward_weight=1.0)).run_iteration(dock)
    got = dock.get(["advantages"], range(4)).column("advantages").to_pylist()
    g = 1 / (math.sqrt(0.5) + 1e-6)  # GRPO on the groups [1, 0] and [0, 0]: ±(1 - 0.5) / std, std of [1, 0] = √0.5
    want = [[g * 0.5 + 0.5 * (t - s) for s, t in zip(ss, ts)] for ss, ts in zip(student[:1], teacher[:1])]
    want += [[-g * 0.5 + 0.5 * 0.25]] + [[0.5 * (t - s) for s, t in zip(ss, ts)] for ss, ts in zip(student[2:], teacher[2:])]
    assert got == [pytest.approx(w, abs=1e-5) for w in want]
    tokens = sum(map(len, student))
    kl = sum(s - t for ss, ts in zip(student, teacher) for s, t in zip(ss, ts)) / tokens
    assert m["distill/reverse_kl"] == pytest.approx(kl, abs=1e-6)
    dock.close()


def test_the_teacher_stage_is_in_the_run_only_when_enabled(tiny_teacher_dir):
    on = load_config(None, ["teacher.enable=true", f"teacher.model.path={tiny_teacher_dir}"])
    assert stage_processes(on) == ["rollout", "reward", "teacher", "actor"]
    assert iteration_reports(on) == [Report.ROLLOUT, Report.REWARD, Report.TEACHER, Report.ACTOR, Report.WEIGHT_SYNC]
    assert "teacher" not in stage_processes(load_config(None, []))


def test_config_errors_name_the_teacher_fields(tmp_path, tiny_model_dir, tiny_teacher_dir):
    with pytest.raises(ConfigError, match=r"teacher.model.path: got ''; teacher.enable=true needs"):
        load_config(None, ["teacher.enable=true"])
    with pytest.raises(ConfigError, match=r"teacher.coef: got 0.0; expected a finite number > 0"):
        load_config(None, ["teacher.enable=true", "teacher.model.path=t", "teacher.coef=0"])
    with pytest.raises(ConfigError, match=r"teacher.reward_weight: got -1.0"):
        load_config(None, ["teacher.enable=true", "teacher.model.path=t", "teacher.reward_weight=-1"])
    with pytest.raises(ConfigError, match=r"teacher.coef: got 2.0; is set but teacher.enable is false"):
        load_config(None, ["teacher.coef=2"])
    with pytest.raises(ConfigError, match=r"teacher.enable: got True; not supported with algorithm.filter_groups.enable"):
        load_config(None, ["teacher.enable=true", "teacher.model.path=t", "algorithm.filter_groups.enable=true"])
    base = [f"model.path={tiny_model_dir}", f"run.output_dir={tmp_path / 'run'}", f"run.cache_dir={tmp_path / 'cache'}",
            "data.generate_train=20", "data.generate_test=4", "teacher.enable=true"]
    with pytest.raises(ConfigError, match=r"teacher.model.path: got '.*nowhere'; expected a local HF folder"):
        plan_run(load_config(None, [*base, f"teacher.model.path={tmp_path / 'nowhere'}"]))
    other = build_tiny_model(tmp_path / "other-tokenizer", vocab_size=400)
    with pytest.raises(ConfigError) as refused:
        plan_run(load_config(None, [*base, f"teacher.model.path={other}"]))
    assert str(refused.value).startswith(f"teacher.model.path: the teacher's tokenizer ({other}) is not the student's "
                                         f"(model.path: {tiny_model_dir}): ")
    assert "tokens against the student's" in str(refused.value)
    assert not (tmp_path / "run" / "config.yaml").exists()  # refused before anything of the run is written
    eos = tmp_path / "other-eos"
    shutil.copytree(tiny_teacher_dir, eos)
    config = json.loads((eos / "tokenizer_config.json").read_text())
    config["eos_token"] = "<|endoftext|>"
    (eos / "tokenizer_config.json").write_text(json.dumps(config))
    with pytest.raises(ConfigError, match=r"teacher.model.path: .*: EOS id 0 against the student's 2"):
        plan_run(load_config(None, [*base, f"teacher.model.path={eos}"]))


def distill_overrides(tiny_model_dir, tiny_teacher_dir, tmp_path, *extra):
    return [
        f"model.path={tiny_model_dir}", f"run.output_dir={tmp_path / 'run'}", f"run.cache_dir={tmp_path / 'cache'}",
        "run.progress=false", "trainer.iterations=2", "trainer.global_batch=2", "trainer.mini_batch=2",
        "trainer.micro_batch=4", "rollout.n=4", "rollout.max_response_length=8", "rollout.dtype=float32",
        "trainer.autocast_bf16=false", "trainer.save_every=0", "data.generate_train=20", "data.generate_test=4",
        "data.eval_size=4", "trainer.eval_before=false", "teacher.enable=true", f"teacher.model.path={tiny_teacher_dir}",
        "teacher.reward_weight=0", *extra,
    ]


def check_distill_run(run_dir):
    """Two iterations of distillation alone: the reverse KL is measured each iteration and the actor trained on it."""
    lines = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [x["iteration"] for x in lines] == [0, 1]
    for x in lines:  # two random models disagree: KL(student ‖ teacher) > 0, and the advantages are not all 0
        assert x["distill/reverse_kl"] > 0 and x["timing_s/teacher"] > 0
        assert math.isfinite(x["actor/loss"]) and x["actor/grad_norm"] > 0


@pytest.mark.slow
def test_a_run_in_process_distills_from_the_teacher(tiny_model_dir, tiny_teacher_dir, tmp_path, monkeypatch):
    monkeypatch.setattr(guard, "RewardScorer", FakeRandomScorer)
    driver.train(load_config(None, distill_overrides(tiny_model_dir, tiny_teacher_dir, tmp_path)))
    check_distill_run(tmp_path / "run")
