"""End-to-end: the GRPO driver on the tiny model, with a fake reward so every group has signal."""

import json
import math

import pytest
import torch
from fake_scorers import FakeRandomScorer  # noqa: E402
from transformers import AutoModelForCausalLM

from dockrl import driver

from dockrl.run import setup as run_setup
from dockrl.config import load_config, load_config_text
from dockrl.rewards import guard


@pytest.mark.slow
def test_three_iterations_update_every_parameter_and_checkpoint_reloads(tiny_model_dir, tmp_path, monkeypatch):
    monkeypatch.setattr(guard, "RewardScorer", FakeRandomScorer)
    cfg = load_config(None, [
        f"model.path={tiny_model_dir}", f"run.output_dir={tmp_path / 'run'}", f"run.cache_dir={tmp_path / 'cache'}",
        "run.progress=false", "trainer.iterations=3", "trainer.global_batch=4", "trainer.mini_batch=2",
        "trainer.micro_batch=4", "rollout.n=4", "rollout.max_response_length=12", "rollout.dtype=float32",
        "trainer.autocast_bf16=false", "trainer.lr=1e-2", "trainer.save_every=2", "algorithm.kl_loss_coef=0.05",
        "data.generate_train=40", "data.generate_test=8", "data.eval_size=8",
    ])
    before = AutoModelForCausalLM.from_pretrained(tiny_model_dir).state_dict()
    summary = driver.train(cfg)

    run = tmp_path / "run"
    lines = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
    assert [x["iteration"] for x in lines] == [0, 1, 2]
    for x in lines:
        assert math.isfinite(x["actor/loss"]) and x["actor/grad_norm"] > 0
        assert x["rollout/response_length_mean"] > 0
    assert abs(lines[0]["actor/first_step_ratio_mean"] - 1.0) < 1e-5  # bf16 off: on-policy at the first step
    assert {"eval/accuracy_before", "eval/accuracy_after"} <= summary.keys()
    assert (run / "metrics.png").stat().st_size > 0 and (run / "config.yaml").is_file()
    assert (run / "checkpoints" / "iter_000002" / "model.safetensors").is_file()

    after = AutoModelForCausalLM.from_pretrained(run / "checkpoints" / "final")
    unchanged = [n for n, p in after.named_parameters() if torch.equal(p, before[n])]
    assert unchanged == []
    tok_dir = run / "checkpoints" / "final"
    assert (tok_dir / "tokenizer.json").is_file()


def test_the_cli_names_a_model_path_that_is_no_model_folder(tmp_path, capsys):
    from dockrl.cli import main

    assert main(["prepare-model", f"model.path={tmp_path / 'nowhere'}"]) == 2
    err = capsys.readouterr().err
    assert "model.path: got" in err and "local HF model folder with config.json" in err and "Traceback" not in err



def test_prompt_batches_use_every_prompt_once_per_epoch():
    # 7 prompts, batches of 3: 21 picks are exactly 3 epochs, each a permutation, batches crossing epoch ends
    cfg = load_config(overrides=["trainer.global_batch=3", "trainer.mini_batch=3", "trainer.iterations=7"])
    picks = [p for batch in run_setup.prompt_batches(list(range(7)), cfg.trainer) for p in batch]
    assert len(picks) == 21
    epochs = [picks[i:i + 7] for i in range(0, 21, 7)]
    assert all(sorted(e) == list(range(7)) for e in epochs)
    assert epochs[0] != epochs[1]  # a fresh shuffle each epoch
    again = [p for batch in run_setup.prompt_batches(list(range(7)), cfg.trainer) for p in batch]
    assert again == picks  # seeded: a resumed run sees the same batches


def test_print_config_prints_the_resolved_config_and_runs_nothing(tmp_path, capsys):
    from dockrl.cli import config_fields_help, main

    run = tmp_path / "never"
    assert main(["train", "--print-config", "rollout.n=16", f"run.output_dir={run}"]) == 0
    printed = load_config_text(capsys.readouterr().out, "printed")
    assert printed.rollout.n == 16 and printed.trainer == load_config(None, []).trainer and not run.exists()
    assert (printed.parallel.device, printed.rollout.engine, printed.rollout.dtype) == ("auto", "auto", "auto")  # not resolved
    assert main(["train", "--print-config", "trainer.lr=x"]) == 2
    assert "trainer.lr: got 'x'" in capsys.readouterr().err
    for section in ("model", "trainer", "dock", "run"):  # --help lists every section's fields
        assert f"\n  {section}: " in config_fields_help()
    assert "micro_batch_tokens" in config_fields_help()
