"""benchmarks/lora.py --quick: LoRA against full fine-tuning on the tiny model, both rows, and the LoRA
side's weight sync a small share of the full side's."""

from __future__ import annotations

import importlib.util
import math
import sys
from pathlib import Path

import pytest
from test_dock_benchmark import number

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.slow  # two short training processes on the tiny model
def test_quick_mode_gives_both_sides_and_the_lora_sync_is_small(tiny_model_dir, tmp_path, monkeypatch):
    monkeypatch.syspath_prepend(str(ROOT / "benchmarks"))  # its import of vs_trl
    spec = importlib.util.spec_from_file_location("lora_benchmark", ROOT / "benchmarks" / "lora.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules.setdefault("lora_benchmark", module)
    spec.loader.exec_module(module)
    out = module.main(["--quick", "--model", str(tiny_model_dir), "--engine", "hf", "--rollout-dtype", "bfloat16", "--rank", "2",
                       "--cache", str(tmp_path / "cache"), "--timeout-s", "600"])
    rows = {line.split("|")[1].strip(): [c.strip() for c in line.strip("|").split("|")]
            for line in out.splitlines() if line.startswith("| ") and not line.startswith("| side")}
    assert set(rows) == {"full fine-tuning", "LoRA"}
    for cells in rows.values():
        assert all(math.isfinite(number(c)) and number(c) > 0 for c in cells[3:]), cells
    full, lora = (number(rows[s][-1]) for s in ("full fine-tuning", "LoRA"))
    assert lora < 0.05 * full
