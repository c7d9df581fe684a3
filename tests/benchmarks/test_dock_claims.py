"""The claim benchmark runs end to end in its quick mode and prints its three tables with finite numbers."""

from __future__ import annotations

import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
from test_dock_benchmark import number, tables

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.slow  # ~20 s on 2 busy cores: three server processes start, and small iterations run
def test_quick_claim_benchmark_prints_every_table_with_finite_numbers():
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
    proc = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "dock_claims.py"), "--quick"], env=env,
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-4000:]
    found = tables(proc.stdout)
    [cycle] = [rows for title, rows in found.items() if title.startswith("## (a)")]
    [claims] = [rows for title, rows in found.items() if title.startswith("## (b)")]
    [cpu] = [rows for title, rows in found.items() if title.startswith("## (c)")]
    assert cycle[-1][0] == "median" and len(cycle) == 3  # two repeats and their median
    for row in cycle[:-1]:  # each repeat's ratio is its own times' (the medians are taken column by column)
        raw, exchange, one, two, tls, one_ratio, two_ratio, tls_ratio = (number(c) for c in row[1:])
        assert all(math.isfinite(v) and v > 0 for v in (raw, exchange, one, two, tls, one_ratio, two_ratio, tls_ratio))
        assert one_ratio == pytest.approx(one / raw, rel=0.02, abs=0.01)
        assert two_ratio == pytest.approx(two / raw, rel=0.02, abs=0.01)
        assert tls_ratio == pytest.approx(tls / one, rel=0.02, abs=0.01)  # the shard over mutual TLS against the plain one
    assert [r[0] for r in claims] == ["rows", "rows", "claimers", "claimers", "blocked (claim+put+ack)", "blocked (claim+put+ack)"]
    assert all(number(r[-1]) > 0 for r in claims)
    assert [(number(r[0]), number(r[1])) for r in cpu] == [(1024, 64), (2048, 128)]
    for row in cpu:
        total, claim = number(row[2]), number(row[3])
        assert 0 < claim <= total and row[4] == "measured"
