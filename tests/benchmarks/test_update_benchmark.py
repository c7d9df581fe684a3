"""benchmarks/update.py prints the update against its compute floor with finite numbers."""

from __future__ import annotations

import importlib.util
import math
from pathlib import Path

import pytest
from test_dock_benchmark import number

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.slow  # builds the tiny model and runs two updates: ~10 s, a minute on a loaded machine
def test_the_update_is_reported_against_its_floor():
    spec = importlib.util.spec_from_file_location("update_benchmark", ROOT / "benchmarks" / "update.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    out = module.main(["--model", "tiny", "--rows", "4", "--micro-batch", "2", "--max-response", "8", "--repeats", "1"])
    cells = [c.strip() for c in out.splitlines()[-1].strip("|").split("|")]
    values = [number(c.removesuffix("M")) for c in cells]
    assert all(math.isfinite(v) and v > 0 for v in values), cells
    tokens, padded, packed, now = values[:4]
    assert padded >= packed >= tokens  # packing computes no more than padding, and at least the real tokens
    assert padded >= now >= tokens  # micro-batches formed by length compute no more than padded consecutive ones
