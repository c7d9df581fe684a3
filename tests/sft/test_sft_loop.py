"""``dockrl sft`` on the tiny model: the loss against a hand-computed NLL, a short run, its checkpoint as
``dockrl train``'s starting model, resuming after a stop, and what a resume refuses."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM

from dockrl import driver
from dockrl.config import ConfigError, load_config
from dockrl.engines.hf.train import HFTrainEngine
from dockrl.sft import sft
from dockrl.sft.data import Example, conversation_tokens
from dockrl.sft.loop import accumulate_sft

CONVERSATIONS = [
    [{"role": "user", "content": "Tom has 3 apples. He buys 4 more."}, {"role": "assistant", "content": "3 + 4 = 7.\n#### 7"},
     {"role": "user", "content": "And twice that?"}, {"role": "assistant", "content": "7 * 2 = 14.\n#### 14"}],
    [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Sara has 9 cards and loses 2."},
     {"role": "assistant", "content": "9 - 2 = 7.\n#### 7"}],
]


def examples(tokenizer) -> list[Example]:
    out = []
    for messages in CONVERSATIONS:
        ids, mask = conversation_tokens(tokenizer, messages, model="tiny")
        first = mask.index(1)
        out.append(Example(ids[:first], ids[first:], mask[first:]))
    return out


@pytest.mark.parametrize(("micro_batch", "micro_batch_tokens"), [(1, 0), (2, 0), (1, 64)])
def test_the_loss_is_the_mean_nll_of_the_assistant_tokens(tiny_model_dir, micro_batch, micro_batch_tokens):
    engine = HFTrainEngine(tiny_model_dir, trainable=True)
    batch = examples(engine.tokenizer)
    metrics = accumulate_sft(engine, batch, micro_batch=micro_batch, micro_batch_tokens=micro_batch_tokens)
    # by hand: one plain forward per conversation, -log p of each token under the logits of the one before, where the mask is 1
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, torch_dtype=torch.float32).eval()
    nll, count = 0.0, 0
    with torch.no_grad():
        for e in batch:
            ids = torch.tensor([e.prompt_ids + e.response_ids])
            log_probs = torch.log_softmax(model(ids).logits[0].double(), dim=-1)
            for k, (token, m) in enumerate(zip(e.response_ids, e.loss_mask)):
                if m:
                    nll -= float(log_probs[len(e.prompt_ids) + k - 1, token])
                    count += 1
    assert metrics["sft/tokens"] == count == sum(sum(e.loss_mask) for e in batch)
    assert metrics["sft/loss"] == pytest.approx(nll / count, abs=1e-5)
    assert metrics["sft/sequences"] == 2


def run_config(tiny_model_dir, run_dir, cache_dir, *extra: str):
    return load_config(None, [
        f"model.path={tiny_model_dir}", f"run.output_dir={run_dir}", f"run.cache_dir={cache_dir}", "run.progress=false",
        "data.generate_train=48", "data.generate_test=4", "sft.batch_size=8", "trainer.lr=1e-3", "trainer.micro_batch=4",
        "trainer.autocast_bf16=false", "rollout.dtype=float32", "rollout.max_response_length=8", *extra,
    ])


def losses(run_dir) -> dict[int, float]:
    return {row["iteration"]: row["sft/loss"] for row in map(json.loads, (run_dir / "metrics.jsonl").read_text().splitlines())}


@pytest.mark.slow
def test_a_short_run_lowers_the_loss_and_rl_starts_from_its_final_checkpoint(tiny_model_dir, tmp_path):
    run_dir = tmp_path / "sft"
    summary = sft(run_config(tiny_model_dir, run_dir, tmp_path / "cache", "sft.epochs=2", "trainer.save_every=4",
                             "trainer.keep_checkpoints=1", "data.eval_size=4"))
    loss = losses(run_dir)
    assert sorted(loss) == list(range(12))  # 2 epochs × 48 examples / 8 per step
    assert sum(loss[k] for k in (9, 10, 11)) < sum(loss[k] for k in (0, 1, 2)) - 1.0
    assert {"eval/accuracy_before", "eval/accuracy_after"} <= set(summary) and summary["sft/steps"] == 12
    assert sorted(p.name for p in (run_dir / "checkpoints").iterdir()) == ["final", "iter_000008"]  # keep_checkpoints=1
    final = run_dir / "checkpoints" / "final"
    assert json.loads((final / "driver_state.json").read_text())["next_iteration"] == 12
    assert (run_dir / "tensorboard").is_dir() and (run_dir / "metrics.png").is_file()
    trained = load_file(final / "model.safetensors")
    base = load_file(tiny_model_dir / "model.safetensors")
    assert all(not torch.equal(trained[k], base[k]) for k in base if k.endswith("q_proj.weight"))
    rl_dir = tmp_path / "rl"
    driver.train(load_config(None, [
        f"model.path={final}", f"run.output_dir={rl_dir}", f"run.cache_dir={tmp_path / 'cache'}", "run.progress=false",
        "trainer.iterations=1", "trainer.global_batch=2", "trainer.mini_batch=2", "trainer.micro_batch=4", "rollout.n=2",
        "rollout.max_response_length=8", "rollout.dtype=float32", "trainer.autocast_bf16=false", "trainer.eval_before=false",
        "trainer.eval_after=false", "data.generate_train=48", "data.generate_test=4",
    ]))
    assert [row["iteration"] for row in map(json.loads, (rl_dir / "metrics.jsonl").read_text().splitlines())] == [0]
    with pytest.raises(ConfigError, match=r"is a checkpoint of an SFT run \(dockrl sft\)"):  # not resumed as an RL run
        driver.train(load_config(None, [f"model.path={tiny_model_dir}", f"run.output_dir={run_dir}", f"run.resume={final}"]))


class Stop(Exception):
    """Raised by the test's step callback: a run cut short after a step."""


@pytest.mark.slow
@pytest.mark.parametrize("lora", [False, True])
def test_a_stopped_run_resumes_at_the_step_after_its_checkpoint_as_if_never_stopped(tiny_model_dir, tmp_path, lora):
    extra = ["sft.epochs=1", "trainer.save_every=2", "trainer.eval_before=false", "trainer.eval_after=false"]
    extra += ["trainer.lora.rank=4"] if lora else []
    whole = tmp_path / "whole"
    sft(run_config(tiny_model_dir, whole, tmp_path / "cache", *extra))

    def stop_after_3(step: int, metrics: dict[str, float]) -> None:
        if step == 3:
            raise Stop

    cut = tmp_path / "cut"
    with pytest.raises(Stop):
        sft(run_config(tiny_model_dir, cut, tmp_path / "cache", *extra), on_step=stop_after_3)
    assert sorted(losses(cut)) == [0, 1, 2, 3] and not (cut / "checkpoints" / "iter_000004").exists()  # cut short: removed
    with pytest.raises(ConfigError, match=r"already holds a run"):
        sft(run_config(tiny_model_dir, cut, tmp_path / "cache", *extra))
    with pytest.raises(ConfigError, match=r"sft.batch_size=8, this run has 4"):
        sft(run_config(tiny_model_dir, cut, tmp_path / "cache", *extra, "run.resume=latest", "sft.batch_size=4"))
    steps = []
    sft(run_config(tiny_model_dir, cut, tmp_path / "cache", *extra, "run.resume=latest"), on_step=lambda k, m: steps.append(k))
    assert steps == [2, 3, 4, 5]  # after iter_000002, written after step 1
    assert sorted(losses(cut)) == list(range(6))
    assert losses(cut) == pytest.approx(losses(whole), abs=1e-5)
    a, b = (load_file(d / "checkpoints" / "final" / "model.safetensors") for d in (whole, cut))
    assert all(torch.allclose(a[k], b[k], atol=1e-6) for k in a)
    with pytest.raises(ConfigError, match=r"sft.epochs: got 1 \(6 steps\); the checkpoint .* resumes at step 6"):
        sft(run_config(tiny_model_dir, cut, tmp_path / "cache", *extra, "run.resume=latest"))

