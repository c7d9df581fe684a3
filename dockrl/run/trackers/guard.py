"""``TrackerSet``: the run's trackers, whose failures never fail training.

A tracker that raises (its server killed, a network partition, a full disk) is counted, warned about in one line
at the start of the outage, and retried with backoff: the first retry ``retry_first_s`` after the failure, each
next one twice as late, at most ``retry_max_s``. The iterations logged meanwhile are held (at most ``BACKLOG``;
beyond it the oldest are dropped and counted) and sent in order once the tracker answers again, so a server that
restarts during a days-long run misses nothing, and a server that stays down costs one bounded attempt per backoff
interval, never one per iteration. (Giving up after the first failure would lose every later iteration for a
restart of a few seconds.) ``finish`` tries once more whatever the backoff, then ends each tracker's run.

Each failure adds to ``tracker/<name>/failures``, which the run's metrics carry from the first failure on, and the
summary carries with ``tracker/<name>/unsent`` (iterations that never reached the tracker); a run whose trackers
never failed has neither.
"""

from __future__ import annotations

import functools
import importlib.util
import logging
import math
import time
from collections import deque
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Mapping, Sequence

from dockrl.config.errors import fail
from dockrl.config.trackers import TRACKERS
from dockrl.run.trackers.tracker import RunInfo, Tracker

logger = logging.getLogger(__name__)

RETRY_FIRST_S = 5.0
"""Seconds from a tracker's failure to its first retry."""
RETRY_MAX_S = 300.0
"""Longest wait between two retries of a failing tracker, seconds."""
BACKLOG = 10_000
"""Iterations held for a failing tracker; beyond it the oldest are dropped (counted as unsent)."""


@dataclass
class _Guarded:
    tracker: Tracker
    started: bool = False
    failures: int = 0
    dropped: int = 0
    delay: float = 0.0
    next_try: float = -math.inf
    backlog: deque[tuple[int, dict[str, float]]] = field(default_factory=deque)


class TrackerSet:
    """The run's trackers by name (see the module docstring).

    Args:
        trackers: name -> an unstarted ``Tracker``.
        artifacts: some tracker keeps files: ``finish`` is worth its ``artifacts`` (``dockrl.run.metrics.run_report``).
        clock: monotonic seconds (tests pass a fake one).
    """

    def __init__(self, trackers: Mapping[str, Tracker], *, artifacts: bool = False, clock: Callable[[], float] = time.monotonic,
                 retry_first_s: float = RETRY_FIRST_S, retry_max_s: float = RETRY_MAX_S):
        self._guarded = {name: _Guarded(tracker) for name, tracker in trackers.items()}
        self.artifacts, self.clock = artifacts, clock
        self.retry_first_s, self.retry_max_s = retry_first_s, retry_max_s

    @classmethod
    def open(cls, names: Sequence[str], run: RunInfo, **kwargs) -> TrackerSet:
        """The trackers ``names`` (``run.trackers``) of ``run``, built, not started.

        Raises:
            ConfigError: naming ``run.trackers``: a tracker's client is not installed (the extra to install), or its
                settings are missing (a tracker's own message, e.g. ``$MLFLOW_TRACKING_URI``).
        """
        trackers: dict[str, Tracker] = {}
        for name in names:
            entry = TRACKERS[name]
            if importlib.util.find_spec(entry.module) is None:
                raise fail("run.trackers", name, f"needs the {entry.module!r} package: pip install 'dockrl[{entry.extra}]'")
            trackers[name] = entry.load()(run)
        return cls(trackers, artifacts=any(TRACKERS[n].artifacts for n in names), **kwargs)

    def _attempt(self, name: str, g: _Guarded, what: str, action: Callable[[], None], *, force: bool = False) -> bool:
        """``action`` (after ``start``, the first time), unless ``g`` waits out its backoff; a failure is counted."""
        now = self.clock()
        if now < g.next_try and not force:
            return False
        try:
            if not g.started:
                g.tracker.start()
                g.started = True
            action()
        except Exception as exc:  # noqa: BLE001 - whatever a tracker raises is the tracker's failure, never the run's
            g.failures += 1
            if g.delay == 0:  # the first failure of an outage: one line, not one per iteration
                logger.warning("tracker %s failed %s (%s: %s); training goes on: %d iteration(s) held, retried with "
                               "backoff from %.0f s to %.0f s (tracker/%s/failures counts the failures)", name, what,
                               type(exc).__name__, str(exc)[:300], len(g.backlog), self.retry_first_s, self.retry_max_s, name)
            g.delay = min(max(2 * g.delay, self.retry_first_s), self.retry_max_s)
            g.next_try = now + g.delay
            return False
        if g.delay:
            logger.info("tracker %s answers again after %d failure(s)", name, g.failures)
            g.delay, g.next_try = 0.0, -math.inf
        return True

    @staticmethod
    def _send(g: _Guarded) -> None:
        while g.backlog:  # in order; what was sent leaves the backlog even if a later one fails
            iteration, metrics = g.backlog[0]
            g.tracker.log(iteration, metrics)
            g.backlog.popleft()

    def log(self, iteration: int, metrics: Mapping[str, float]) -> None:
        """Hand ``metrics`` of ``iteration`` to every tracker (with what a failing one holds); never raises."""
        for name, g in self._guarded.items():
            g.backlog.append((iteration, dict(metrics)))
            if len(g.backlog) > BACKLOG:
                g.backlog.popleft()
                g.dropped += 1
            self._attempt(name, g, f"at iteration {iteration}", functools.partial(self._send, g))

    def counters(self, final: bool = False) -> dict[str, float]:
        """``tracker/<name>/failures`` of the trackers that failed so far; ``final``: with ``tracker/<name>/unsent``
        (iterations that never reached it), of those that failed or missed any. A run without failures has none."""
        out: dict[str, float] = {}
        for name, g in self._guarded.items():
            unsent = len(g.backlog) + g.dropped
            if g.failures or (final and unsent):
                out[f"tracker/{name}/failures"] = g.failures
                if final:
                    out[f"tracker/{name}/unsent"] = unsent
        return out

    def finish(self, summary: Mapping[str, float], artifacts: Sequence[Path] = (), *, failed: bool = False) -> dict[str, float]:
        """Send what is held, ``artifacts`` and ``summary``, and end every tracker's run (as failed with ``failed``),
        each tried once more whatever its backoff; returns ``counters(final=True)``. Never raises."""
        for name, g in self._guarded.items():
            def close(g: _Guarded = g) -> None:
                self._send(g)
                if artifacts:
                    g.tracker.log_artifacts(artifacts)
                g.tracker.finish(summary, failed)

            if g.started or g.backlog or not failed:  # a run that failed before its first iteration opens no tracker run
                self._attempt(name, g, "at the end of the run", close, force=True)
        return self.counters(final=True)
