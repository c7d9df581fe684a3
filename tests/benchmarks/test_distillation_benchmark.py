"""benchmarks/distillation.py --quick: the three sides on the tiny model, each row's numbers finite, the teacher's
only where a side has one."""

from __future__ import annotations

import importlib.util
import math
import sys
from pathlib import Path

import pytest
from test_dock_benchmark import number

from dockrl.run.models import build_tiny_model

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.slow  # three short training runs on the tiny model
def test_quick_mode_gives_the_three_sides(tiny_model_dir, tmp_path):
    spec = importlib.util.spec_from_file_location("distillation_benchmark", ROOT / "benchmarks" / "distillation.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules.setdefault("distillation_benchmark", module)
    spec.loader.exec_module(module)
    teacher = build_tiny_model(tmp_path / "teacher", num_layers=3)
    out = module.main(["--quick", "--model", str(tiny_model_dir), "--teacher", str(teacher), "--engine", "hf",
                       "--cache", str(tmp_path / "cache")])
    rows = {line.split("|")[1].strip(): [c.strip() for c in line.strip("|").split("|")]
            for line in out.splitlines() if line.startswith("| ") and not line.startswith("| side")}
    assert set(rows) == {"GRPO", "GRPO + teacher", "distillation alone"}
    for side, cells in rows.items():
        assert all(math.isfinite(number(c)) and number(c) > 0 for c in cells[2:4]), cells  # s/iteration, tokens/s
        assert (number(cells[4]) > 0) == (side != "GRPO") and (cells[5] == "—") == (side == "GRPO"), cells
