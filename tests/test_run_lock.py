"""The run folder: locked for a run's lifetime, left as it was by a refused run."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from dockrl import driver
from dockrl.config import ConfigError, load_config, save_config
from dockrl.resume import checkpoint_dir, write_driver_state
from dockrl.run_lock import LOCK_FILE, RunLock, RunLockedError, lock_holder

HOLD = "import sys, time; from dockrl.run_lock import RunLock; RunLock(sys.argv[1]).acquire(); print('locked', flush=True); time.sleep(60)"


def hold_lock(run_dir: Path) -> subprocess.Popen:
    """Another process that holds the lock of ``run_dir`` (as a running ``dockrl train`` does)."""
    proc = subprocess.Popen([sys.executable, "-c", HOLD, str(run_dir)], stdout=subprocess.PIPE, text=True)
    assert proc.stdout.readline().strip() == "locked"
    return proc


def test_a_second_run_is_refused_until_the_holder_dies_even_by_sigkill(tmp_path):
    run = tmp_path / "run"
    holder = hold_lock(run)
    try:
        assert lock_holder(run)["pid"] == holder.pid
        with pytest.raises(RunLockedError, match=rf"run.output_dir: {run} is in use by another dockrl run \(pid {holder.pid} on "):
            RunLock(run).acquire()
    finally:
        holder.send_signal(signal.SIGKILL)
        holder.wait()
    assert (run / LOCK_FILE).is_file() and lock_holder(run) is None  # the file stays; nobody holds it: not stale
    with RunLock(run):
        assert lock_holder(run)["pid"] == os.getpid()
        with pytest.raises(RunLockedError):  # one run per folder, within one process too
            RunLock(run).acquire()
    assert lock_holder(run) is None
    RunLock(run).acquire().release()


def test_a_read_only_run_folder_is_named(tmp_path):
    if os.geteuid() == 0:
        pytest.skip("root writes into read-only folders")
    folder = tmp_path / "ro"
    folder.mkdir()
    folder.chmod(0o500)
    try:
        with pytest.raises(ConfigError, match=rf"cannot create the run folder's lock file {folder / LOCK_FILE} \(Permission denied\)"):
            RunLock(folder).acquire()
    finally:
        folder.chmod(0o700)


def tiny_run(tiny_model_dir, tmp_path, *extra: str):
    return load_config(None, [
        f"model.path={tiny_model_dir}", f"run.output_dir={tmp_path / 'run'}", f"run.cache_dir={tmp_path / 'cache'}",
        "run.progress=false", "data.generate_train=40", "data.generate_test=8", "trainer.iterations=5", "trainer.save_every=2",
        "trainer.global_batch=4", "trainer.mini_batch=2", "trainer.micro_batch=4", "rollout.n=4", *extra,
    ])


def files(folder: Path) -> dict[str, bytes]:
    return {str(p.relative_to(folder)): p.read_bytes() for p in sorted(folder.rglob("*")) if p.is_file() and p.name != LOCK_FILE}


def test_a_refused_run_leaves_the_run_folder_as_it_was(tiny_model_dir, tmp_path):
    cfg = tiny_run(tiny_model_dir, tmp_path)
    run = Path(cfg.run.output_dir)
    ckpt = checkpoint_dir(run, 2)
    ckpt.mkdir(parents=True)
    write_driver_state(ckpt, cfg, next_iteration=2, dock_uri=str(ckpt / "dock"), open_iteration=2, summary={}, prompts="p")
    save_config(cfg, run / "config.yaml")
    (run / "metrics.jsonl").write_text('{"iteration": 0}\n{"iteration": 1}\n')
    before = files(run)
    with pytest.raises(ConfigError, match="already holds a run"):  # a fresh run into it
        driver.train(cfg)
    with pytest.raises(ConfigError, match="rollout.n"):  # a resume that does not fit the checkpoint
        driver.train(tiny_run(tiny_model_dir, tmp_path, "run.resume=latest", "rollout.n=8", "trainer.micro_batch=8"))
    assert files(run) == before
    assert load_config(run / "config.yaml", ["run.resume=latest"]).rollout.n == 4  # the documented resume command still fits


def test_a_refused_run_into_a_new_folder_leaves_no_folder_and_says_so_before_it_loads_anything(tiny_model_dir, tmp_path):
    cfg = tiny_run(tiny_model_dir, tmp_path, "run.resume=latest", "model.path=no-such-model", "data.train_path=train.csv")
    with pytest.raises(ConfigError, match="run.resume: got 'latest'; no complete checkpoint"):  # before model and data are looked at
        driver.train(cfg)
    assert not Path(cfg.run.output_dir).exists()
    (tmp_path / "train.csv").write_text("question,answer\n")
    with pytest.raises(ConfigError, match=r"data.train_path: data file .*train.csv: a .csv file"):  # before model.path
        driver.train(tiny_run(tiny_model_dir, tmp_path, "model.path=no-such-model", f"data.train_path={tmp_path / 'train.csv'}"))
    assert not Path(cfg.run.output_dir).exists()
    lock = RunLock(tmp_path / "kept").acquire()  # a folder that held something else stays, as it was
    (tmp_path / "kept" / "notes.txt").write_text("mine")
    lock.release()
    assert sorted(p.name for p in (tmp_path / "kept").iterdir()) == [LOCK_FILE, "notes.txt"]


def test_a_lock_file_a_refused_run_removes_under_a_starting_run_is_taken_again(tmp_path, monkeypatch):
    run = tmp_path / "run"
    refused = RunLock(run).acquire()  # created the folder: its release removes the folder and its lock file
    real_open, opened = os.open, []

    def open_then_the_refused_run_lets_go(path, *args):  # between the starting run's open and its flock
        fd = real_open(path, *args)
        if not opened:
            opened.append(path)
            refused.release()
        return fd

    monkeypatch.setattr(os, "open", open_then_the_refused_run_lets_go)
    starting = RunLock(run).acquire()
    monkeypatch.undo()
    assert opened and run.is_dir() and lock_holder(run)["pid"] == os.getpid()
    with pytest.raises(RunLockedError):  # a third run finds the folder held: one holder, of the file at the path
        RunLock(run).acquire()
    starting.release()


def test_a_run_into_a_folder_in_use_is_refused_before_it_writes(tiny_model_dir, tmp_path):
    cfg = tiny_run(tiny_model_dir, tmp_path)
    holder = hold_lock(Path(cfg.run.output_dir))
    try:
        with pytest.raises(RunLockedError, match=f"pid {holder.pid}"):
            driver.train(cfg)
        assert files(Path(cfg.run.output_dir)) == {}
    finally:
        holder.kill()
        holder.wait()
