"""A user's environment (``env.name=package.module:Class``) in a process of its own, under ``env.timeout_s``.

As a custom scorer (``dockrl.rewards.guard.ScorerProcess``; both import ``module:Class`` with
``dockrl.isolation.user_code`` and arm the lifeline), the class is built with no arguments in a child process (``spawn``) that
exits with its owner; every call (``open``, ``step``, an episode's ``close``) is a request over a
pipe answered within ``env.timeout_s``. An environment that raises, dies, or does not answer in
time fails the rollout with ``EnvironmentFailure`` naming ``env.name`` and what it waited for.
Requests from several threads are answered one at a time.
"""

from __future__ import annotations

import itertools
import multiprocessing
import os
import threading
import traceback
from multiprocessing.connection import Connection
from multiprocessing.process import BaseProcess
from typing import Any

from dockrl.envs.base import EnvironmentFailure, Episode, Step
from dockrl.isolation.user_code import START_TIMEOUT_S, import_object
from dockrl.process.lifeline import guard_pool_worker


def _serve(conn: Connection, path: str, owner: int) -> None:
    """The child: build the environment, send its tools, then answer requests until ``close`` or EOF."""
    guard_pool_worker(owner)
    try:
        env = import_object(path)()
        conn.send(("ok", list(env.tools)))
    except BaseException:  # noqa: BLE001 - reported to the owner, which fails the run
        conn.send(("error", traceback.format_exc()))
        return
    episodes: dict[int, Any] = {}
    ids = itertools.count()
    while True:
        try:
            op, args = conn.recv()
        except (EOFError, OSError):
            return
        try:
            if op == "open":
                key = next(ids)
                episodes[key] = env.open(*args)
                conn.send(("ok", (key, callable(getattr(episodes[key], "calls_end", None)))))
            elif op == "step":
                step = episodes[args[0]].step(args[1])
                if not isinstance(step, Step):
                    raise TypeError(f"step returned a {type(step).__name__}; expected dockrl.envs.base.Step")
                conn.send(("ok", step))
            elif op == "calls_end":  # asked only of an episode that has it (open's answer)
                conn.send(("ok", episodes[args[0]].calls_end(args[1])))
            elif op == "close_episode":
                episode = episodes.pop(args[0], None)
                if episode is not None:
                    episode.close()
                conn.send(("ok", None))
            else:
                env.close()
                conn.send(("ok", None))
                return
        except BaseException:  # noqa: BLE001 - a raising environment, or a result that does not pickle
            conn.send(("error", traceback.format_exc()))


class UserEnvironment:
    """The environment ``path`` names, run in a child process; an ``Environment``.

    Args:
        path: ``env.name`` (``package.module:Class``).
        timeout_s: ``env.timeout_s``: longest wait for one answer, seconds.

    Raises:
        EnvironmentFailure: the class does not build (its traceback in the message) within ``START_TIMEOUT_S``.
    """

    def __init__(self, path: str, *, timeout_s: float) -> None:
        self.path, self.timeout_s = path, float(timeout_s)
        self._lock = threading.Lock()
        ctx = multiprocessing.get_context("spawn")
        parent, child = ctx.Pipe()
        self._proc: BaseProcess | None = ctx.Process(target=_serve, args=(child, path, os.getpid()), daemon=True,
                                                     name=f"dockrl-env {path}")
        self._proc.start()
        child.close()
        self._conn: Connection | None = parent
        with self._lock:
            try:
                self.tools: list[dict] = self._answer("its start (building the class)", max(START_TIMEOUT_S, self.timeout_s))
            except EnvironmentFailure:
                self._kill()
                raise

    def _answer(self, what: str, timeout_s: float) -> Any:
        assert self._conn is not None, "the environment's process runs"
        if not self._conn.poll(timeout_s):
            self._kill()
            raise EnvironmentFailure(f"env.name={self.path!r}: no answer to {what} within {timeout_s:g} s (env.timeout_s); "
                                     "its process was stopped")
        try:
            status, value = self._conn.recv()
        except (EOFError, OSError):
            if self._proc is not None:
                self._proc.join(timeout=2)  # its pipe closes a moment before the process is reaped
            code = self._proc.exitcode if self._proc is not None else None
            self._kill()
            raise EnvironmentFailure(f"env.name={self.path!r}: its process died during {what} (exit code {code})") from None
        if status == "error":
            raise EnvironmentFailure(f"env.name={self.path!r} raised during {what}:\n{value.rstrip()}")
        return value

    def call(self, op: str, args: tuple, what: str) -> Any:
        """Send one request and wait for its answer (one request at a time).

        Raises:
            EnvironmentFailure: it raised, its process died or was stopped earlier, or no answer came within ``env.timeout_s``.
        """
        with self._lock:
            if self._conn is None:
                raise EnvironmentFailure(f"env.name={self.path!r}: its process is gone (stopped after an earlier failure, or closed)")
            try:
                self._conn.send((op, args))
            except (OSError, ValueError) as e:
                self._kill()
                raise EnvironmentFailure(f"env.name={self.path!r}: could not send {what} to its process ({e})") from None
            return self._answer(what, self.timeout_s)

    def open(self, ground_truth: str) -> Episode:
        key, has_calls_end = self.call("open", (ground_truth,), "open")
        return UserEpisode(self, key, has_calls_end)

    def _kill(self) -> None:
        proc, conn, self._proc, self._conn = self._proc, self._conn, None, None
        if proc is not None and proc.is_alive():
            proc.kill()
        if proc is not None:
            proc.join(timeout=5)
        if conn is not None:
            conn.close()

    def close(self) -> None:
        """Close the environment and stop its process; idempotent."""
        with self._lock:
            if self._conn is not None:
                try:
                    self._conn.send(("close", ()))
                    if self._conn.poll(min(self.timeout_s, 10.0)):
                        self._conn.recv()
                except (EOFError, OSError):
                    pass
            self._kill()


class UserEpisode:
    """One trajectory's episode, held in the environment's process."""

    def __init__(self, env: UserEnvironment, key: int, has_calls_end: bool) -> None:
        self.env, self.key, self.has_calls_end, self._closed = env, key, has_calls_end, False

    def step(self, turn: str) -> Step:
        return self.env.call("step", (self.key, turn), "a step")

    def calls_end(self, turn: str) -> int | None:
        """The episode's ``calls_end(turn)`` in the environment's process; None, without a request, where it defines none."""
        return self.env.call("calls_end", (self.key, turn), "a turn's calls_end") if self.has_calls_end else None

    def close(self) -> None:
        """Close the episode in the environment's process; idempotent, quiet when the process is already gone."""
        if self._closed:
            return
        self._closed = True
        try:
            self.env.call("close_episode", (self.key,), "an episode's close")
        except EnvironmentFailure:
            if self.env._conn is not None:  # the environment raised in close: that is its failure to report
                raise
