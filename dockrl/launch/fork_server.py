"""The fork server of a local run: its stage processes forked from one process that has imported their code.

A stage process (``dockrl worker``) spends most of its start importing torch and transformers (4-5 s of
one core each on a 2-core AMD EPYC; a run of the tiny model starts 3-5 of them at once, then trains for
a second or two). ``LocalBackend`` starts one server per ``start``, with the run's environment
(``python -m dockrl fork-server``); the server imports a stage process's code once (``preload``) and
forks that start's stage processes from itself, so a run pays the imports once and its stage processes
share those pages until they write them (Android's zygote, ``multiprocessing``'s forkserver). Dock shards
and other commands keep ``subprocess.Popen``.

A forked member is what ``python -m dockrl worker ARGS`` would be: it leads a session of its own, its
stdin is ``/dev/null``, its stdout and stderr go to its log, its environment is the one asked for
(``os.environ`` replaced; ``/proc/<pid>/environ`` keeps the server's, which holds the run's
``DOCKRL_RUN_ID``), ``sys.argv`` is the command's, and it returns from this module into
``dockrl.__main__`` with the command's exit code, so the interpreter exits as that process would
(non-daemon threads joined, ``atexit`` run, an uncaught exception printed with exit code 1). Its
``DRIVER_PID_ENV`` names the server, its parent: the server dies with the driver (the parent death
signal, SIGKILL) and the members with the server (``dockrl.process.lifeline.watch_driver``).

Protocol, one line each way per event: the driver writes ``{"argv": [...], "env": {...}, "log": path}``
as JSON on the server's stdin (``argv``: the arguments of ``dockrl worker``); the server answers
``started <pid>`` (or ``failed <message>``) and, once a member has exited, ``exited <pid> <code>``
(``os.waitstatus_to_exitcode``: -N for signal N) on its stdout. The server stops when its stdin closes.
It starts no Python thread (torch and pyarrow's allocator keep native ones, as in any process that forks
after importing them, a torch ``DataLoader``'s workers among them): a member has the one that forked it.
"""

from __future__ import annotations

import argparse
import json
import os
import select
import signal
import sys

from dockrl.process.lifeline import DRIVER_PID_ENV, die_with_parent


def preload() -> None:
    """Import what a stage process imports before it runs: ``dockrl worker``'s module (torch, transformers)
    and every stage's process body (``dockrl.stages.table.STAGES``); an engine's own package (vLLM, megatron-core)
    is imported by the member that builds it."""
    import dockrl.stages.main  # noqa: F401 - the point: imported here, once
    from dockrl.stages.table import STAGES, load

    for row in STAGES:
        if row.process:
            load(row.process)


def _answer(line: str) -> None:
    os.write(1, (line + "\n").encode())


def _reap() -> None:
    while True:
        try:
            pid, status = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return
        if pid == 0:
            return
        _answer(f"exited {pid} {os.waitstatus_to_exitcode(status)}")


def _become_member(request: dict, server_fds: tuple[int, ...]) -> int:
    """In the forked child: become the requested process and run its command; returns its exit code."""
    signal.set_wakeup_fd(-1)
    signal.signal(signal.SIGCHLD, signal.SIG_DFL)
    for fd in server_fds:
        os.close(fd)
    os.setsid()  # stdin and stdout, the driver's pipes, are replaced below
    null = os.open(os.devnull, os.O_RDONLY)
    log = os.open(request["log"], os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    os.dup2(null, 0)
    os.dup2(log, 1)
    os.dup2(log, 2)
    os.close(null)
    os.close(log)
    os.environ.clear()
    os.environ.update(request["env"])
    os.environ[DRIVER_PID_ENV] = str(os.getppid())
    sys.argv = [sys.argv[0], "worker", *request["argv"]]
    from dockrl.stages.main import main

    return main(request["argv"])


def serve(argv: list[str]) -> int:
    """``dockrl fork-server``: ``preload``, then fork a member per request until stdin closes.

    Exits the process (code 0) in the server once stdin closes; returns in a forked member, with that member's
    exit code (see the module docstring); 1 where the driver is already gone; ``--help`` prints the help and exits 0,
    any argument exits 2 (``argparse``).
    """
    argparse.ArgumentParser(prog="dockrl fork-server", description=(
        "Forks a local run's stage processes (dockrl worker) from one process that has imported their code; takes no "
        "arguments: the local worker backend starts it and sends it one JSON request a line on its stdin "
        "(dockrl/launch/fork_server.py)")).parse_args(argv)  # --help: the help, exit 0; any argument: exit 2
    driver = os.environ.get(DRIVER_PID_ENV, "")
    die_with_parent(signal.SIGKILL)
    if driver and str(os.getppid()) != driver:  # the driver died before the kernel was asked to tell us
        return 1
    preload()
    wake_r, wake_w = os.pipe()
    os.set_blocking(wake_w, False)
    signal.set_wakeup_fd(wake_w)
    signal.signal(signal.SIGCHLD, lambda *_: None)  # a handler, so that the wakeup fd hears of every exit
    pending = b""
    while True:
        ready, _, _ = select.select([0, wake_r], [], [])
        if wake_r in ready:
            os.read(wake_r, 4096)
        _reap()
        if 0 not in ready:
            continue
        data = os.read(0, 1 << 20)
        if not data:  # the driver is done with us: nothing to clean up, and an interpreter's shutdown with
            os._exit(0)  # torch and transformers loaded takes a second
        pending += data
        while b"\n" in pending:
            line, pending = pending.split(b"\n", 1)
            try:
                request = json.loads(line)
                pid = os.fork()
            except (ValueError, OSError) as e:
                _answer(f"failed {type(e).__name__}: {e}".replace("\n", " "))
                continue
            if pid == 0:
                return _become_member(request, (wake_r, wake_w))
            _answer(f"started {pid}")
