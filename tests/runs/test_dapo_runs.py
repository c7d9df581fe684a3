"""End-to-end DAPO on the tiny model (``dock.mode=inprocess``): dynamic sampling trains exactly the
configured batch, and a dataset the model always solves ends with the configured policy within
the bound of rollout rounds, never in an endless loop (each run under a hard deadline)."""

from __future__ import annotations

import contextlib
import json
import math
import re
import signal
from pathlib import Path

import pytest
from fake_scorers import FakeRandomScorer, FakeSolvedScorer  # noqa: E402

from dockrl import driver
from dockrl.config import load_config
from dockrl.rewards import guard
from dockrl.stages.dynamic_sampling import DynamicSamplingExhausted

DEADLINE_S = 240


@contextlib.contextmanager
def deadline(seconds: int):
    """Fail the test with ``TimeoutError`` if the block runs longer than ``seconds`` (SIGALRM; main thread)."""
    def expired(signum, frame):
        raise TimeoutError(f"the run did not end within {seconds} s")

    previous = signal.signal(signal.SIGALRM, expired)
    signal.alarm(seconds)
    try:
        yield
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, previous)


def dapo_config(tiny_model_dir, tmp_path: Path, *extra: str):
    return load_config(None, [
        f"model.path={tiny_model_dir}", f"run.output_dir={tmp_path / 'run'}", f"run.cache_dir={tmp_path / 'cache'}",
        "run.progress=false", "trainer.iterations=2", "trainer.global_batch=4", "trainer.mini_batch=2",
        "trainer.micro_batch=4", "rollout.n=4", "rollout.max_response_length=12", "rollout.dtype=float32",
        "trainer.autocast_bf16=false", "trainer.lr=1e-2", "trainer.save_every=0", "trainer.eval_before=false",
        "trainer.eval_after=false", "data.generate_train=40", "data.generate_test=8", "data.eval_size=8",
        "algorithm.filter_groups.enable=true", "algorithm.filter_groups.max_num_gen_batches=3", "dock.timeout_s=60",
        *extra,
    ])


def metrics(tmp_path: Path) -> list[dict]:
    return [json.loads(x) for x in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]


@pytest.mark.slow
def test_dapo_trains_exactly_the_configured_batch(tiny_model_dir, tmp_path, monkeypatch):
    monkeypatch.setattr(guard, "RewardScorer", FakeRandomScorer)
    cfg = dapo_config(tiny_model_dir, tmp_path, "algorithm.overlong_buffer.enable=true", "algorithm.overlong_buffer.len=4",
                      "algorithm.overlong_filter=true")
    with deadline(DEADLINE_S):
        driver.train(cfg)
    for m in metrics(tmp_path):
        assert m["actor/sequences"] == 4 * 4  # trainer.global_batch × rollout.n, whatever was sampled
        assert 1 <= m["rollout/gen_batches"] <= 3
        assert m["rollout/responses"] == m["rollout/gen_batches"] * 4 * 4
        assert math.isfinite(m["actor/loss"]) and m["reward/overlong_penalty_mean"] <= 0
        assert 0 <= m["actor/overlong_filtered"] <= 1


@pytest.mark.slow
@pytest.mark.parametrize("policy", ["error", "fill"])
def test_a_dataset_the_model_always_solves_ends_within_the_bound(tiny_model_dir, tmp_path, monkeypatch, policy):
    monkeypatch.setattr(guard, "RewardScorer", FakeSolvedScorer)
    cfg = dapo_config(tiny_model_dir, tmp_path, f"algorithm.filter_groups.on_exhausted={policy}")
    with deadline(DEADLINE_S):
        if policy == "error":
            with pytest.raises(DynamicSamplingExhausted, match="0 of trainer.global_batch=4 groups .* after max_num_gen_batches=3"):
                driver.train(cfg)
            return
        driver.train(cfg)
    for m in metrics(tmp_path):
        assert m["rollout/gen_batches"] == 3 and m["rollout/filled_groups"] == 4 and m["actor/sequences"] == 16


@pytest.mark.parametrize(("overrides", "field"), [
    (["algorithm.filter_groups.max_num_gen_batches=0"], "algorithm.filter_groups.max_num_gen_batches: got 0"),
    (["algorithm.overlong_buffer.enable=true", "algorithm.overlong_buffer.len=81"], "algorithm.overlong_buffer.len: got 81"),
    (["algorithm.overlong_buffer.penalty_factor=-1"], "algorithm.overlong_buffer.penalty_factor: got -1.0"),
    (["algorithm.filter_groups.enable=true", "dock.shards=2"], "dock.shards: got 2; algorithm.filter_groups.enable"),
    (["algorithm.filter_groups.enable=true", "critic.enable=true"], "critic.enable: got True; algorithm.filter_groups.enable"),
    (["algorithm.filter_groups.metric=seq_reward"], "algorithm.filter_groups.metric: got 'seq_reward'"),
])
def test_impossible_dapo_settings_name_their_fields(overrides, field):
    from dockrl.config import ConfigError

    with pytest.raises(ConfigError, match=re.escape(field)):
        load_config(None, overrides)


def test_dapo_settings_load_from_yaml_and_overrides(tmp_path):
    path = tmp_path / "dapo.yaml"
    path.write_text("algorithm:\n  filter_groups:\n    enable: true\n    max_num_gen_batches: 4\n")
    cfg = load_config(path, ["algorithm.filter_groups.on_exhausted=fill", "algorithm.overlong_filter=true"])
    f = cfg.algorithm.filter_groups
    assert (f.enable, f.max_num_gen_batches, f.on_exhausted, f.rounds) == (True, 4, "fill", 4)
    assert cfg.algorithm.overlong_filter and not cfg.algorithm.overlong_buffer.enable


class Interrupt(Exception):
    pass


def stop_in_iteration_2(it: int, metrics: dict) -> None:
    if it == 2:  # its metrics line is written, the checkpoint after iteration 1 (iteration 2 open, gated) is complete
        raise Interrupt


@pytest.mark.slow  # three short runs of the tiny model
def test_an_interrupted_dapo_run_resumes_to_the_uninterrupted_result(tiny_model_dir, tmp_path, monkeypatch):
    from fake_scorers import FakeHashScorer

    from dockrl.checkpoint.resume import checkpoint_dir

    monkeypatch.setattr(guard, "RewardScorer", FakeHashScorer)  # a response's score from its text: the same in every run

    def config(name: str, *extra: str):
        return dapo_config(tiny_model_dir, tmp_path / name, "trainer.iterations=3", "trainer.save_every=1",
                           "algorithm.filter_groups.on_exhausted=fill", *extra)

    with deadline(DEADLINE_S):
        driver.train(config("straight"))
        with pytest.raises(Interrupt):
            driver.train(config("cut"), on_iteration=stop_in_iteration_2)
        assert (checkpoint_dir(tmp_path / "cut" / "run", 2) / "dock" / "meta.json").is_file()
        driver.train(config("cut", "run.resume=latest"))
    straight, cut = metrics(tmp_path / "straight"), metrics(tmp_path / "cut")
    assert [x["iteration"] for x in cut] == [0, 1, 2]
    for x, y in zip(straight, cut):
        keys = [k for k in x if k.startswith(("reward/", "rollout/", "actor/"))]
        assert "rollout/gen_batches" in keys and "actor/sequences" in keys
        for k in keys:
            assert math.isclose(x[k], y[k], rel_tol=1e-4, abs_tol=1e-6), (x["iteration"], k, x[k], y[k])
