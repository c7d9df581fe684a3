"""The local worker backend: real processes started, watched, failed fast and torn down."""

from __future__ import annotations

import json
import os
import sys
import time

import pytest

from dockrl.kubeflow.steps import teardown_run
from dockrl.launch.backend import WorkerFailed, WorkerGroup
from dockrl.launch.local import LocalBackend
from dockrl.process.env import SINGLE_MACHINE_ENV

PY = sys.executable


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def test_groups_get_their_identity_and_finish(tmp_path):
    code = "import os; print(os.environ['DOCKRL_GROUP'], os.environ['DOCKRL_REPLICA'], os.environ['DOCKRL_REPLICAS'], os.environ.get('X', '-'))"
    backend = LocalBackend("run-a", state_dir=tmp_path)
    backend.start([WorkerGroup(name="reward", command=(PY, "-c", code), replicas=2, env={"X": "y"}),
                   WorkerGroup(name="dock-shard", command=(PY, "-c", code))])
    backend.wait_ready(timeout_s=5)
    backend.wait(timeout_s=20)
    logs = {p.name: p.read_text().strip() for p in (tmp_path / "run-a").glob("*.log")}
    assert logs == {"reward-0.log": "reward 0 2 y", "reward-1.log": "reward 1 2 y", "dock-shard-0.log": "dock-shard 0 1 -"}
    state = json.loads(backend.state_file.read_text())
    assert [w["member"] for w in state["workers"]] == ["reward-0", "reward-1", "dock-shard-0"]
    assert backend.teardown() == 0 and not backend.state_file.exists()


def test_members_keep_their_process_groups_and_vllm_on_loopback(tmp_path, monkeypatch):
    """Whatever the launcher's environment says, a local member's gloo and NCCL sockets listen on ``lo`` and vLLM's
    address for itself (its rendezvous, ZeroMQ's ``tcp://``) is 127.0.0.1: nothing is reachable from another machine."""
    for name in SINGLE_MACHINE_ENV:  # as a node of a cluster might have them
        monkeypatch.setenv(name, "eth0" if name.endswith("IFNAME") else "10.1.2.3")
    names = sorted(SINGLE_MACHINE_ENV)
    code = f"import json, os; print(json.dumps({{k: os.environ.get(k) for k in {names!r}}}))"
    backend = LocalBackend("run-env", state_dir=tmp_path)
    backend.start([WorkerGroup(name="rollout", command=(PY, "-c", code))])
    backend.wait(timeout_s=20)
    assert json.loads((tmp_path / "run-env" / "rollout-0.log").read_text()) == {
        "GLOO_SOCKET_IFNAME": "lo", "NCCL_SOCKET_IFNAME": "lo", "VLLM_HOST_IP": "127.0.0.1"}
    assert backend.teardown() == 0


def test_a_failing_worker_fails_fast_with_its_log_tail(tmp_path):
    backend = LocalBackend("run-b", state_dir=tmp_path)
    crash = "import sys; print('loading shard 3'); print('boom: out of memory', file=sys.stderr); sys.exit(3)"
    backend.start([WorkerGroup(name="actor", command=(PY, "-c", "import time; time.sleep(60)")),
                   WorkerGroup(name="reward", command=(PY, "-c", crash))])
    start = time.monotonic()
    with pytest.raises(WorkerFailed) as err:
        backend.wait(timeout_s=30)
    assert time.monotonic() - start < 10  # did not wait for the sleeping actor
    assert err.value.member == "reward-0" and "exited with code 3" in str(err.value)
    assert "loading shard 3" in err.value.log_tail and "boom: out of memory" in err.value.log_tail
    assert backend.teardown() == 1


def test_a_failed_workers_message_starts_with_its_own_error(tmp_path):
    """The one line a user reads is the stage's own reason (the last exception its log reports), its log below."""
    backend = LocalBackend("run-c", state_dir=tmp_path)
    crash = ("import logging, sys; logging.basicConfig(); logging.getLogger('x').info('loaded'); "
             "raise sys.modules['builtins'].ValueError('dynamic sampling gave up after 3 rounds: set algorithm.filter_groups')")
    backend.start([WorkerGroup(name="reward", command=(PY, "-c", crash))])
    with pytest.raises(WorkerFailed) as err:
        backend.wait(timeout_s=30)
    first = str(err.value).splitlines()[0]
    assert first == ("worker reward-0 of group 'reward' failed: exited with code 1: "
                     "ValueError: dynamic sampling gave up after 3 rounds: set algorithm.filter_groups"), first
    assert "Traceback" in err.value.log_tail
    backend.teardown()


def test_teardown_stops_the_children_a_killed_worker_left(tmp_path):
    backend = LocalBackend("run-k", state_dir=tmp_path)
    # the worker starts a child (a pool's forkserver, say), prints its pid, then dies by SIGKILL
    code = ("import os, signal, subprocess, sys, time; "
            "c = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(60)']); print(c.pid, flush=True); "
            "time.sleep(0.3); os.kill(os.getpid(), signal.SIGKILL)")
    backend.start([WorkerGroup(name="reward", command=(PY, "-c", code))])
    with pytest.raises(WorkerFailed, match="code -9"):
        backend.wait(timeout_s=30)
    child = int((tmp_path / "run-k" / "reward-0.log").read_text().split()[0])
    assert _alive(child)
    assert backend.teardown() == 1
    assert not _alive(child)


def test_teardown_from_another_process_stops_the_run(tmp_path):
    starter = LocalBackend("run-c", state_dir=tmp_path)
    # the worker starts a child of its own: teardown stops the whole process group
    code = "import subprocess, sys, time; subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(60)']); time.sleep(60)"
    starter.start([WorkerGroup(name="reference", command=(PY, "-c", code))])
    pid = starter._procs[0][2].pid
    time.sleep(0.5)
    children = [int(p) for p in os.listdir("/proc") if p.isdigit() and _ppid(int(p)) == pid]
    # what the exit handler does: it only knows the run id
    assert teardown_run("local", "run-c", state_dir=str(tmp_path)) == 1
    starter._procs[0][2].wait(timeout=5)
    deadline = time.monotonic() + 5
    while any(_alive(c) for c in children) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert children and not any(_alive(c) for c in children)
    assert not (tmp_path / "run-c.json").exists()


def _ppid(pid: int) -> int:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return int(f.read().rsplit(")", 1)[1].split()[1])
    except OSError:
        return -1


def test_teardown_never_signals_a_reused_pid(tmp_path):
    victim = __import__("subprocess").Popen([PY, "-c", "import time; time.sleep(30)"])
    try:
        state = {"run_id": "run-d", "workers": [{"group": "actor", "member": "actor-0", "pid": victim.pid, "start_time": 1, "log": ""}]}
        (tmp_path / "run-d.json").write_text(json.dumps(state))
        assert LocalBackend("run-d", state_dir=tmp_path).teardown() == 0
        assert victim.poll() is None
    finally:
        victim.kill()
        victim.wait()


def test_teardown_of_an_unknown_run_is_a_no_op(tmp_path):
    assert teardown_run("local", "never-started", state_dir=str(tmp_path)) == 0


@pytest.mark.parametrize("kwargs, message", [
    (dict(name="Actor", command=("x",)), "worker group name: got 'Actor'"),
    (dict(name="actor", command=()), "command is empty"),
    (dict(name="actor", command=("x",), replicas=0), "replicas=0"),
    (dict(name="actor", command=("x",), port=70000), "port=70000"),
])
def test_worker_group_validation(kwargs, message):
    with pytest.raises(ValueError, match=message):
        WorkerGroup(**kwargs)


def test_teardown_run_errors():
    with pytest.raises(ValueError, match="run_id is empty"):
        teardown_run("local", "")
    with pytest.raises(ValueError, match="teardown: backend: got 'slurm'; expected one of 'local', 'kubernetes'"):
        teardown_run("slurm", "r")


ORPHAN_DRIVER = """
import sys, time
from dockrl.launch.local import LocalBackend
from dockrl.process.env import SINGLE_MACHINE_ENV
from dockrl.launch.backend import WorkerGroup
code = "import subprocess, sys, time; subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(120)']); time.sleep(120)"
b = LocalBackend('run-orphans', state_dir=sys.argv[1], run_dir=sys.argv[2])
b.start([WorkerGroup(name='reward', command=(sys.executable, '-c', code), replicas=2)])
print('started', flush=True)
time.sleep(120)
"""


def test_dockrl_teardown_of_a_run_folder_stops_what_a_killed_driver_left(tmp_path, monkeypatch, capsys):
    from dockrl.cli import main
    from dockrl.launch import local, procfs

    monkeypatch.setattr(local, "default_state_dir", lambda: tmp_path / "state")
    run = tmp_path / "run"
    run.mkdir()
    driver = __import__("subprocess").Popen([PY, "-c", ORPHAN_DRIVER, str(tmp_path / "state"), str(run)], stdout=-1, text=True)
    assert driver.stdout.readline().strip() == "started"
    deadline = time.monotonic() + 20
    while len(procfs.run_processes("run-orphans")) < 4:  # two workers (no lifeline here) and a child each
        assert time.monotonic() < deadline, procfs.run_processes("run-orphans")
        time.sleep(0.05)
    driver.kill()
    driver.wait()
    left = sorted(procfs.run_processes("run-orphans"))
    assert main(["runs"]) == 0
    listed = capsys.readouterr().out
    assert f"run-orphans  {run.resolve()}  driver {driver.pid} gone  4 live process(es) {left}" in listed
    assert main(["teardown", str(run)]) == 0
    assert json.loads(capsys.readouterr().out) == {"driver": None, "runs": {"run-orphans": 2}}
    assert not any(_alive(p) for p in left)
    assert main(["teardown", "run-orphans"]) == 2  # nothing known of it any more
    err = capsys.readouterr().err
    assert err.startswith("dockrl teardown: 'run-orphans' is neither a run folder nor a run id") and "a run's record goes when it ends" in err


def test_dockrl_teardown_stops_the_driver_that_holds_the_run_folder(tmp_path, capsys):
    from dockrl.cli import main

    hold = "import sys, time; from dockrl.run.lock import RunLock; RunLock(sys.argv[1]).acquire(); print('locked', flush=True); time.sleep(60)"
    driver = __import__("subprocess").Popen([PY, "-c", hold, str(tmp_path)], stdout=-1, text=True)
    assert driver.stdout.readline().strip() == "locked"
    assert main(["teardown", str(tmp_path), "--grace-s", "1"]) == 0
    assert json.loads(capsys.readouterr().out)["driver"] == driver.pid
    assert driver.wait(timeout=5) == -15


def test_a_resumed_run_keeps_each_earlier_attempts_logs(tmp_path):
    from dockrl.launch.local import keep_earlier_logs

    logs = tmp_path / "logs"
    assert keep_earlier_logs(logs) is None  # a fresh run
    for attempt in (1, 2):
        logs.mkdir(exist_ok=True)
        (logs / "reward-0.log").write_text(f"attempt {attempt}: Traceback ...")
        (logs / "actor-0.log").write_text(f"attempt {attempt}")
        assert keep_earlier_logs(logs) == logs / f"attempt-{attempt}"
    assert sorted(str(p.relative_to(logs)) for p in logs.rglob("*.log")) == [
        "attempt-1/actor-0.log", "attempt-1/reward-0.log", "attempt-2/actor-0.log", "attempt-2/reward-0.log"]
    assert (logs / "attempt-1" / "reward-0.log").read_text() == "attempt 1: Traceback ..."


def test_a_frozen_dock_shard_fails_the_wait_in_its_rpc_timeout_naming_it(tmp_path):
    import signal as sig

    from dockrl.dock import GRPO_SCHEMA, DockTimeoutError
    from dockrl.dock.client.dock_client import DockClient
    from dockrl.launch.distributed import wait_reports
    from dockrl.launch.local import free_ports
    from dockrl.run.driver_lease import wait_for_shards

    port = free_ports(1)[0]
    backend = LocalBackend("run-frozen", state_dir=tmp_path)
    backend.start([WorkerGroup(name="dock-shard-0", command=(PY, "-m", "dockrl", "dock-shard", "--port", str(port)))])
    location = f"grpc://127.0.0.1:{port}"
    try:
        wait_for_shards([location], "", 60, check=backend.check)
        dock = DockClient([location], GRPO_SCHEMA, rpc_timeout_s=2.0)
        os.kill(backend._procs[0][2].pid, sig.SIGSTOP)  # its process runs, it answers nothing
        start = time.monotonic()
        with pytest.raises(DockTimeoutError, match=rf"dock shard 0 at {location} did not answer within 2 s while its process runs"):
            wait_reports(dock, backend, 0, ["rollout"], timeout_s=30, logs=str(tmp_path))
        assert time.monotonic() - start < 10  # the rpc timeout and the checks, not dock.timeout_s
    finally:
        os.kill(backend._procs[0][2].pid, sig.SIGCONT)
        backend.teardown()
