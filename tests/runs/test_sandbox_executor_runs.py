"""Runs whose rewards are programs run in the sandbox (``fake_scorers.FakeProgramDigitScorer``) with
``env.sandbox.backend=pod``: in-process against a sandbox executor process, the run learns exactly as with the local
sandbox; distributed, the local backend starts the reward and rollout stages' executors and the reward stage's
programs go to its own."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from learning import reward_curve, rises
from test_distributed import run_config, workers_path  # noqa: F401 (a fixture)

from dockrl import driver
from dockrl.process.env import SANDBOX_URL_ENV

SCORER = "algorithm.scorer=fake_scorers:FakeProgramDigitScorer"


@pytest.mark.slow
def test_an_in_process_run_learns_the_same_through_a_sandbox_executor(tiny_model_dir, tmp_path, monkeypatch, sandbox_pod_env):
    local = reward_curve(monkeypatch, tiny_model_dir, tmp_path / "local", SCORER)
    pod = reward_curve(monkeypatch, tiny_model_dir, tmp_path / "pod", SCORER, "env.sandbox.backend=pod")
    assert pod == local  # every program's result came back whole: the same rewards, the same updates
    assert rises(pod), pod


@pytest.mark.slow
def test_a_distributed_run_sends_each_stages_programs_to_its_own_executor(tiny_model_dir, tmp_path, monkeypatch, workers_path):  # noqa: F811
    monkeypatch.delenv(SANDBOX_URL_ENV, raising=False)  # the launcher's executors only
    cfg = run_config(tiny_model_dir, tmp_path, SCORER, "env.sandbox.backend=pod", "trainer.iterations=1", "trainer.save_every=0",
                     "trainer.eval_before=false", "trainer.eval_after=false")
    driver.train(cfg)
    [metrics] = [json.loads(line) for line in (Path(cfg.run.output_dir) / "metrics.jsonl").read_text().splitlines()]
    assert 0.0 <= metrics["reward/mean"] <= 1.0
    logs = Path(cfg.run.output_dir) / "logs"
    urls = {stage: json.loads(next(line for line in (logs / f"sandbox-{stage}-0.log").read_text().splitlines()
                                   if line.startswith('{"url"')))["url"] for stage in ("rollout", "reward")}  # its line once it listened
    assert len(set(urls.values())) == 2 and all(url.startswith("http://127.0.0.1:") for url in urls.values())
