"""The local backend's fork server: each member forked from one process that imported a stage's code is what
``python -m dockrl worker ...`` started by ``subprocess.Popen`` would be (its environment, session, output,
exit code), and it stops with the server. Whole runs through it: every distributed test (tests/launch)."""

from __future__ import annotations

import os
import signal
import time

import pytest

from dockrl.config import dump_config, load_config
from dockrl.launch.local import ForkServer, free_ports
from dockrl.launch.procfs import pgid, process_run_id
from dockrl.process.lifeline import DRIVER_PID_ENV

RUN_ID = "fork-server-test"
CONFIG_ENV = "FORK_TEST_CONFIG"
"""The members' config variable: set in a member's environment, never in the server's."""


def waiting_reward(tiny_model_dir) -> tuple[list[str], dict[str, str]]:
    """Arguments and environment of a reward worker that waits (60 s) for a dock shard nobody serves."""
    [port] = free_ports(1)
    cfg = dump_config(load_config(None, [f"model.path={tiny_model_dir}"]), portable=True)
    return (["--stage", "reward", "--config-env", CONFIG_ENV, "--dock", f"grpc://127.0.0.1:{port}", "--first-wait-s", "60"],
            {**os.environ, CONFIG_ENV: cfg})


def _gone(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] == "Z"
    except OSError:
        return True


def _line(log, text: str, timeout_s: float = 60.0) -> str:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        for line in log.read_text().splitlines() if log.is_file() else []:
            if text in line:
                return line
        time.sleep(0.05)
    raise AssertionError(f"no line with {text!r} in {log} after {timeout_s:.0f} s: {log.read_text() if log.is_file() else '(none)'}")


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    """One fork server for the module (its imports take seconds) and a folder for the members' logs."""
    folder = tmp_path_factory.mktemp("fork-server")
    server = ForkServer({**os.environ, "DOCKRL_RUN_ID": RUN_ID, DRIVER_PID_ENV: str(os.getpid())}, folder / "server.log", timeout_s=120)
    yield server, folder
    server.close(5.0)


def test_a_member_runs_with_the_environment_asked_for_and_exits_with_its_code(served, tiny_model_dir):
    server, folder = served
    args, env = waiting_reward(tiny_model_dir)
    # the server's environment is not the member's: without its config variable the same command fails, code 2
    failed = server.fork(args, {k: v for k, v in env.items() if k != CONFIG_ENV}, folder / "no-config.log")
    assert failed.wait(timeout=60) == 2
    assert f"--config-env {CONFIG_ENV}: the environment variable is unset or empty" in (folder / "no-config.log").read_text()
    bad = server.fork(["--stage", "no-such-stage"], env, folder / "bad-stage.log")
    assert bad.wait(timeout=60) == 2
    assert "invalid choice: 'no-such-stage'" in (folder / "bad-stage.log").read_text()


def test_a_member_leads_its_session_is_found_by_its_run_and_its_signal_is_its_exit_code(served, tiny_model_dir):
    server, folder = served
    log = folder / "waiting.log"
    member = server.fork(*waiting_reward(tiny_model_dir), log)
    assert "reward" in _line(log, "dockrl.config.resolve")  # its config read: now it waits for the shard
    assert member.poll() is None
    assert pgid(member.pid) == member.pid  # a session of its own: the teardown's killpg reaches what it starts
    assert process_run_id(member.pid) == RUN_ID  # /proc/<pid>/environ: `dockrl runs` and the teardown find it
    with open(f"/proc/{member.pid}/stat") as f:
        assert int(f.read().rsplit(")", 1)[1].split()[1]) == server.proc.pid
    os.killpg(member.pid, signal.SIGKILL)
    assert member.wait(timeout=30) == -signal.SIGKILL


def test_a_server_that_does_not_answer_in_time_is_an_error_naming_it(tmp_path):
    slow = ForkServer({**os.environ, DRIVER_PID_ENV: str(os.getpid())}, tmp_path / "server.log", timeout_s=0.01)
    try:
        with pytest.raises(RuntimeError, match=rf"the fork server \(pid {slow.proc.pid}\) did not start worker --stage reward: "
                                               "no answer within 0 s"):
            slow.fork(["--stage", "reward"], dict(os.environ), tmp_path / "reward.log")
    finally:
        slow.close(0.1)
    assert slow.proc.returncode is not None


def test_a_server_that_exits_fails_the_request_at_once_with_its_code(tmp_path):
    # told its driver is pid 1, which is not its parent: it stops before serving, as when its driver died that early
    gone = ForkServer({**os.environ, DRIVER_PID_ENV: "1"}, tmp_path / "server.log", timeout_s=60)
    start = time.monotonic()
    with pytest.raises(RuntimeError, match=r"did not start worker --stage reward: it exited with code 1"):
        gone.fork(["--stage", "reward"], dict(os.environ), tmp_path / "reward.log")
    assert time.monotonic() - start < 30  # not its 60-s timeout
    gone.close(1.0)


def test_closing_the_server_stops_the_members_still_running(served, tiny_model_dir):  # last: it closes the module's server
    server, folder = served
    log = folder / "left.log"
    member = server.fork(*waiting_reward(tiny_model_dir), log)
    _line(log, "dockrl.config.resolve")
    server.close(5.0)
    deadline = time.monotonic() + 10
    while not _gone(member.pid) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert _gone(member.pid), "a member outlived its fork server"
    assert member.poll() is not None
