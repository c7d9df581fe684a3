"""benchmarks/inflight.py --quick runs the distributed run of the heavy-tailed tiny model with 1
and 2 iterations in flight and with partial rollout, and prints the lengths and the table; --set
and --side reach the runs."""

from __future__ import annotations

import argparse
import importlib.util
import math
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def load_benchmark():
    spec = importlib.util.spec_from_file_location("inflight", ROOT / "benchmarks" / "inflight.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_sides_are_parsed_and_bad_ones_refused():
    bench = load_benchmark()
    assert bench.parse_side("two + x: dock.max_inflight=2, rollout.top_p=0.9") == (
        "two + x", ("dock.max_inflight=2", "rollout.top_p=0.9"))
    for bad in ["no-colon", ":dock.max_inflight=2", "label:", "label:dock.max_inflight"]:
        with pytest.raises(argparse.ArgumentTypeError, match="LABEL:KEY=VALUE"):
            bench.parse_side(bad)


def test_set_reaches_every_side_and_a_side_its_own_run(tmp_path):
    bench = load_benchmark()
    args = bench.parse_args(["--quick", "--set", "rollout.top_p=0.9", "--set", "trainer.seed=7",
                             "--side", "x:dock.max_inflight=2,rollout.top_p=0.5"])
    sides = bench.default_sides(args) | dict(args.side)
    configs = {label: bench.side_config("m", tmp_path / label, tmp_path, overrides, args) for label, overrides in sides.items()}
    assert [c.dock.max_inflight for c in configs.values()] == [1, 2, 2, 2]
    assert [c.rollout.partial_tokens for c in configs.values()] == [0, 0, 4, 0]  # a quarter of the 16 tokens
    assert [c.rollout.top_p for c in configs.values()] == [0.9, 0.9, 0.9, 0.5]  # the side's own setting wins over --set
    assert {c.trainer.seed for c in configs.values()} == {7} and {c.rollout.max_response_length for c in configs.values()} == {16}
    with pytest.raises(SystemExit):
        bench.parse_args(["--set", "rollout.top_p"])


@pytest.mark.slow  # two distributed runs of the tiny model, three iterations each: ~2-5 min on one busy core
def test_quick_mode_prints_the_lengths_and_the_bubble_of_every_side():
    out = load_benchmark().main(["--quick"])
    lines = out.splitlines()
    assert lines[0] == "== heavy lengths ==", out
    found = re.search(r"median (\d+), p90 (\d+), p99 (\d+), max (\d+)", lines[1])
    assert found, out
    median, _, p99, longest = map(int, found.groups())
    assert median < 16 and p99 == longest == 16, out  # short most of the time, the tail at the limit
    assert lines[2].startswith("  stated (heavy_tail_length_pmf): median"), out
    assert re.split(r"\s{2,}", lines[3].strip()) == ["max_inflight=1", "2 + partial", "ratio 2/1"], out
    rows = {c[0]: c[1:] for c in (re.split(r"\s{2,}", line.strip()) for line in lines[4:])}
    assert all(0 <= float(b) < 1 for b in rows["actor bubble (idle / wall)"][:2]), out
    assert [float(v) for v in rows["max rollout staleness"][:2]] == [0.0, 1.0], out  # the off-policy side ran one step behind
    assert all(math.isfinite(float(v)) and float(v) > 0 for v in rows["response tokens/s, end to end"]), out
    assert all(2 <= float(v) <= 16 for v in rows["response length mean, tokens"][:2]), out
    cut = [float(v) for v in rows["responses cut at the pass budget"][:2]]
    assert cut[0] == 0 and cut[1] > 0, out  # a budget of 4 tokens cuts most of them
