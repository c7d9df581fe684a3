"""The stage processes' entry point: the heap fix in the processes whose models use torch."""

from __future__ import annotations

import pytest

from dockrl import heap
from dockrl.workers import main as worker_main


class Fixed(Exception):
    """Raised by the stand-in for ``fix_heap``: main got there, before anything else ran."""


def run(monkeypatch, stage: str, tmp_path) -> list[str]:
    calls: list[str] = []

    def fix_heap(what: str) -> bool:
        calls.append(what)
        raise Fixed

    monkeypatch.setattr(heap, "fix_heap", fix_heap)
    missing = str(tmp_path / "no-such-config.yaml")
    with pytest.raises((Fixed, FileNotFoundError, ValueError, OSError)):
        worker_main.main(["--stage", stage, "--config", missing, "--dock", "grpc://127.0.0.1:1", "--weight-sync", "127.0.0.1:2"])
    return calls


@pytest.mark.parametrize("stage", worker_main.TORCH_STAGES)
def test_a_torch_stage_fixes_its_heap_before_it_reads_its_config(monkeypatch, tmp_path, stage):
    assert run(monkeypatch, stage, tmp_path) == [f"{stage} worker"]


def test_the_reward_stage_leaves_its_heap(monkeypatch, tmp_path):
    assert set(worker_main.PROCESSES) - set(worker_main.TORCH_STAGES) == {"reward"}
    assert run(monkeypatch, "reward", tmp_path) == []

