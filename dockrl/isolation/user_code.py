"""A user's code named by import path (``package.module:Class``), as custom scorers (``algorithm.scorer``) and
user environments (``env.name``) name it, run in a child process of its own (``UserProcess``): imported and built
in a spawned child that exits with its owner, called over a pipe, each answer waited for with the owner's timeout,
killed at once. The callers word the errors (``EnvironmentFailure``, ``ScorerError``) and choose the timeouts.
"""

from __future__ import annotations

import multiprocessing
import os
import traceback
from multiprocessing.connection import Connection
from multiprocessing.process import BaseProcess
from typing import Any, Protocol

from dockrl.process.imports import import_object
from dockrl.process.lifeline import guard_pool_worker

START_TIMEOUT_S = 120.0
"""Longest a user's child process may take to start and build its class, seconds."""


class ChildRaised(Exception):
    """The user's code raised in its child process (or answered with what does not pickle); ``args[0]``: its traceback."""


class ChildDied(Exception):
    """The child process ended without answering; ``args[0]``: its exit code (None when unknown)."""


class Server(Protocol):
    """The child's side of a ``UserProcess``: wraps the object ``module:Class(**kwargs)`` built there."""

    def __init__(self, obj: Any) -> None: ...

    def hello(self) -> Any:
        """What the child sends once the object is built (a user environment's tools)."""

    def handle(self, op: str, args: tuple) -> Any:
        """The answer to one request (``op`` other than ``close``)."""

    def close(self) -> None:
        """The ``close`` request: the child answers, then ends."""


def _child(conn: Connection, owner: int, path: str, kwargs: dict[str, Any], server_cls: type[Server]) -> None:
    """The child: exit with ``owner``, build the object and its server, then answer ``(op, args)`` requests until
    ``close`` or EOF; each answer is ``("ok", value)`` or ``("error", traceback)``."""
    guard_pool_worker(owner)
    try:
        server = server_cls(import_object(path)(**kwargs))
        conn.send(("ok", server.hello()))
    except BaseException:  # noqa: BLE001 - reported to the owner, which fails the run
        conn.send(("error", traceback.format_exc()))
        return
    while True:
        try:
            op, args = conn.recv()
        except (EOFError, OSError):
            return
        try:
            if op == "close":
                server.close()
                conn.send(("ok", None))
                return
            conn.send(("ok", server.handle(op, args)))
        except BaseException:  # noqa: BLE001 - raising user code, or a result that does not pickle
            conn.send(("error", traceback.format_exc()))


class UserProcess:
    """A user's ``module:Class`` built with ``kwargs`` in a spawned child process that exits with this one
    (``dockrl.process.lifeline.guard_pool_worker``), served there by ``server_cls``; requests over a pipe.

    Not thread-safe: its owner sends one request at a time and waits for its answer. Every wait has the
    owner's timeout (``wait``); ``kill`` stops the child at once.
    """

    def __init__(self, path: str, kwargs: dict[str, Any], server_cls: type[Server], *, name: str) -> None:
        ctx = multiprocessing.get_context("spawn")
        parent, child = ctx.Pipe()
        self.proc: BaseProcess | None = ctx.Process(target=_child, args=(child, os.getpid(), path, kwargs, server_cls),
                                                    daemon=True, name=name)
        self.proc.start()
        child.close()
        self.conn: Connection | None = parent

    @property
    def running(self) -> bool:
        """Not killed or closed."""
        return self.conn is not None

    def request(self, op: str, args: tuple) -> None:
        """Send one request.

        Raises:
            OSError, ValueError: the pipe is gone.
        """
        assert self.conn is not None, "the user's process runs"
        self.conn.send((op, args))

    def wait(self, timeout_s: float) -> bool:
        """Whether an answer (or the child's end) came within ``timeout_s`` seconds."""
        assert self.conn is not None, "the user's process runs"
        return self.conn.poll(timeout_s)

    def answer(self, *, reap_s: float = 0.0) -> Any:
        """The answer that came (call after ``wait``).

        Raises:
            ChildRaised: the user's code raised (its traceback).
            ChildDied: the child ended instead (its exit code, read after up to ``reap_s`` seconds); it is killed.
        """
        assert self.conn is not None, "the user's process runs"
        try:
            status, value = self.conn.recv()
        except (EOFError, OSError):
            if reap_s and self.proc is not None:
                self.proc.join(timeout=reap_s)  # its pipe closes a moment before the process is reaped
            code = self.proc.exitcode if self.proc is not None else None
            self.kill()
            raise ChildDied(code) from None
        if status == "error":
            raise ChildRaised(value.rstrip())
        return value

    def kill(self) -> None:
        """Stop the child now (SIGKILL) and close the pipe; idempotent."""
        proc, conn, self.proc, self.conn = self.proc, self.conn, None, None
        if proc is not None and proc.is_alive():
            proc.kill()
        if proc is not None:
            proc.join(timeout=5)
        if conn is not None:
            conn.close()

    def close(self, timeout_s: float) -> None:
        """Ask the user's object to close (waiting up to ``timeout_s`` for it), then stop the child; idempotent."""
        if self.conn is not None:
            try:
                self.conn.send(("close", ()))
                if self.conn.poll(timeout_s):
                    self.conn.recv()
            except (EOFError, OSError):
                pass
        self.kill()
