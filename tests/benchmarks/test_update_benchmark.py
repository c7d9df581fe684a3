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
    def run(*extra: str) -> list[float]:
        out = module.main(["--model", "tiny", "--rows", "4", "--micro-batch", "2", "--max-response", "8", "--repeats", "1", *extra])
        cells = [c.strip() for c in out.splitlines()[-1].strip("|").split("|")]
        values = [number(c.removesuffix("M")) for c in cells]
        assert all(math.isfinite(v) and v > 0 for v in values), cells
        return values

    tokens, padded, packed, now = run()[:4]
    assert padded >= packed >= tokens  # packing computes no more than padding, and at least the real tokens
    assert now == packed  # the default (no token budget): micro-batches of consecutive rows, packed
    tokens_b, padded_b, packed_b, now_b = run("--micro-batch-tokens", "40")[:4]
    assert (tokens_b, padded_b, packed_b) == (tokens, padded, packed)
    assert now_b >= tokens  # by length, at most 40 tokens each (a longer row alone): at least the real tokens
    bf16 = module.main(["--model", "tiny", "--rows", "4", "--micro-batch", "2", "--max-response", "8", "--repeats", "1", "--bf16"])
    assert "bf16 autocast" in bf16.splitlines()[0]  # the same update under autocast, against the bf16 matmul rate
    assert all(math.isfinite(number(c.strip().removesuffix("M"))) for c in bf16.splitlines()[-1].strip("|").split("|"))
