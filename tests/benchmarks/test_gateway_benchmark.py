"""benchmarks/gateway.py with the tiny model: both paths run the same sessions and the table reads them."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.slow  # the tiny model's sessions, direct and through agent processes, twice each (~30 s on 2 busy cores)
def test_the_gateway_benchmark_prints_both_paths_side_by_side(tmp_path):
    out = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "gateway.py"), "--model", "tiny", "--prompts", "1", "--n", "2",
                          "--max-new-tokens", "8", "--repeats", "1"], capture_output=True, text=True, timeout=600, check=True).stdout
    rows = {line.split("|")[1].strip(): [c.strip() for c in line.strip("|").split("|")] for line in out.splitlines()
            if line.startswith(("| direct", "| gateway"))}
    assert set(rows) == {"direct multi-turn rollout", "gateway (openai agents)"}
    for cells in rows.values():
        assert cells[1] == "2" and float(cells[2]) >= 2 and float(cells[4]) >= float(cells[5]) > 0
    assert rows["direct multi-turn rollout"][8] == "1.00"
    assert "gateway overhead per request:" in out and "starting one agent process" in out
