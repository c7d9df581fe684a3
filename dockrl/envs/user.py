"""A user's environment (``env.name=package.module:Class``) in a process of its own, under ``env.timeout_s``.

As a custom scorer (``dockrl.rewards.guard.ScorerProcess``; both run in a ``dockrl.isolation.user_code.UserProcess``),
the class is built with no arguments in a child process (``spawn``) that exits with its owner; every call (``open``,
``step``, an episode's ``close``) is a request over a pipe answered within ``env.timeout_s``. An environment that
raises, dies, or does not answer in time fails the rollout with ``EnvironmentFailure`` naming ``env.name`` and what
it waited for. Requests from several threads are answered one at a time.
"""

from __future__ import annotations

import itertools
import threading
from typing import Any

from dockrl.envs.base import EnvironmentFailure, Episode, Step
from dockrl.isolation.user_code import START_TIMEOUT_S, ChildDied, ChildRaised, UserProcess


class _EnvServer:
    """The child's side: the environment, and the episodes it opened, by key."""

    def __init__(self, env: Any) -> None:
        self.env, self.episodes, self.ids = env, dict[int, Any](), itertools.count()

    def hello(self) -> list[dict]:
        return list(self.env.tools)

    def handle(self, op: str, args: tuple) -> Any:
        if op == "open":
            key = next(self.ids)
            self.episodes[key] = self.env.open(*args)
            return key, callable(getattr(self.episodes[key], "calls_end", None))
        if op == "step":
            step = self.episodes[args[0]].step(args[1])
            if not isinstance(step, Step):
                raise TypeError(f"step returned a {type(step).__name__}; expected dockrl.envs.base.Step")
            return step
        if op == "calls_end":  # asked only of an episode that has it (open's answer)
            return self.episodes[args[0]].calls_end(args[1])
        if op == "close_episode":
            episode = self.episodes.pop(args[0], None)
            if episode is not None:
                episode.close()
            return None
        raise ValueError(f"unknown request {op!r}")

    def close(self) -> None:
        self.env.close()


class UserEnvironment:
    """The environment ``path`` names, run in a child process (``dockrl.isolation.user_code.UserProcess``); an ``Environment``.

    Args:
        path: ``env.name`` (``package.module:Class``).
        timeout_s: ``env.timeout_s``: longest wait for one answer, seconds.

    Raises:
        EnvironmentFailure: the class does not build (its traceback in the message) within ``START_TIMEOUT_S``.
    """

    def __init__(self, path: str, *, timeout_s: float) -> None:
        self.path, self.timeout_s = path, float(timeout_s)
        self._lock = threading.Lock()
        self._child = UserProcess(path, {}, _EnvServer, name=f"dockrl-env {path}")
        with self._lock:
            try:
                self.tools: list[dict] = self._answer("its start (building the class)", max(START_TIMEOUT_S, self.timeout_s))
            except EnvironmentFailure:
                self._child.kill()
                raise

    def _answer(self, what: str, timeout_s: float) -> Any:
        if not self._child.wait(timeout_s):
            self._child.kill()
            raise EnvironmentFailure(f"env.name={self.path!r}: no answer to {what} within {timeout_s:g} s (env.timeout_s); "
                                     "its process was stopped")
        try:
            return self._child.answer(reap_s=2)
        except ChildDied as e:
            raise EnvironmentFailure(f"env.name={self.path!r}: its process died during {what} (exit code {e.args[0]})") from None
        except ChildRaised as e:
            raise EnvironmentFailure(f"env.name={self.path!r} raised during {what}:\n{e.args[0]}") from None

    def call(self, op: str, args: tuple, what: str) -> Any:
        """Send one request and wait for its answer (one request at a time).

        Raises:
            EnvironmentFailure: it raised, its process died or was stopped earlier, or no answer came within ``env.timeout_s``.
        """
        with self._lock:
            if not self._child.running:
                raise EnvironmentFailure(f"env.name={self.path!r}: its process is gone (stopped after an earlier failure, or closed)")
            try:
                self._child.request(op, args)
            except (OSError, ValueError) as e:
                self._child.kill()
                raise EnvironmentFailure(f"env.name={self.path!r}: could not send {what} to its process ({e})") from None
            return self._answer(what, self.timeout_s)

    @property
    def running(self) -> bool:
        """Its process runs (not stopped after a failure, not closed)."""
        return self._child.running

    def open(self, ground_truth: str) -> Episode:
        key, has_calls_end = self.call("open", (ground_truth,), "open")
        return UserEpisode(self, key, has_calls_end)

    def close(self) -> None:
        """Close the environment and stop its process; idempotent."""
        with self._lock:
            self._child.close(min(self.timeout_s, 10.0))


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
            if self.env.running:  # the environment raised in close: that is its failure to report
                raise
