"""benchmarks/inflight.py --quick runs the distributed tiny-model run with 1 and 2 iterations in flight and prints both."""

from __future__ import annotations

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


@pytest.mark.slow  # two distributed runs of the tiny model, three iterations each: ~1-2 min on one busy core
def test_quick_mode_prints_the_bubble_of_both_sides():
    out = load_benchmark().main(["--quick"])
    cells = [re.split(r"\s{2,}", line.strip()) for line in out.splitlines()[1:]]
    rows = {c[0]: c[1:] for c in cells}
    bubble = [float(v) for v in rows["actor bubble (idle / wall)"]]
    assert all(0 <= b < 1 for b in bubble[:2]), out
    assert [float(v) for v in rows["max rollout staleness"][:2]] == [0.0, 1.0], out  # the off-policy side ran one step behind
    assert all(math.isfinite(float(v)) and float(v) > 0 for v in rows["response tokens/s, end to end"]), out
