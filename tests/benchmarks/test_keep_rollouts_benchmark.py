"""benchmarks/keep_rollouts.py --quick runs a run with run.keep_rollouts off and one with all, and prints the table."""

from __future__ import annotations

import importlib.util
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def load_benchmark():
    spec = importlib.util.spec_from_file_location("keep_rollouts_bench", ROOT / "benchmarks" / "keep_rollouts.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.slow
def test_quick_prints_off_and_all_side_by_side_with_the_ratio():
    text = load_benchmark().main(["--quick"])
    lines = text.splitlines()
    assert lines[0].split() == ["off", "all", "all/off"]
    rows = {re.split(r"\s{2,}", line.strip())[0]: re.split(r"\s{2,}", line.strip())[1:] for line in lines[1:]}
    off, on, ratio = (float(x) for x in rows["seconds per iteration"])
    rounding = 5e-4 + ratio * (5e-5 / off + 5e-5 / on)  # the ratio is printed to 3 decimals from the times before their 4
    assert off > 0 and on > 0 and ratio == pytest.approx(on / off, abs=rounding)
    assert rows["iterations measured"] == ["2", "2"]
    assert rows["rows kept"] == ["0", str(3 * 2 * 4)]  # every row of every iteration, the warm-up one too
    assert float(rows["bytes kept per run"][0]) == 0 and float(rows["bytes kept per run"][1]) > 0


def test_a_warmup_as_long_as_the_run_is_refused(capsys):
    with pytest.raises(SystemExit):
        load_benchmark().parse_args(["--iterations", "2", "--warmup", "2"])
    assert "--warmup 2: expected fewer than --iterations 2" in capsys.readouterr().err
