"""The reward verifier's processes (pool workers, resource tracker) never outlive their owner."""

from __future__ import annotations

import signal
import subprocess
import sys
import time

import pytest

OWNER = """
import os, time
from dockrl.process.lifeline import sigterm_as_exit
from dockrl.rewards import RewardScorer
if __name__ == "__main__":
    with sigterm_as_exit():
        scorer = RewardScorer(timeout_s=5)
        try:
            assert scorer.score(["#### 1"], ["1"]) == [1.1]
            print("ready", flush=True)
            time.sleep(120)
        finally:
            scorer.close()
"""


def descendants(pid: int) -> list[int]:
    """Live processes below ``pid`` (by parent pid), and those that carry its process group."""
    from dockrl.launch.procfs import live_processes

    procs = live_processes()
    out, todo = set(), [pid]
    while todo:
        parent = todo.pop()
        kids = [p for p, (ppid, _) in procs.items() if ppid == parent and p not in out]
        out.update(kids)
        todo += kids
    return sorted(out | {p for p, (_, group) in procs.items() if group == pid and p != pid})


def alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGKILL], ids=["sigterm", "sigkill"])
def test_no_verifier_process_outlives_its_owner(tmp_path, sig):
    script = tmp_path / "owner.py"
    script.write_text(OWNER)
    owner = subprocess.Popen([sys.executable, str(script)], stdout=subprocess.PIPE, text=True, start_new_session=True)
    try:
        assert owner.stdout.readline().strip() == "ready"
        helpers = descendants(owner.pid)
        assert len(helpers) >= 2  # the pool worker, the resource tracker
        owner.send_signal(sig)
        owner.wait(timeout=30)
        start = time.monotonic()
        while any(alive(p) for p in helpers) and time.monotonic() - start < 30:
            time.sleep(0.05)
        # within a second on a quiet machine (a 0.25 s watch); bounded generously for a loaded one
        assert not [p for p in helpers if alive(p)], f"left {time.monotonic() - start:.1f} s after {sig.name}"
        assert time.monotonic() - start < 10
    finally:
        if owner.poll() is None:
            owner.kill()


@pytest.mark.slow
def test_an_inprocess_run_stopped_by_sigterm_leaves_nothing(tiny_model_dir, tmp_path):
    from dockrl.run.lock import lock_holder

    run = tmp_path / "run"
    cmd = [sys.executable, "-m", "dockrl", "train", f"model.path={tiny_model_dir}", f"run.output_dir={run}",
           f"run.cache_dir={tmp_path / 'cache'}", "run.progress=false", "trainer.iterations=50", "trainer.global_batch=2",
           "trainer.mini_batch=2", "trainer.micro_batch=4", "rollout.n=2", "rollout.max_response_length=8",
           "data.generate_train=20", "data.generate_test=4", "data.eval_size=4"]
    log = tmp_path / "driver.log"  # a file, not a pipe: a full pipe nobody reads would block the driver's writes
    with log.open("w") as err:  # the child holds its own copy of the descriptor
        driver = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=err, text=True, start_new_session=True)
    try:
        deadline = time.monotonic() + 240
        while len(helpers := descendants(driver.pid)) < 2:  # the evaluation before training started the verifier's pool
            assert driver.poll() is None and time.monotonic() < deadline, log.read_text()[-3000:] if driver.poll() is not None else "slow"
            time.sleep(0.2)
        time.sleep(1)
        helpers = descendants(driver.pid)
        assert len(helpers) >= 2 and lock_holder(run)["pid"] == driver.pid
        driver.send_signal(signal.SIGTERM)
        try:
            code = driver.wait(timeout=120)
        except subprocess.TimeoutExpired:
            pytest.fail(f"the driver did not exit within 120 s of SIGTERM; its log ends:\n{log.read_text()[-3000:]}")
        assert code == 143, log.read_text()[-3000:]
        start = time.monotonic()
        while any(alive(p) for p in helpers) and time.monotonic() - start < 10:  # the tracker reads EOF
            time.sleep(0.05)
        assert not [p for p in helpers if alive(p)] and lock_holder(run) is None
    finally:
        if driver.poll() is None:
            driver.kill()
