"""dockrl.process.memory: each stage's own peak resident memory, and the process's across the resets."""

from __future__ import annotations

import sys

import numpy as np
import pytest

from dockrl.process.memory import GB, process_peak_bytes, reset_peak, resident_bytes, stage_memory

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="VmHWM and clear_refs are Linux's")


def touch(nbytes: int) -> np.ndarray:
    block = np.ones(nbytes, dtype=np.uint8)  # every page written: resident
    return block


def test_a_stage_reports_its_own_peak_and_the_process_keeps_the_largest():
    if not reset_peak():
        pytest.skip("this kernel refuses /proc/self/clear_refs")
    big: dict[str, float] = {}
    with stage_memory("big", big):
        block = touch(400 * 2**20)
        del block
    small: dict[str, float] = {}
    with stage_memory("small", small):
        block = touch(40 * 2**20)
        del block
    rss_big, rss_small = big["memory/rss_gb/big"], small["memory/rss_gb/small"]
    # the 400 MiB block raised the first stage's peak by about that over what stayed, and not the second's
    assert big["memory/peak_rss_gb/big"] - rss_big > 0.35
    assert small["memory/peak_rss_gb/small"] - rss_small < 0.2
    assert set(big) == {"memory/peak_rss_gb/big", "memory/rss_gb/big"}
    # the kernel's peak now covers the second stage only; the process's peak still holds the first's
    assert resident_bytes()[1] / GB < big["memory/peak_rss_gb/big"]
    assert process_peak_bytes() / GB >= big["memory/peak_rss_gb/big"]


def test_without_proc_a_stage_reports_nothing(monkeypatch, tmp_path):
    import dockrl.process.memory as memory

    monkeypatch.setattr(memory, "_CLEAR_REFS", tmp_path / "missing" / "clear_refs")
    metrics: dict[str, float] = {}
    with stage_memory("rollout", metrics):
        pass
    assert metrics == {}
