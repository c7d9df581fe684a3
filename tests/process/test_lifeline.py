"""Workers and dock shards stop when their driver is gone: by parent death and by the driver's lease;
a run stopped by SIGTERM or Ctrl-C stops even where the signal's exception is lost."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import pytest

from dockrl.launch.local import free_ports
from dockrl.process.lifeline import DRIVER_PID_ENV, sigterm_as_exit
from dockrl.run.driver_lease import DriverLease

PY = sys.executable
WORKER = """
import subprocess, sys, time
from dockrl.run.driver_lease import shard_lease_quiet
from dockrl.process.lifeline import driver_pid_from_env, watch_driver
lease = shard_lease_quiet(sys.argv[1], None) if len(sys.argv) > 1 else None
watch_driver(driver_pid=driver_pid_from_env(), lease_quiet=lease, timeout_s=2.0, what='fake worker')
child = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(120)'])  # as a vLLM engine or a verifier pool
print(child.pid, flush=True)
time.sleep(120)
"""
DRIVER = """
import ast, sys, time
from dockrl.launch.local import LocalBackend
from dockrl.launch.backend import WorkerGroup
LocalBackend('run-life', state_dir=sys.argv[1]).start([WorkerGroup(name=n, command=c) for n, c in ast.literal_eval(sys.argv[2])])
print('started', flush=True)
time.sleep(300)
"""
"""A driver process: starts the worker groups ``[(name, command), ...]`` of ``argv[2]`` with the local backend, then sleeps."""


def alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def wait_gone(pids: list[int], timeout_s: float) -> float:
    start = time.monotonic()
    while any(alive(p) for p in pids):
        assert time.monotonic() - start < timeout_s, f"still alive after {timeout_s} s: {[p for p in pids if alive(p)]}"
        time.sleep(0.05)
    return time.monotonic() - start


def children(pid: int) -> list[int]:
    out = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat") as f:
                    if int(f.read().rsplit(")", 1)[1].split()[1]) == pid:
                        out.append(int(entry))
            except OSError:
                pass
    return out


def test_a_sigkilled_drivers_shard_workers_and_their_children_stop(tmp_path):
    port = free_ports(1)[0]
    groups = [("dock-shard", (PY, "-m", "dockrl", "dock-shard", "--port", str(port), "--driver-timeout-s", "600")),
              ("reward", (PY, "-c", WORKER))]
    driver = subprocess.Popen([PY, "-c", DRIVER, str(tmp_path), repr(groups)], stdout=subprocess.PIPE, text=True)
    assert driver.stdout.readline().strip() == "started"
    deadline = time.monotonic() + 30
    while (log := tmp_path / "run-life" / "reward-0.log").stat().st_size == 0:  # the worker has armed its watch
        assert time.monotonic() < deadline, "the fake worker did not start"
        time.sleep(0.05)
    grandchild = int(log.read_text().split()[0])
    workers = children(driver.pid)
    assert len(workers) == 2 and alive(grandchild)
    driver.send_signal(signal.SIGKILL)
    driver.wait()
    took = wait_gone([*workers, grandchild], timeout_s=30)
    assert took < 5, f"took {took:.1f} s"  # ~0.3 s on a quiet machine
    assert "the driver (pid" in log.read_text() or "SIGTERM" in log.read_text()


def test_workers_and_shards_stop_when_the_drivers_lease_goes_quiet(tmp_path, monkeypatch):
    monkeypatch.delenv(DRIVER_PID_ENV, raising=False)  # not the driver's children: only the lease ties them (pods)
    port = free_ports(1)[0]
    shard = subprocess.Popen([PY, "-m", "dockrl", "dock-shard", "--port", str(port), "--driver-timeout-s", "2"],
                             stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True)
    location = shard.stdout.readline().strip()
    lease = DriverLease([location], None, timeout_s=2.0)
    worker = subprocess.Popen([PY, "-c", WORKER, location], stdout=subprocess.PIPE, text=True, start_new_session=True)
    grandchild = int(worker.stdout.readline())
    try:
        time.sleep(4)  # twice the timeout: the lease keeps them up
        assert shard.poll() is None and worker.poll() is None and lease.beats >= 4
        lease.stop()  # the driver is gone
        took = wait_gone([shard.pid, worker.pid, grandchild], timeout_s=30)
        assert 1.5 < took < 8, f"took {took:.1f} s"  # the 2 s timeout plus a poll period
        assert shard.wait() == 1 and worker.wait() == -signal.SIGKILL
        assert "has not renewed its lease" in shard.stderr.read()
    finally:
        for p in (shard, worker):
            if p.poll() is None:
                os.killpg(p.pid, signal.SIGKILL)
        lease.stop()


def test_a_stage_process_still_waiting_for_its_shards_stops_with_its_driver(tmp_path):
    """The driver dies before the dock's shards answer (they died with it): the stage process stops
    at once, not after its wait for the shards (``--first-wait-s``, 300 s here)."""
    from dockrl.config import load_config, save_config

    save_config(load_config(None), tmp_path / "config.yaml")
    no_shard = free_ports(1)[0]  # nothing listens there
    stage = (PY, "-m", "dockrl.stages.main", "--stage", "reward", "--config", str(tmp_path / "config.yaml"),
             "--dock", f"grpc://127.0.0.1:{no_shard}", "--first-wait-s", "300")
    driver = subprocess.Popen([PY, "-c", DRIVER, str(tmp_path), repr([("reward", stage)])], stdout=subprocess.PIPE, text=True)
    assert driver.stdout.readline().strip() == "started"
    log = tmp_path / "run-life" / "reward-0.log"
    deadline = time.monotonic() + 120
    while "dockrl.config" not in (log.read_text() if log.is_file() else ""):  # past its imports: it waits for the shards now
        assert time.monotonic() < deadline and driver.poll() is None, "the stage process did not start"
        time.sleep(0.1)
    (worker,) = children(driver.pid)
    driver.send_signal(signal.SIGKILL)
    driver.wait()
    took = wait_gone([worker], timeout_s=60)
    assert took < 5, f"took {took:.1f} s"  # ~0.3 s on a quiet machine
    assert "reward worker: the driver (pid" in log.read_text()



class SignalInFinalizer:
    """Sends ``signum`` to this process from its ``__del__``: the handler's exception is raised
    there, where Python prints "Exception ignored in" and goes on (as a regex group's finalizer run
    by the garbage collector did when a run was stopped while it loaded its model)."""

    def __init__(self, signum: int) -> None:
        self.signum = signum

    def __del__(self) -> None:
        os.kill(os.getpid(), self.signum)
        time.sleep(0.05)  # the handler runs at the next bytecode, still inside this finalizer


@pytest.mark.filterwarnings("ignore::pytest.PytestUnraisableExceptionWarning")  # the finalizer's, on purpose
@pytest.mark.parametrize(("signum", "raised"), [(signal.SIGTERM, SystemExit), (signal.SIGINT, KeyboardInterrupt)])
def test_a_stop_signal_lost_in_a_finalizer_is_raised_again(signum, raised):
    previous = signal.getsignal(signum)
    if signum == signal.SIGINT and previous is not signal.default_int_handler:
        pytest.skip("SIGINT is ignored in this process (a suite started in the background): the run leaves it so")
    with sigterm_as_exit() as stop:
        stop.raise_if_stopped()  # nothing received yet
        SignalInFinalizer(signum)  # dropped at once: its __del__ swallows the handler's exception
        assert stop.received == signum
        with pytest.raises(raised) as info:
            stop.raise_if_stopped()
    assert signal.getsignal(signum) is previous
    if raised is SystemExit:
        assert info.value.code == 143
