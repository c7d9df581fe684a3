"""benchmarks/agents.py --quick: a multi-turn run with the calculator environment on the tiny model
prints the before/after and per-iteration tables, their numbers the run's metrics, and the command."""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.slow  # one short multi-turn training run of the tiny model (~1 min on 2 busy cores)
def test_quick_mode_prints_the_tables_of_the_runs_metrics(tiny_model_dir, tmp_path):
    spec = importlib.util.spec_from_file_location("agents_benchmark", ROOT / "benchmarks" / "agents.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules.setdefault("agents_benchmark", module)
    spec.loader.exec_module(module)
    out = module.main(["--quick", "--model", str(tiny_model_dir), "--engine", "hf", "--cache", str(tmp_path / "cache"),
                       "--out", str(tmp_path / "run"), "--tool-call-reward", "0.1", "--format-reward", "0"])
    lines = out.splitlines()
    evaluated = {line.split("|")[1].strip(): line for line in lines if line.startswith(("| before", "| after"))}
    assert set(evaluated) == {"before", "after"}
    summary = json.loads((tmp_path / "run" / "summary.json").read_text())
    config = (tmp_path / "run" / "config.yaml").read_text()
    assert "tool_call_reward: 0.1" in config and "format_reward: 0.0" in config
    for tag, line in evaluated.items():
        cells = [c.strip() for c in line.strip("|").split("|")]
        assert float(cells[1]) == pytest.approx(summary[f"eval/accuracy_{tag}"], abs=5e-4)
        assert float(cells[3]) == pytest.approx(summary[f"eval/turns_mean_{tag}"], abs=5e-3)
    metrics = [json.loads(x) for x in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    iterations = [line for line in lines if line.startswith(("| 0 ", "| 1 "))]
    assert len(iterations) == len(metrics) == 2
    for line, m in zip(iterations, metrics):
        cells = [c.strip() for c in line.strip("|").split("|")]
        assert float(cells[1]) == pytest.approx(m["reward/mean"], abs=5e-4)
        assert float(cells[5]) == pytest.approx(m["rollout/tool_calls_mean"], abs=5e-3)
        assert float(cells[8]) == pytest.approx(m["rollout/tool_calls_right_mean"], abs=5e-3)
        assert cells[2] == (f"{m['reward/verifier_mean'] / m['reward/mean']:.2f}" if m["reward/mean"] > 0 else "-")
    assert lines[-1].endswith("benchmarks/agents.py --quick --model " + f"{tiny_model_dir} --engine hf --cache {tmp_path / 'cache'} "
                              f"--out {tmp_path / 'run'} --tool-call-reward 0.1 --format-reward 0")
    assert "tool_call_reward: 0.1" in (tmp_path / "run" / "config.yaml").read_text()
