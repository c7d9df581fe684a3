"""benchmarks/algorithms.py: GRPO, DAPO, RLOO and PPO with one budget; --quick on the tiny model."""

from __future__ import annotations

import importlib.util
import math
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def load_benchmark():
    spec = importlib.util.spec_from_file_location("algorithms_benchmark", ROOT / "benchmarks" / "algorithms.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def data_rows(out: str) -> dict[str, list[str]]:
    return {line.split("|")[1].strip(): [c.strip() for c in line.strip().strip("|").split("|")]
            for line in out.splitlines() if line.startswith("| ") and not line.startswith("| algorithm")}


@pytest.mark.slow  # one training process per algorithm on the tiny model: ~4 min for the four on 2 busy cores
def test_quick_mode_prints_every_algorithm_with_the_same_budget():
    out = load_benchmark().main(["--quick", "--timeout-s", "600"])
    assert "machine: " in out and "2 iterations × 2 prompts × 4 samples × ≤8 tokens" in out
    rows = data_rows(out)
    assert list(rows) == ["grpo", "dapo", "rloo", "ppo"]
    assert "not available" not in rows["grpo"][1]  # the baseline always runs
    befores = set()
    for name, cells in rows.items():
        if "not available" in cells[1]:
            continue
        before, after, _, train, seconds = cells[1:6]
        assert 0 <= float(before) <= 100 and 0 <= float(after) <= 100, (name, cells)
        assert "→" in train and math.isfinite(float(seconds)) and float(seconds) > 0, (name, cells)
        befores.add(before)
    assert len(befores) == 1  # one model, one greedy evaluation set: the same accuracy before training


def test_the_table_shows_values_and_what_is_not_available():
    out = load_benchmark().table({
        "grpo": dict(before=7.0, after=22.5, train_first=2.0, train_last=48.0, seconds=33.0),
        "ppo": "no 'critic' stage in this build",
    })
    lines = out.splitlines()
    assert lines[2] == "| grpo | 7.0 | 22.5 | +15.5 | 2.0 → 48.0 | 33.00 |"
    assert lines[3].startswith("| ppo | not available (no 'critic' stage in this build) |") and lines[3].count("|") == lines[2].count("|")


def test_an_algorithm_this_build_cannot_configure_is_named_not_run(tmp_path):
    bench = load_benchmark()
    assert "unknown field" in bench.availability("x", ["algorithm.no_such_field=1"])
    with pytest.raises(SystemExit):
        bench.main(["--quick", "--algorithms", "grpo,trpo"])
