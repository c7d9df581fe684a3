"""The dock's control channel: which iteration is open, per-stage reports, the end of a run.

When stages run as separate processes they share nothing but the dock, so the dock also
carries the little coordination they need (metadata only, never payload):

* ``wait_iteration(after)`` — a stage blocks until an iteration newer than ``after`` is open
  and gets its number (the oldest such, when several are open: ``dock.max_inflight``), or
  ``None`` once the driver called ``finish()`` (and no newer one is open): its loop ends.
* ``report(iteration, stage, metrics)`` — a stage hands in the flat metrics dict of an
  iteration (or of a pseudo-iteration such as the evaluation before training).
* ``wait_reports(iteration, stages)`` — the driver blocks until every named stage reported.

Every wait is event-driven on one condition variable and has a timeout whose error names what
it waited for. ``ShardService`` owns one ``RunControl`` (``service.control``); a networked shard
serves shard 0's to every ``DockClient``.
"""

from __future__ import annotations

import math
import numbers
import threading
import time
from typing import Mapping, Sequence

from dockrl.dock.errors import DockError, DockTimeoutError


def check_metrics(metrics: object, what: str) -> dict[str, float]:
    """``metrics`` as a ``dict[str, float]``.

    Raises:
        DockError: not a mapping, a key that is not a non-empty string, or a value that is
            not a real number (``bool`` is refused too: it is a flag, not a metric).
    """
    if not isinstance(metrics, Mapping):
        raise DockError(f"{what}: metrics must be a mapping of name to number, got {type(metrics).__name__}")
    out: dict[str, float] = {}
    for key, value in metrics.items():
        if not isinstance(key, str) or not key:
            raise DockError(f"{what}: metric name {key!r} must be a non-empty string")
        if isinstance(value, bool) or not isinstance(value, numbers.Real):
            raise DockError(f"{what}: metric {key!r} is {value!r} ({type(value).__name__}); expected a number")
        out[key] = float(value)
    return out


class RunControl:
    """Open-iteration announcements, stage reports and the finish flag of one run.

    Args:
        timeout_s: default timeout of the waits, seconds (``math.inf``: wait forever).

    Thread-safe. The owner calls ``set_open`` when an iteration is announced, ``set_closed``
    when one closes (several may be open: ``dock.max_inflight``) and ``shutdown`` when it goes
    away (blocked waits then fail with ``DockError``).
    """

    def __init__(self, *, timeout_s: float = 600.0) -> None:
        self.timeout_s = timeout_s
        self._cond = threading.Condition()
        self._open: set[int] = set()  # announced and not closed
        self._finished = False
        self._shutdown: str | None = None
        self._reports: dict[int, dict[str, dict[str, float]]] = {}

    def set_open(self, iteration: int) -> None:
        """``iteration`` is announced: ``wait_iteration`` may return it."""
        with self._cond:
            self._open.add(iteration)
            self._cond.notify_all()

    def set_closed(self, iteration: int | None = None) -> None:
        """``iteration`` closed (``None``: every open one)."""
        with self._cond:
            if iteration is None:
                self._open.clear()
            else:
                self._open.discard(iteration)
            self._cond.notify_all()

    def _open_now(self) -> int | list[int] | None:
        """The announced open iterations for messages: one as a number, several as a list."""
        return None if not self._open else min(self._open) if len(self._open) == 1 else sorted(self._open)

    def shutdown(self, reason: str) -> None:
        """Fail every blocked and later wait with ``DockError(reason)``."""
        with self._cond:
            self._shutdown = reason
            self._cond.notify_all()

    def _wait(self, remaining: float) -> None:
        self._cond.wait(remaining if math.isfinite(remaining) else None)

    def _check_shutdown(self, what: str) -> None:
        if self._shutdown is not None:
            raise DockError(f"{what}: {self._shutdown}")

    def wait_iteration(self, after: int, timeout_s: float | None = None) -> int | None:
        """Block until an iteration newer than ``after`` is open; return its number (the oldest
        such when several are).

        Returns ``None`` once ``finish()`` was called and no iteration newer than ``after``
        is open: the caller's stage loop is over.

        Raises:
            DockTimeoutError: neither happened within ``timeout_s`` seconds (default: the
                control's ``timeout_s``); the message names ``after`` and the open iteration.
            DockError: the dock shut down.
        """
        what = f"wait_iteration(after={after})"
        timeout = self.timeout_s if timeout_s is None else timeout_s
        deadline = time.monotonic() + timeout
        with self._cond:
            while True:
                self._check_shutdown(what)
                newer = [i for i in self._open if i > after]
                if newer:
                    return min(newer)
                if self._finished:
                    return None
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    raise DockTimeoutError(
                        f"{what} timed out after {timeout:.1f}s: no iteration after {after} was opened "
                        f"(open now: {self._open_now()}) and the driver has not called finish()"
                    )
                self._wait(remaining)

    def report(self, iteration: int, stage: str, metrics: Mapping[str, float]) -> None:
        """Record the metrics ``stage`` produced for ``iteration``.

        Raises:
            DockError: ``stage`` is empty, ``iteration`` not an integer, ``metrics`` not a
                ``dict[str, number]``, or this stage already reported this iteration.
        """
        what = f"report({iteration}, {stage!r})"
        if isinstance(iteration, bool) or not isinstance(iteration, int):
            raise DockError(f"{what}: iteration must be an integer, got {type(iteration).__name__}")
        if not isinstance(stage, str) or not stage:
            raise DockError(f"{what}: stage must be a non-empty string")
        values = check_metrics(metrics, what)
        with self._cond:
            self._check_shutdown(what)
            got = self._reports.setdefault(iteration, {})
            if stage in got:
                raise DockError(f"{what}: stage {stage!r} already reported iteration {iteration}")
            got[stage] = values
            self._cond.notify_all()

    def wait_reports(self, iteration: int, stages: Sequence[str], timeout_s: float | None = None) -> dict[str, dict[str, float]]:
        """Block until every stage in ``stages`` reported ``iteration``; return ``{stage: metrics}``.

        Raises:
            DockTimeoutError: some stages had not reported within ``timeout_s`` seconds
                (default: the control's ``timeout_s``); the message names them.
            DockError: ``stages`` is empty, or the dock shut down.
        """
        stages = list(stages)
        what = f"wait_reports({iteration}, {stages})"
        if not stages:
            raise DockError(f"{what}: name at least one stage to wait for")
        timeout = self.timeout_s if timeout_s is None else timeout_s
        deadline = time.monotonic() + timeout
        with self._cond:
            while True:
                self._check_shutdown(what)
                got = self._reports.get(iteration, {})
                missing = [s for s in stages if s not in got]
                if not missing:
                    return {s: dict(got[s]) for s in stages}
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    raise DockTimeoutError(
                        f"{what} timed out after {timeout:.1f}s: stages {missing} have not reported iteration "
                        f"{iteration} (reported: {sorted(got)})"
                    )
                self._wait(remaining)

    def finish(self) -> None:
        """Announce that no further iteration will open; idle ``wait_iteration`` calls return ``None``."""
        with self._cond:
            self._finished = True
            self._cond.notify_all()
