"""The scaling model (benchmarks/dock_scaling.py): its parts follow the bytes per link, and it prints its tables."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
from benchmark_modules import load_benchmark

ROOT = Path(__file__).resolve().parents[2]
scaling = load_benchmark("dock_scaling")
EMULATED, Costs, Workload, predict = scaling.EMULATED, scaling.Costs, scaling.Workload, scaling.predict

COSTS = Costs(phi_central=1.0, phi_dock=1.0, process_bytes_s=1e18, claim_cpu_s=0.0, rpc_s=0.0, call_cpu_s=0.0, fanouts=4,
              serial=False)
RATE = 1e6


def test_the_centralized_driver_moves_every_stage_byte_through_its_link_whatever_k():
    inputs, outputs, _ = EMULATED.totals()
    for k in (2, 8, 64):
        assert predict("centralized", EMULATED, k, RATE, COSTS).seconds == pytest.approx((inputs + outputs) / RATE)
        assert predict("centralized", EMULATED, k, RATE, COSTS).busiest_bytes == pytest.approx(inputs)


def test_without_locality_the_payload_crossing_links_spreads_over_the_nodes():
    inputs, outputs, prompts = EMULATED.totals()
    p = predict("dock", EMULATED, 8, RATE, COSTS)
    assert p.parts["middle"] == pytest.approx((inputs + outputs) * 7 / 64 / RATE)
    assert p.parts["fill"] == pytest.approx(prompts / RATE)
    assert p.parts["drain"] == pytest.approx(64 * EMULATED.per_row("actor", "reads") / RATE)  # one claim, five columns


def test_with_locality_only_the_prompts_cross_unless_a_shard_holds_more_than_a_claim():
    _, _, prompts = EMULATED.totals()
    at8, at4 = predict("dock+locality", EMULATED, 8, RATE, COSTS), predict("dock+locality", EMULATED, 4, RATE, COSTS)
    assert at8.parts["steal"] == 0 and at8.seconds == pytest.approx(prompts / RATE)  # 64 rows a shard: one claim
    reads = sum(EMULATED.per_row(s, "reads") for s in ("rollout", "reward", "reference", "actor"))
    assert at4.parts["steal"] == pytest.approx(64 * reads / RATE)  # 128 rows a shard: one claim of every stage stolen


def test_control_costs_grow_with_the_shards_and_the_script_prints_both_tables():
    costly = Costs(1.0, 1.0, 1e18, 78e-6, 1e-3, 3e-4, 4, False)
    w = Workload(prompts=512, samples=16, prompt_tokens=2048, response_tokens=8192, claim_rows=16)
    assert predict("dock", w, 1024, 12.5e9, costly).parts["control"] > predict("dock", w, 16, 12.5e9, costly).parts["control"]
    out = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "dock_scaling.py"), "--nodes", "16,1024"],
                         capture_output=True, text=True, timeout=120, check=True).stdout
    assert "|   16 |" in out and "| 1024 |" in out and "## the model against dock_network.py" in out
