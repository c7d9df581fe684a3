"""The emulated-network dock benchmark runs end to end in its quick mode (or says why it cannot here) and cleans up."""

from __future__ import annotations

import math
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from benchmark_modules import load_benchmark

ROOT = Path(__file__).resolve().parents[2]
SIDES = ["centralized", "dock", "dock+locality"]


def namespaces() -> set[str]:
    """The benchmark's network namespaces that exist now (``dkn<pid>-*``)."""
    if shutil.which("ip") is None:
        return set()
    out = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
    return {line.split()[0] for line in out.splitlines() if line.startswith("dkn")}


def table(text: str, title: str) -> list[list[str]]:
    """The data rows of the table under the ``## title...`` line."""
    lines = text.splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith(f"## {title}"))
    rows = []
    for line in lines[start + 1:]:
        if not line.startswith("|"):
            break
        rows.append([c.strip() for c in line.strip("|").split("|")])
    return [r for r in rows[1:] if not set(r[0]) <= {"-"}]


@pytest.mark.slow  # ~30 s on one busy core: two shard processes, two worker nodes and the driver node's process start
def test_quick_mode_prints_every_side_with_finite_numbers_and_leaves_no_namespace():
    before = namespaces()
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
    proc = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "dock_network.py"), "--quick"], env=env,
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-4000:]
    if proc.stdout.startswith("# skipped:"):
        pytest.skip(proc.stdout.strip().removeprefix("# "))  # e.g. not root, or no netns in an unprivileged container
    assert namespaces() <= before, "the benchmark left network namespaces behind"
    rows = table(proc.stdout, "shaped links")
    assert [(r[0], r[1]) for r in rows] == [("2", side) for side in SIDES]
    for r in rows:
        values = [float(c.rstrip("x")) for i, c in enumerate(r) if i not in (0, 1, 5)]
        assert all(math.isfinite(v) and v > 0 for v in values), r
    assert [r[0] for r in table(proc.stdout, "halving R")] == SIDES
    assert "- dock+locality:" in proc.stdout and "its own link bound" in proc.stdout


def test_striped_prompt_puts_cover_every_row_once_in_whole_groups_each_round_on_every_shard():
    striped = load_benchmark("dock_network").striped

    ranges = [(0, 64), (64, 128), (128, 192), (192, 256)]
    puts = striped(ranges, 8, 4)
    assert sorted(r for put in puts for r in put.tolist()) == list(range(256))
    for put in puts:  # two groups of every shard per round
        assert [sum(a <= r < b for r in put.tolist()) for a, b in ranges] == [16, 16, 16, 16]
        assert all(len(set(put.tolist()) & set(range(g, g + 8))) in (0, 8) for g in range(0, 256, 8))
    assert [p.tolist() for p in striped(ranges, 8, 1)] == [list(range(256))]  # shard after shard, one put
