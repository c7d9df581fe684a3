"""The run folder: locked for a run's lifetime, left as it was by a refused run."""

from __future__ import annotations

import errno
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from dockrl import driver
from dockrl.checkpoint.resume import CheckpointInProgress, checkpoint_dir, latest_checkpoint, write_driver_state
from dockrl.config import ConfigError, load_config, save_config
from dockrl.kubeflow.train_retry import prepare_retry
from dockrl.run.lock import LOCK_FILE, RunLock, RunLockedError, lock_holder

HOLD = "import sys, time; from dockrl.run.lock import RunLock; RunLock(sys.argv[1]).acquire(); print('locked', flush=True); time.sleep(60)"


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


# a holder on another host: the process names its host as a lost node would have (a fake host name)
HOLD_ELSEWHERE = ("import socket, sys, time; socket.gethostname = lambda: 'fake-lost-node'; from dockrl.run.lock import RunLock; "
                  "RunLock(sys.argv[1]).acquire(); print('locked', flush=True); time.sleep(float(sys.argv[2]))")


def hold_lock_elsewhere(run_dir: Path, seconds: float) -> subprocess.Popen:
    """A process that holds the lock of ``run_dir`` for ``seconds`` in the name of another host, as the
    file system keeps a lost node's lock until its lease expires."""
    proc = subprocess.Popen([sys.executable, "-c", HOLD_ELSEWHERE, str(run_dir), str(seconds)], stdout=subprocess.PIPE, text=True)
    assert proc.stdout.readline().strip() == "locked"
    return proc


def test_a_lock_of_another_host_that_goes_away_within_the_wait_is_taken(tmp_path, caplog):
    run = tmp_path / "run"
    holder = hold_lock_elsewhere(run, 1.5)
    try:
        start = time.monotonic()
        with RunLock(run, wait_s=60, poll_s=0.1):
            waited = time.monotonic() - start
            assert lock_holder(run)["pid"] == os.getpid()
    finally:
        holder.wait(timeout=30)
    assert 0.5 < waited < 30
    assert f"is locked by pid {holder.pid} on fake-lost-node" in caplog.text and "waiting up to 60 s (run.lock_wait_s)" in caplog.text


def test_a_lock_of_another_host_that_stays_is_refused_after_the_wait(tmp_path):
    run = tmp_path / "run"
    holder = hold_lock_elsewhere(run, 60)
    try:
        start = time.monotonic()
        with pytest.raises(RunLockedError, match=rf"pid {holder.pid} on fake-lost-node.*still held after waiting run.lock_wait_s=1 s"):
            RunLock(run, wait_s=1, poll_s=0.1).acquire()
        assert 1 <= time.monotonic() - start < 10
    finally:
        holder.send_signal(signal.SIGKILL)
        holder.wait()


def test_a_live_holder_of_this_host_is_refused_without_waiting(tmp_path):
    run = tmp_path / "run"
    holder = hold_lock(run)
    try:
        start = time.monotonic()
        with pytest.raises(RunLockedError, match=rf"pid {holder.pid} on "):
            RunLock(run, wait_s=60, poll_s=0.1).acquire()
        assert time.monotonic() - start < 5
    finally:
        holder.send_signal(signal.SIGKILL)
        holder.wait()


def test_a_retried_task_waits_for_the_lost_attempts_lock_before_it_looks_at_the_folder(tmp_path):
    out = tmp_path / "runs" / "run-1"
    holder = hold_lock_elsewhere(out, 1.0)
    (out / "metrics.jsonl").write_text('{"iteration": 0}\n')  # the lost attempt's, without a complete checkpoint
    try:
        assert prepare_retry(out, "run-1", lock_wait_s=60) is None
    finally:
        holder.wait(timeout=30)
    assert not out.exists() and (tmp_path / "runs" / "run-1.attempt-1" / "metrics.jsonl").is_file()


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
    lock = RunLock(tmp_path / "kept").acquire()  # the folder of a run that was accepted and wrote into it stays, as it was
    lock.accept()
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


def test_a_refused_run_into_a_new_nested_folder_removes_every_folder_it_made(tiny_model_dir, tmp_path):
    run = tmp_path / "x" / "sub" / "run"
    with pytest.raises(ConfigError, match="run.resume: got 'latest'; no complete checkpoint"):
        driver.train(tiny_run(tiny_model_dir, tmp_path, "run.resume=latest", f"run.output_dir={run}"))
    assert sorted(p.name for p in tmp_path.iterdir()) == []  # x/ and x/sub/ went with run/
    (tmp_path / "x").mkdir()  # a folder that was there before stays, empty as it was
    RunLock(run).acquire().release()
    assert sorted(p.name for p in tmp_path.rglob("*")) == ["x"]
    lock = RunLock(run).acquire()  # one this lock made that holds something else by then stays, with that
    (tmp_path / "x" / "sub" / "notes.txt").write_text("mine")
    lock.release()
    assert sorted(str(p.relative_to(tmp_path)) for p in tmp_path.rglob("*")) == ["x", "x/sub", "x/sub/notes.txt"]


def test_a_start_that_fails_to_make_the_lock_file_removes_the_folders_it_made(tmp_path, monkeypatch):
    real_open = os.open

    def disk_full_on_the_lock_file(path, *args):  # a fake: the lock file's creation fails as on a full disk
        if str(path).endswith(LOCK_FILE):
            raise OSError(errno.ENOSPC, "No space left on device", str(path))
        return real_open(path, *args)

    monkeypatch.setattr(os, "open", disk_full_on_the_lock_file)
    with pytest.raises(ConfigError, match=r"cannot create the run folder's lock file .* \(No space left on device\)"):
        RunLock(tmp_path / "x" / "sub" / "run").acquire()
    assert list(tmp_path.iterdir()) == []


def test_a_refused_run_leaves_the_lock_file_of_a_stopped_run_and_an_empty_folder_as_they_were(tiny_model_dir, tmp_path):
    cfg = tiny_run(tiny_model_dir, tmp_path)
    run = Path(cfg.run.output_dir)
    ckpt = checkpoint_dir(run, 2)
    ckpt.mkdir(parents=True)
    write_driver_state(ckpt, cfg, next_iteration=2, dock_uri=str(ckpt / "dock"), open_iteration=2, summary={}, prompts="p")
    (run / "metrics.jsonl").write_text('{"iteration": 0}\n')  # a run stopped since: its lock file names its pid
    (run / LOCK_FILE).write_text('{"pid": 999999, "host": "h", "since": "2024-01-01T00:00:00+0000"}\n')
    before = (run / LOCK_FILE).read_bytes()
    with pytest.raises(ConfigError, match="already holds a run"):
        driver.train(cfg)
    assert (run / LOCK_FILE).read_bytes() == before  # not the pid of the refused run, which never ran there
    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(ConfigError, match="run.resume: got 'latest'"):
        driver.train(tiny_run(tiny_model_dir, tmp_path, "run.resume=latest", f"run.output_dir={empty}"))
    assert list(empty.iterdir()) == []  # no lock file of a run that never ran there


def test_a_run_stopped_before_its_first_checkpoint_does_not_block_a_fresh_run_there(tiny_model_dir, tmp_path):
    cfg = tiny_run(tiny_model_dir, tmp_path, "trainer.iterations=1")
    run = Path(cfg.run.output_dir)
    partial = checkpoint_dir(run, 2)
    partial.mkdir(parents=True)
    (partial / "optimizer.pt.tmp").write_bytes(b"cut short")  # killed while writing it: incomplete
    (run / "metrics.jsonl").write_text('{"iteration": 0}\n{"iteration": 1}\n')
    (run / "logs").mkdir()
    (run / "logs" / "actor.log").write_text("the stopped run's log\n")
    (run / LOCK_FILE).write_text('{"pid": 999999, "host": "h", "since": "2024-01-01T00:00:00+0000"}\n')  # its holder is gone
    driver.train(cfg)
    aside = tmp_path / "run.stopped-1"
    assert (aside / "metrics.jsonl").read_text() == '{"iteration": 0}\n{"iteration": 1}\n'  # kept beside, not mixed in
    assert (aside / "logs" / "actor.log").is_file() and not (aside / "checkpoints").exists()
    assert [json.loads(line)["iteration"] for line in (run / "metrics.jsonl").read_text().splitlines()] == [0]
    assert latest_checkpoint(run) is not None and lock_holder(run) is None
    holder = hold_lock(run)  # a live run in the folder still refuses a second one
    try:
        with pytest.raises(RunLockedError, match=f"pid {holder.pid}"):
            driver.train(cfg)
    finally:
        holder.kill()
        holder.wait()


def test_a_run_accepted_in_an_existing_folder_leaves_its_pid_in_the_lock_file(tmp_path):
    (tmp_path / LOCK_FILE).write_text('{"pid": 999999}\n')  # a run gone since
    with RunLock(tmp_path) as lock:
        assert lock_holder(tmp_path)["pid"] == os.getpid()  # the holder is named while it runs, accepted or not
        lock.accept()
    assert json.loads((tmp_path / LOCK_FILE).read_text())["pid"] == os.getpid() and lock_holder(tmp_path) is None


@pytest.mark.parametrize("stop", ["ctrl-c", "sigterm"])
def test_a_checkpoint_write_cut_short_removes_its_folder_and_keeps_the_complete_ones(tiny_model_dir, tmp_path, monkeypatch, stop):
    from dockrl.stages import inprocess  # the in-process runner writes the actor's optimizer state

    real_save_optimizer, calls = inprocess.save_optimizer, []

    def cut_short_while_writing_the_second_optimizer(engine, checkpoint, rank=0):  # a fake: the weights are written by then
        calls.append(checkpoint)
        if len(calls) == 2:
            assert any(checkpoint.glob("*.safetensors"))
            if stop == "ctrl-c":
                raise KeyboardInterrupt
            os.kill(os.getpid(), signal.SIGTERM)  # the run turns it into SystemExit(143)
            time.sleep(5)  # the handler raises before this ends
        return real_save_optimizer(engine, checkpoint, rank)

    monkeypatch.setattr(inprocess, "save_optimizer", cut_short_while_writing_the_second_optimizer)
    cfg = tiny_run(tiny_model_dir, tmp_path)  # checkpoints after iterations 1 and 3 (iter_000002, iter_000004), then final
    with pytest.raises(KeyboardInterrupt if stop == "ctrl-c" else SystemExit):
        driver.train(cfg)
    run = Path(cfg.run.output_dir)
    assert [c.name for c in calls] == ["iter_000002", "iter_000004"]
    assert sorted(p.name for p in (run / "checkpoints").iterdir()) == ["iter_000002"]  # iter_000004 went, the complete one stays
    assert latest_checkpoint(run) == checkpoint_dir(run, 2)


def test_a_live_single_process_run_is_listed_by_dockrl_runs_and_stopped_by_its_run_id(tiny_model_dir, tmp_path, monkeypatch, capsys):
    from dockrl.cli import main
    from dockrl.launch import local, run_records

    temp = tmp_path / "tmp"  # the local runs' records live in the temporary folder: this test's own
    temp.mkdir()
    monkeypatch.setattr(local, "default_state_dir", lambda: temp / "dockrl-local-workers")
    run = tmp_path / "run"
    cmd = [sys.executable, "-m", "dockrl", "train", f"model.path={tiny_model_dir}", f"run.output_dir={run}",
           f"run.cache_dir={tmp_path / 'cache'}", "run.progress=false", "trainer.iterations=500", "trainer.global_batch=2",
           "trainer.mini_batch=2", "trainer.micro_batch=4", "rollout.n=2", "rollout.max_response_length=8",
           "data.generate_train=20", "data.generate_test=4", "data.eval_size=4", "trainer.save_every=0"]
    log = tmp_path / "driver.log"
    with log.open("w") as err:
        proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=err, env={**os.environ, "TMPDIR": str(temp)},
                                start_new_session=True)
    try:
        deadline = time.monotonic() + 120

        def ours() -> list[dict]:  # other runs' processes on this machine are listed too (a run id, no record)
            return [r for r in run_records.local_runs() if r["driver_pid"] == proc.pid]

        while not (runs := ours()):
            assert proc.poll() is None and time.monotonic() < deadline, log.read_text()[-3000:]
            time.sleep(0.2)
        [listed] = runs
        assert listed["run_dir"] == str(run.resolve()) and listed["driver_pid"] == proc.pid and listed["driver_alive"]
        assert main(["runs"]) == 0
        assert f"{listed['run_id']}  {run.resolve()}  driver {proc.pid} running" in capsys.readouterr().out
        assert main(["teardown", listed["run_id"], "--grace-s", "2"]) == 0
        assert json.loads(capsys.readouterr().out)["driver"] == proc.pid
        assert proc.wait(timeout=60) == 143, log.read_text()[-3000:]
        assert not ours()
        assert main(["runs"]) == 0
        assert listed["run_id"] not in capsys.readouterr().out
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


@pytest.mark.parametrize("kind", ["inprocess", "processes"])
def test_the_checkpoint_the_stages_were_writing_is_removed_once_they_stopped(kind, tmp_path):
    from test_driver import RUNNERS, fake_config, fake_plan

    plan = fake_plan(fake_config(tmp_path / "run"))  # checkpoints after iterations 1 and 3
    runner = RUNNERS[kind](plan)  # the fake stages write a file into the checkpoint, as the actor its weights
    real_snapshot, snapshots = runner.dock.snapshot, []

    def ctrl_c_at_the_second_snapshot(uri):  # a fake: the driver is interrupted after the stages wrote their part
        snapshots.append(uri)
        if len(snapshots) == 2:
            assert (checkpoint_dir(plan.cfg.run.output_dir, 4) / "fake_weights.txt").is_file()
            raise KeyboardInterrupt
        return real_snapshot(uri)

    runner.dock.snapshot = ctrl_c_at_the_second_snapshot
    checkpoint = CheckpointInProgress()
    try:
        with pytest.raises(KeyboardInterrupt):
            driver.drive(plan, runner, checkpoint=checkpoint)
        assert checkpoint.folder == checkpoint_dir(plan.cfg.run.output_dir, 4)
    finally:
        runner.close()  # as `train` does: the stages stop first, then the folder goes
        checkpoint.remove()
    left = sorted(p.name for p in (tmp_path / "run" / "checkpoints").iterdir())
    assert "iter_000004" not in left and "iter_000002" in left  # (the fake stage threads end by writing final when stopped)
