"""Run folder retention on the shared volume: ``dockrl runs prune`` (``dockrl.checkpoint.pruning.prune_runs``)."""

from __future__ import annotations

import json
import os
import time

import pytest

from dockrl.checkpoint.pruning import prune_runs
from dockrl.cli import main
from dockrl.run.lock import RunLock

DAY = 86400.0


def run_folder(root, name: str, days_ago: float, *, fresh_metrics: bool = False):
    """A run folder whose files were last written ``days_ago`` days ago (its metrics just now with ``fresh_metrics``)."""
    folder = root / name
    (folder / "checkpoints" / "final").mkdir(parents=True)
    (folder / "checkpoints" / "final" / "model.safetensors").write_bytes(b"0" * 64)
    (folder / "metrics.jsonl").write_text("{}\n")
    then = time.time() - days_ago * DAY
    for path in [*folder.rglob("*"), folder]:
        os.utime(path, (then, then))
    if fresh_metrics:
        (folder / "metrics.jsonl").write_text("{}\n{}\n")
    return folder


def test_old_run_folders_go_the_newest_recent_and_held_stay(tmp_path):
    runs = tmp_path / "runs"
    old, older = run_folder(runs, "run-a", 40), run_folder(runs, "run-b", 50)
    aside = run_folder(runs, "run-b.attempt-1", 51)
    writing = run_folder(runs, "run-c", 60, fresh_metrics=True)  # an old folder a live run still writes to
    recent = run_folder(runs, "run-d", 2)
    held = run_folder(runs, "run-e", 45)
    with RunLock(held):  # a live run holds it (on this node), though it wrote nothing for 45 days
        then = time.time() - 45 * DAY
        for path in [*held.rglob("*"), held]:
            os.utime(path, (then, then))
        assert prune_runs(runs, older_than_days=30, dry_run=True) == [aside, older, old]
        assert all(p.is_dir() for p in (old, older, aside))  # a dry run removes nothing
        assert prune_runs(runs, older_than_days=30, keep=4) == [aside, older]  # the 4 newest stay, whatever their age
        assert prune_runs(runs, older_than_days=30) == [old]
    assert sorted(p.name for p in runs.iterdir()) == ["run-c", "run-d", "run-e"]
    assert all(p.is_dir() for p in (writing, recent, held))


def test_the_command_prints_what_it_removed_and_refuses_bad_input(tmp_path, capsys):
    runs = tmp_path / "runs"
    old = run_folder(runs, "run-a", 10)
    assert main(["runs", "prune", str(runs), "--older-than-days", "7", "--dry-run"]) == 0
    assert json.loads(capsys.readouterr().out) == {"would_remove": [str(old)]} and old.is_dir()
    assert main(["runs", "prune", str(runs), "--older-than-days", "7"]) == 0
    assert json.loads(capsys.readouterr().out) == {"removed": [str(old)]} and not old.exists()
    assert not list(runs.iterdir())  # nor its .pruning- folder
    assert main(["runs", "prune", str(tmp_path / "none"), "--older-than-days", "7"]) == 2
    assert "is not a folder: expected the runs/ folder of the shared volume" in capsys.readouterr().err
    with pytest.raises(ValueError, match="older_than_days=-1"):
        prune_runs(runs, older_than_days=-1)
