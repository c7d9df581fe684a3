"""Local worker backend: each worker is a process on this machine, in its own session.

``LocalBackend(run_id).start(groups)`` starts ``replicas`` processes per group with
``DOCKRL_RUN_ID``, ``DOCKRL_GROUP``, ``DOCKRL_REPLICA`` and ``DOCKRL_REPLICAS`` set and their
output in ``<log_dir>/<group>-<i>.log``. It records the processes in
``<state_dir>/<run_id>.json`` so that ``teardown`` from another process (the pipeline's exit
handler) finds them; a recorded process is signalled only if its pid still has the start time
recorded, so a reused pid is never hit. What reads those records (``dockrl runs``, ``dockrl
teardown``) is ``dockrl.launch.run_records``.

Addressing: members run this interpreter's ``dockrl`` (``sys.executable -m dockrl``), serve on
free loopback ports and reach the launcher on loopback; every path is shared. Their process
groups' own sockets (gloo's pairs, NCCL's bootstrap) listen on the loopback interface too, and
vLLM takes loopback for its own address (``dockrl.process.env.SINGLE_MACHINE_ENV``): nothing of a
local run is reachable from another machine.

Stage processes (``dockrl worker``) are forked by the start's fork server (``dockrl.launch.fork_server``:
one import of torch and transformers per start instead of one per process); with ``fork_server=False``,
and for every other command (dock shards), each member is a ``subprocess.Popen`` of its command.
"""

from __future__ import annotations

import json
import logging
import os
import queue
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections import deque
from pathlib import Path
from typing import Sequence

from dockrl.launch.backend import WorkerFailed, WorkerGroup
from dockrl.launch.procfs import group_members, pgid, run_processes, start_time
from dockrl.process.env import REPLICA_ENV, REPLICAS_ENV, SINGLE_MACHINE_ENV
from dockrl.process.lifeline import DRIVER_PID_ENV

logger = logging.getLogger(__name__)

LOG_TAIL_LINES = 40
HOST = "127.0.0.1"
"""Every member of a local run listens on loopback only."""


def free_ports(n: int, host: str = HOST) -> list[int]:
    """``n`` distinct ports free on ``host`` right now (bound together, then released)."""
    socks = [socket.socket(socket.AF_INET, socket.SOCK_STREAM) for _ in range(n)]
    try:
        for s in socks:
            s.bind((host, 0))
        return [s.getsockname()[1] for s in socks]
    finally:
        for s in socks:
            s.close()


def default_state_dir() -> Path:
    return Path(tempfile.gettempdir()) / "dockrl-local-workers"


def keep_earlier_logs(log_dir: str | Path) -> Path | None:
    """Move the ``*.log`` files an earlier attempt of a run left in ``log_dir`` (a run resumed after a
    failure) into ``log_dir/attempt-<N>/``, N = 1, 2, … in the order of the attempts, so the
    new attempt's logs do not overwrite them. Returns that folder (None when there was nothing to keep)."""
    folder = Path(log_dir)
    logs = sorted(folder.glob("*.log")) if folder.is_dir() else []
    if not logs:
        return None
    n = 1 + sum(1 for p in folder.glob("attempt-*") if p.is_dir())
    dest = folder / f"attempt-{n}"
    dest.mkdir()
    for log in logs:
        log.rename(dest / log.name)
    logger.info("logs of the earlier attempt kept in %s", dest)
    return dest


def log_tail(path: str | Path, lines: int = LOG_TAIL_LINES) -> str:
    """The last ``lines`` lines of a log file ("" if it does not exist)."""
    try:
        with open(path, errors="replace") as f:
            return "".join(deque(f, maxlen=lines))
    except OSError:
        return ""


class ForkServer:
    """The driver's end of a fork server (``dockrl.launch.fork_server``): ``fork`` starts a member.

    Args:
        env: the server's environment (the run's: ``DOCKRL_RUN_ID`` and ``DRIVER_PID_ENV`` in it).
        log: the server's own log (its stderr: import warnings, a crash).
        timeout_s: longest wait for the server to answer a request, seconds (its imports included).
    """

    def __init__(self, env: dict[str, str], log: Path, timeout_s: float) -> None:
        self.timeout_s = timeout_s
        self._exits: dict[int, int] = {}
        self._answers: queue.Queue[str] = queue.Queue()
        self._closed = threading.Event()
        with open(log, "wb") as err:
            # a session of its own, as every member: `dockrl teardown` from elsewhere signals its group, not the driver's
            self.proc = subprocess.Popen([sys.executable, "-m", "dockrl", "fork-server"], env=env, stdin=subprocess.PIPE,
                                         stdout=subprocess.PIPE, stderr=err, start_new_session=True)
        self.log = log
        self._reader = threading.Thread(target=self._read, name=f"fork-server-{self.proc.pid}", daemon=True)
        self._reader.start()

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for raw in self.proc.stdout:
            word, _, rest = raw.decode(errors="replace").strip().partition(" ")
            if word == "exited":
                pid, code = rest.split()
                self._exits[int(pid)] = int(code)
            else:
                self._answers.put(f"{word} {rest}")
        self._closed.set()
        self._answers.put("closed")  # a request waiting for its answer fails now, not after timeout_s

    def fork(self, argv: Sequence[str], env: dict[str, str], log: Path) -> ForkedProcess:
        """Start ``dockrl worker <argv>`` with ``env`` and its output in ``log``.

        Raises:
            RuntimeError: the server refused the request, exited, or did not answer within ``timeout_s``;
                the first line names which, the lines after it are the server log's tail.
        """
        assert self.proc.stdin is not None
        try:
            self.proc.stdin.write((json.dumps({"argv": list(argv), "env": env, "log": str(log)}) + "\n").encode())
            self.proc.stdin.flush()
            answer = self._answers.get(timeout=self.timeout_s)
        except queue.Empty:
            answer = f"no answer within {self.timeout_s:.0f} s"
        except OSError:  # its stdin is closed: it is gone
            answer = "closed"
        if answer == "closed":
            try:
                answer = f"it exited with code {self.proc.wait(timeout=5.0)}"
            except subprocess.TimeoutExpired:
                answer = "it closed its output"
        word, _, rest = answer.partition(" ")
        if word != "started":
            raise RuntimeError(f"the fork server (pid {self.proc.pid}) did not start worker {' '.join(argv[:2])}: {answer}; "
                               f"its log {self.log}:\n{log_tail(self.log)}")
        return ForkedProcess(int(rest), self)

    def returncode(self, pid: int) -> int | None:
        """``pid``'s exit code once the server reported it; -1 if the server is gone without reporting it and
        ``pid`` no longer runs (its member's parent died, so nobody else can know its code)."""
        if pid in self._exits:
            return self._exits[pid]
        if self._closed.is_set() and start_time(pid) is None:
            return self._exits.setdefault(pid, -1)
        return None

    def close(self, timeout_s: float) -> None:
        """Close the server's stdin (it stops; members still running get their parent death signal) and wait for it."""
        if self.proc.stdin is not None and not self.proc.stdin.closed:
            try:
                self.proc.stdin.close()
            except OSError:
                pass
        try:
            self.proc.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
        self._reader.join(timeout=timeout_s)


class ForkedProcess:
    """A member forked by a ``ForkServer``, with the part of ``subprocess.Popen`` the backend uses."""

    def __init__(self, pid: int, server: ForkServer) -> None:
        self.pid = pid
        self._server = server

    @property
    def returncode(self) -> int | None:
        return self._server.returncode(self.pid)

    def poll(self) -> int | None:
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        """The exit code, waiting at most ``timeout`` seconds (``subprocess.TimeoutExpired`` after)."""
        deadline = None if timeout is None else time.monotonic() + timeout
        while (code := self.returncode) is None:
            if deadline is not None and time.monotonic() > deadline:
                raise subprocess.TimeoutExpired(f"forked pid {self.pid}", timeout or 0.0)
            time.sleep(0.02)
        return code


class LocalBackend:
    """Worker groups as local processes (see the module docstring)."""

    bind_host = HOST
    launcher_host = HOST
    shared_dir = None  # one machine: every path is the same for all
    start_timeout_s = 60.0
    start_spread_s = 0.0  # every process starts at once
    sidecars = False  # processes, not pods: the shards of dock.placement=beside are a group of their own

    def __init__(self, run_id: str, *, state_dir: str | Path | None = None, log_dir: str | Path | None = None, grace_s: float = 5.0,
                 run_dir: str | Path | None = None, fork_server: bool = True):
        if not run_id or "/" in run_id:
            raise ValueError(f"local backend: run_id {run_id!r}; expected a non-empty name without '/'")
        self.run_id = run_id
        self.state_dir = Path(state_dir) if state_dir else default_state_dir()
        self.log_dir = Path(log_dir) if log_dir else self.state_dir / run_id
        self.run_dir = Path(run_dir).resolve() if run_dir else None  # recorded: `dockrl teardown RUN_DIR` finds the run by it
        self.grace_s = grace_s
        self.fork_server = fork_server
        self._procs: list[tuple[str, str, subprocess.Popen | ForkedProcess, Path]] = []  # (group, member, process, log)
        self._servers: list[ForkServer] = []

    @property
    def logs(self) -> str:
        return str(self.log_dir)

    def program(self) -> tuple[str, ...]:
        return (sys.executable, "-m", "dockrl")

    def serve_ports(self, n: int) -> list[int]:
        return free_ports(n)

    def address(self, group: str, replica: int, port: int) -> str:
        return f"{HOST}:{port}"

    def nodes(self, group: WorkerGroup) -> int:
        return 1

    @property
    def state_file(self) -> Path:
        return self.state_dir / f"{self.run_id}.json"

    def start(self, groups: Sequence[WorkerGroup]) -> None:
        self.log_dir.mkdir(parents=True, exist_ok=True)
        self.state_dir.mkdir(parents=True, exist_ok=True)
        program = self.program()
        run_env = {**os.environ, **SINGLE_MACHINE_ENV, "DOCKRL_RUN_ID": self.run_id, DRIVER_PID_ENV: str(os.getpid())}
        server: ForkServer | None = None
        try:
            for g in groups:
                forked = self.fork_server and tuple(g.command[:len(program) + 1]) == (*program, "worker")
                if forked and server is None:
                    server = ForkServer(run_env, self.log_dir / f"fork-server-{len(self._servers)}.log", self.start_timeout_s)
                    self._servers.append(server)
                for i in range(g.replicas):
                    member = f"{g.name}-{i}"
                    env = {**run_env, **g.env, **g.secret_env, "DOCKRL_GROUP": g.name, REPLICA_ENV: str(i), REPLICAS_ENV: str(g.replicas)}
                    log = self.log_dir / f"{member}.log"
                    proc: subprocess.Popen | ForkedProcess
                    if forked and server is not None:
                        try:
                            proc = server.fork(g.command[len(program) + 1:], env, log)
                        except RuntimeError as e:
                            raise WorkerFailed(g.name, member, str(e).split("\n", 1)[0], log_tail(server.log)) from None
                    else:
                        with open(log, "wb") as out:
                            proc = subprocess.Popen(list(g.command), env=env, stdout=out, stderr=subprocess.STDOUT,
                                                    stdin=subprocess.DEVNULL, start_new_session=True)
                    self._procs.append((g.name, member, proc, log))
                    logger.info("started %s (pid %d): %s", member, proc.pid, " ".join(g.command))
        finally:
            self.write_state()

    def write_state(self) -> None:
        """Write the run's record (``state_file``: run id, run folder, driver and every worker's pid,
        start time and log) through a temporary file, so a reader never sees half of it."""
        rows = [{"group": g, "member": m, "pid": p.pid, "start_time": start_time(p.pid), "log": str(log)}
                for g, m, p, log in self._procs]
        tmp = self.state_file.with_suffix(".json.tmp")
        doc = {"run_id": self.run_id, "run_dir": str(self.run_dir) if self.run_dir else None, "driver_pid": os.getpid(),
               "driver_start_time": start_time(os.getpid()), "workers": rows}
        tmp.write_text(json.dumps(doc, indent=2))
        os.replace(tmp, self.state_file)

    def check(self) -> None:
        for group, member, proc, log in self._procs:
            rc = proc.poll()
            if rc is not None and rc != 0:
                raise WorkerFailed(group, member, f"exited with code {rc}", log_tail(log))

    def wait_ready(self, timeout_s: float) -> None:
        # a local process runs once it is started: readiness is "none has failed yet"
        self.check()

    def wait(self, timeout_s: float, poll_s: float = 0.2) -> None:
        """Block until every worker has exited 0; fail fast with the first failure's log tail."""
        deadline = time.monotonic() + timeout_s
        while True:
            self.check()
            if all(p.poll() is not None for _, _, p, _ in self._procs):
                return
            if time.monotonic() > deadline:
                running = [m for _, m, p, _ in self._procs if p.poll() is None]
                raise TimeoutError(f"local workers still running after {timeout_s:.0f} s: {running}")
            time.sleep(poll_s)

    def teardown(self) -> int:
        """Stop every worker of the run (SIGTERM, SIGKILL after ``grace_s``); returns how many were running."""
        # a worker that died (SIGKILL) may leave its children (a reward pool's forkserver) in its group
        targets: dict[int, int | None] = {
            p.pid: start_time(p.pid) for _, _, p, _ in self._procs if p.poll() is None or group_members(p.pid)
        }
        if self.state_file.is_file():
            for row in json.loads(self.state_file.read_text()).get("workers", []):
                now = start_time(row["pid"])
                if now is not None and now == row["start_time"]:
                    targets.setdefault(row["pid"], now)
        servers = {server.proc.pid for server in self._servers}  # closed below, once they reported their members' exits
        for pid in set(run_processes(self.run_id)) - servers:  # a worker not (yet) recorded, or what one that died started
            group = pgid(pid)
            if group is not None and group != os.getpgrp():  # never this process's own group
                targets.setdefault(group, None)
        for pid in targets:
            self._signal(pid, signal.SIGTERM)
        deadline = time.monotonic() + self.grace_s
        # a worker's children (vLLM, reward pools) share its process group and stop with it:
        # wait for the whole group, not only its leader
        while time.monotonic() < deadline and any(self._alive(pid, st) or group_members(pid) for pid, st in targets.items()):
            time.sleep(0.05)
        for pid, st in targets.items():
            if self._alive(pid, st) or group_members(pid):
                logger.warning("worker pid %d (or a process it started) ignored SIGTERM for %.0f s; killing its group", pid, self.grace_s)
                self._signal(pid, signal.SIGKILL)
        for _, _, p, _ in self._procs:
            try:
                p.wait(timeout=self.grace_s)
            except subprocess.TimeoutExpired:
                logger.warning("worker pid %d did not exit after SIGKILL", p.pid)
        for server in self._servers:
            server.close(self.grace_s)
        self.state_file.unlink(missing_ok=True)
        logger.info("local teardown of run %s: %d running worker(s) stopped", self.run_id, len(targets))
        return len(targets)

    def _alive(self, pid: int, recorded_start: int | None) -> bool:
        own = next((p for _, _, p, _ in self._procs if p.pid == pid), None)
        if own is not None:
            return own.poll() is None
        if recorded_start is None:  # found by its DOCKRL_RUN_ID: a group leader, maybe gone already
            return start_time(pid) is not None
        return start_time(pid) == recorded_start

    @staticmethod
    def _signal(pid: int, sig: int) -> None:
        # each worker leads its own session: signal its whole process group (its children too)
        try:
            os.killpg(pid, sig)
        except ProcessLookupError:
            pass
