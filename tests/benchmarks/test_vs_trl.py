"""benchmarks/vs_trl.py --quick runs TRL's GRPOTrainer and dockrl on the tiny model and prints both rows."""

from __future__ import annotations

import importlib.util
import math
from pathlib import Path

import pytest
from test_dock_benchmark import number

ROOT = Path(__file__).resolve().parents[2]


def load_benchmark():
    spec = importlib.util.spec_from_file_location("vs_trl", ROOT / "benchmarks" / "vs_trl.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.slow  # two training processes on the tiny model: ~50 s on 2 busy cores
def test_quick_mode_trains_lora_adapters_on_both_sides_at_their_defaults_with_finite_numbers():
    """One run for both: each side at its own defaults, adapters of rank 4 (full fine-tuning at fp32 is
    what the memory benchmark's quick mode runs, tests/benchmarks/test_memory_benchmark.py)."""
    from dockrl.parallel.device import bf16_by_default

    out = load_benchmark().main(["--quick", "--precision", "defaults", "--lora-rank", "4", "--timeout-s", "600"])
    rows = {line.split("|")[1].strip(): [c.strip() for c in line.strip("|").split("|")]
            for line in out.splitlines() if line.startswith("| ") and not line.startswith("| side")}
    assert set(rows) == {"trl", "dockrl-hf"}
    for cells in rows.values():
        values = [number(c) for c in cells[3:]]
        assert all(math.isfinite(v) and v > 0 for v in values), cells
    assert rows["trl"][-2:] == ["1.00x", "1.00x"]
    assert rows["trl"][2] == "bf16 autocast, gradient checkpointing, LoRA 4"  # GRPOConfig's defaults on any CPU
    dockrl = "bf16 autocast, rollout bfloat16" if bf16_by_default("cpu") else "fp32, rollout float32"
    assert rows["dockrl-hf"][2] == dockrl + ", LoRA 4"  # auto: bf16 only where it is faster


def test_the_table_puts_each_side_against_trl():
    table = load_benchmark().table({
        "trl": [dict(seconds_per_iteration=2.0, tokens_per_iteration=100, tokens_per_s=50.0, rollout_tokens_per_s=80.0,
                     update_tokens_per_s=120.0, peak_rss_gb=6.0, self_peak_rss_gb=5.5, precision="bf16 autocast")],
        "dockrl-hf": [dict(seconds_per_iteration=1.0, tokens_per_iteration=100, tokens_per_s=100.0, rollout_tokens_per_s=150.0,
                           update_tokens_per_s=300.0, peak_rss_gb=2.0, self_peak_rss_gb=1.5, precision="fp32, rollout float32")] * 2,
    })
    last = table.splitlines()[-1]
    assert last.startswith("| dockrl-hf | 2 | fp32, rollout float32 | 1.00 | 100 |") and last.endswith("| 2.00x | 0.33x |")


def test_the_peak_rss_counts_every_process_of_the_tree():
    import subprocess
    import sys

    bench = load_benchmark()
    # a parent that starts a child: each holds ~200 MB for a second, the tree's peak holds both
    hold = "import subprocess, sys, time; b = bytearray(200 * 2**20); b[::4096] = b'x' * len(b[::4096]); "
    code = hold + f"p = subprocess.Popen([sys.executable, '-c', {hold + 'time.sleep(1.5)'!r}]); time.sleep(1.5); p.wait()"
    proc = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    _, err, sampled, descendants = bench.tree_peak_rss(proc, timeout_s=60, every_s=0.02)
    assert proc.returncode == 0, err
    assert sampled > 400 * 2**20  # both processes' 200 MB at once: RUSAGE_SELF of the parent would see one
    assert 200 * 2**20 < descendants < 400 * 2**20  # the child's own peak


def test_children_that_never_ran_together_are_not_added_up():
    import subprocess
    import sys

    bench = load_benchmark()
    # two children one after the other, each holding ~200 MB for a second (a compiler's chain of processes)
    hold = "import time; b = bytearray(200 * 2**20); b[::4096] = b'x' * len(b[::4096]); time.sleep(1.0)"
    code = f"import subprocess, sys\nfor _ in range(2): subprocess.run([sys.executable, '-c', {hold!r}], check=True)"
    proc = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    _, err, _, descendants = bench.tree_peak_rss(proc, timeout_s=60, every_s=0.02)
    assert proc.returncode == 0, err
    assert 200 * 2**20 < descendants < 300 * 2**20  # one child's peak, not the two's sum


def test_a_bad_side_is_named(capsys):
    with pytest.raises(SystemExit):
        load_benchmark().main(["--quick", "--sides", "trl,verl"])
    assert "--sides: unknown ['verl']" in capsys.readouterr().err


@pytest.mark.parametrize("flags, named", [
    (["--micro-batch", "0"], "--micro-batch: got 0"), (["--repeats", "0"], "--repeats: got 0"),
    (["--prompts", "-1"], "--prompts: got -1"), (["--n", "1"], "--n: got 1"), (["--max-new-tokens", "0"], "--max-new-tokens: got 0"),
    (["--iterations", "0"], "--iterations: got 0"), (["--temperature", "0"], "--temperature: got 0.0"), (["--lr=-0.1"], "--lr: got -0.1"),
    (["--timeout-s", "0"], "--timeout-s: got 0.0"), (["--micro-batch", "3"], "must be a multiple of --micro-batch=3"),
    (["--model", "no-such-model"], "--model: 'no-such-model' is not a directory"),
])
def test_a_bad_argument_is_refused_in_one_line_naming_the_flag(flags, named, capsys):
    with pytest.raises(SystemExit) as exit:
        load_benchmark().main(["--quick", *flags])  # refused before any run starts
    assert exit.value.code == 2
    error = capsys.readouterr().err.strip().splitlines()[-1]
    assert named in error and "Traceback" not in error


def test_a_bad_argument_without_quick_is_refused_too(capsys):
    with pytest.raises(SystemExit):
        load_benchmark().parse_args(["--model", ".", "--repeats", "0"])
    assert "--repeats: got 0" in capsys.readouterr().err


def test_quick_changes_the_defaults_and_a_given_flag_wins():
    bench = load_benchmark()
    quick = bench.parse_args(["--quick"])
    assert (quick.prompts, quick.n, quick.micro_batch, quick.repeats, quick.sides) == (2, 2, 2, 1, ["trl", "dockrl-hf"])
    given = bench.parse_args(["--micro-batch", "4", "--quick", "--repeats", "3", "--n", "4", "--sides", "trl"])
    assert (given.prompts, given.n, given.micro_batch, given.repeats, given.sides) == (2, 4, 4, 3, ["trl"])
    assert bench.parse_args(["--model", "."]).repeats == 2  # without --quick: the full defaults


def test_bf16_is_refused_where_the_cpu_only_emulates_it(monkeypatch, capsys):
    import dockrl.parallel.device as device

    monkeypatch.setattr(device, "native_bf16", lambda kind: False)  # a fake: this CPU without AVX512-BF16 or AMX
    with pytest.raises(SystemExit) as exit:
        load_benchmark().main(["--quick", "--precision", "bf16"])
    assert exit.value.code == 2
    assert "--precision bf16: this CPU has no native bf16" in capsys.readouterr().err
