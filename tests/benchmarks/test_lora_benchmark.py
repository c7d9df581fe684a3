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
    blocks = out.split("\n\n")[:2]  # the results, then the stages' seconds
    results, stages = ({line.split("|")[1].strip(): [c.strip() for c in line.strip("|").split("|")]
                        for line in block.splitlines() if line.startswith("| ") and not line.startswith("| side")}
                       for block in blocks)
    assert set(results) == set(stages) == {"full fine-tuning", "LoRA"}
    for cells in results.values():
        assert all(math.isfinite(number(c)) and number(c) > 0 for c in cells[3:]), cells
    full, lora = (number(results[s][-1]) for s in ("full fine-tuning", "LoRA"))
    assert lora < 0.05 * full
    header = [c.strip() for c in blocks[1].splitlines()[0].strip("|").split("|")][1:]
    for cells in stages.values():
        timing = dict(zip(header, map(number, cells[1:])))
        assert timing["rollout"] > 0 and timing["actor"] > 0 and all(v >= 0 for v in timing.values()), cells
