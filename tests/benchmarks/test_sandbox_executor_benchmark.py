"""benchmarks/sandbox_executor.py: the same programs here and through an executor process, its table and ratio."""

from __future__ import annotations

import importlib.util
import re
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_it_prints_both_routes_and_their_ratio():
    spec = importlib.util.spec_from_file_location("sandbox_executor_benchmark", ROOT / "benchmarks" / "sandbox_executor.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules.setdefault("sandbox_executor_benchmark", module)
    spec.loader.exec_module(module)
    out = module.main(["--programs", "8", "--threads", "2"])
    rows = {line.split("|")[1].strip(): [c.strip() for c in line.strip("|").split("|")] for line in out.splitlines()
            if line.startswith(("| local", "| executor"))}
    assert set(rows) == {"local (run_python)", "executor on loopback"}
    seconds = {route: float(cells[2]) for route, cells in rows.items()}
    for cells in rows.values():  # programs, seconds, programs/s, ms per program: one measurement each
        assert cells[1] == "8" and float(cells[2]) > 0
        assert abs(float(cells[4]) - 1000 * float(cells[2]) / 8) <= 0.1 + 1000 * 0.005 / 8
    ratio = float(re.search(r"executor / local: ([\d.]+)×", out).group(1))
    assert abs(ratio - seconds["executor on loopback"] / seconds["local (run_python)"]) < 0.05 + 0.01 * ratio
