"""The dock sample-flow benchmark runs end to end at tiny sizes and prints every row with finite numbers."""

from __future__ import annotations

import math
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
WORKERS, SHARDS, TOKENS = (1, 2), (1, 2), (64, 32)
ARGS = ["--rows", "64", "--group-size", "8", "--prompt-tokens", "8", "--tokens", "64", "--tokens2", "32",
        "--workers", "1,2", "--shards", "1,2", "--repeats", "1", "--warmup", "0", "--claim-rows", "16", "--timeout-s", "60"]


def number(cell: str) -> float:
    return float(cell.strip().rstrip("%x").lstrip("x").replace(",", ""))


def tables(text: str) -> dict[str, list[list[str]]]:
    """Each ``## title`` of the output with the data rows of the table under it (header and rule dropped)."""
    out: dict[str, list[list[str]]] = {}
    title = None
    for line in text.splitlines():
        if line.startswith("## "):
            title = line
            out[title] = []
        elif line.startswith("|") and title and not line.startswith("|-"):
            out[title].append([c.strip() for c in line.strip("|").split("|")])
    return {t: rows[1:] for t, rows in out.items() if rows}


@pytest.mark.slow  # ~15 s on 2 busy cores: 12 worker processes and 2 shard processes start
def test_benchmark_prints_every_configuration_with_finite_numbers():
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
    proc = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "dock.py"), *ARGS], env=env, capture_output=True,
                          text=True, timeout=180)
    assert proc.returncode == 0, proc.stderr[-4000:]
    text = proc.stdout
    assert re.search(rf"# machine: {os.cpu_count()} CPU cores", text)
    found = tables(text)
    configs = [(str(w), topo, shards) for w in WORKERS for topo, shards in [("centralized", "-")] + [("dock", str(s)) for s in SHARDS]]
    for tokens in TOKENS:
        [title] = [t for t in found if t.startswith(f"## responses ~{tokens} tokens")]
        payload = float(re.search(r"stage payload ([\d.e+-]+) MB", title).group(1)) * 1e6
        assert payload > 0 and math.isfinite(float(re.search(r"ceiling ([\d.e+-]+) GB/s", title).group(1)))
        rows = found[title]
        assert [tuple(r[:3]) for r in rows] == configs
        for row in rows:
            values = [number(c) for c in row[3:]]
            assert all(math.isfinite(v) and v > 0 for v in values), row
            controller = number(row[8])
            if row[1] == "centralized":  # every payload byte crosses the driver (4 significant digits printed)
                assert controller >= payload * 0.999
            else:  # the shards' controllers see metadata only
                assert controller < payload
    [independence] = [t for t in found if t.startswith("## controller bytes against payload")]
    assert [tuple(r[:3]) for r in found[independence]] == configs
    assert all(math.isfinite(number(c)) for r in found[independence] for c in r[3:])
    assert "- dock speed / centralized speed:" in text and "- dock GB/s / loopback ceiling:" in text
