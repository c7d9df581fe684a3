"""benchmarks/memory.py: each side's peak by stage and its state by object, from vs_trl's runs."""

from __future__ import annotations

import importlib.util
import math
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def load_benchmark(monkeypatch):
    monkeypatch.syspath_prepend(str(ROOT / "benchmarks"))  # its import of vs_trl
    spec = importlib.util.spec_from_file_location("memory_benchmark", ROOT / "benchmarks" / "memory.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def rows(table: str) -> dict[str, list[str]]:
    return {line.split("|")[1].strip(): [c.strip() for c in line.strip("|").split("|")]
            for line in table.splitlines() if line.startswith("| ") and not line.startswith("| side")}


def test_the_tables_by_stage_and_by_object(monkeypatch):
    bench = load_benchmark(monkeypatch)
    trl = dict(peak_rss_gb=6.0, params=2**28, trainable=2**28, **{"memory/peak_rss_gb/rollout": 3.0, "memory/peak_rss_gb/update": 5.5})
    vllm = dict(peak_rss_gb=4.5, params=2**28, trainable=2**28, rollout_copy_gb=1.0, kv_cache_gb=0.5,
                **{"memory/peak_rss_gb/rollout": 4.0, "memory/peak_rss_gb/reward": 3.5, "memory/peak_rss_gb/advantage": 3.5,
                   "memory/peak_rss_gb/actor": 4.4})
    by_stage, by_object = bench.tables({"trl": [trl], "dockrl-vllm": [vllm]}).split("\n\n")
    assert rows(by_stage)["trl"] == ["trl", "1", "3.00", "", "", "5.50", "6.00", "1.00x"]
    assert rows(by_stage)["dockrl-vllm"] == ["dockrl-vllm", "1", "4.00", "3.50", "3.50", "4.40", "4.50", "0.75x"]
    # 2^28 fp32 weights = 1 GiB; gradients 1, AdamW's two moments 2; vLLM's copy and KV cache on top
    assert rows(by_object)["trl"] == ["trl", "1.00", "1.00", "2.00", "0.00", "0.00", "4.00", "-1.00", "1.50"]
    assert rows(by_object)["dockrl-vllm"] == ["dockrl-vllm", "1.00", "1.00", "2.00", "1.00", "0.50", "5.50", "-1.50", "-1.10"]


@pytest.mark.slow  # two training processes on the tiny model: ~1 min on 2 busy cores
def test_quick_mode_measures_every_stage_of_both_sides(monkeypatch):
    if not sys.platform.startswith("linux"):
        pytest.skip("the stages' peaks are Linux's VmHWM")
    out = load_benchmark(monkeypatch).main(["--quick", "--timeout-s", "600"])
    by_stage, by_object = out.split("\n\n")[1:]
    stages = rows(by_stage)
    assert set(stages) == {"trl", "dockrl-hf"}
    assert all(math.isfinite(float(c)) and float(c) > 0 for c in stages["dockrl-hf"][2:7])  # rollout, reward, advantage, update, tree
    assert stages["trl"][2] and stages["trl"][5] and stages["trl"][3] == ""  # TRL: generation and update only
    assert set(rows(by_object)) == {"trl", "dockrl-hf"}
