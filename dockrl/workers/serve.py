"""The loop every stage process runs: serve the driver's iterations and report each one.

A stage process (``dockrl/workers/main.py``) waits until the dock shards answer
(``wait_for_dock``), builds its engine, then serves the iterations the driver opens
(``serve_iterations``) until the driver calls ``finish()``; the reports are the run protocol's
(``dockrl.protocol.Report``).
"""

from __future__ import annotations

import logging
import time
from typing import TYPE_CHECKING, Callable

from dockrl.protocol import Report
from dockrl.resume import seed_iteration

if TYPE_CHECKING:
    from dockrl.dock.api import Dock

logger = logging.getLogger(__name__)


def serve_iterations(
    dock: Dock, stage: Report, step: Callable[[int], dict[str, float]], *, timeout_s: float,
    after_report: Callable[[int], None] | None = None, seed: int | None = None, report: bool = True,
    first_timeout_s: float | None = None,
) -> int:
    """Run ``step(iteration)`` for every iteration the driver opens and report its metrics.

    ``after_report(iteration)`` runs after the report (weight sync, checkpoints). With ``seed``
    the generators are reseeded from ``(seed, iteration)`` before each step. With ``report``
    false the metrics are dropped (ranks other than the first of a multi-rank stage). Returns
    the number of iterations served once the driver called ``finish()``. ``first_timeout_s``
    (default ``timeout_s``) bounds the wait for the first iteration: every stage starts at
    once, and the first opens only after the rollout's evaluation (``--first-wait-s``).

    Raises:
        DockTimeoutError: no iteration opened within ``timeout_s`` of the previous one.
    """
    last, served = -1, 0  # -1: before the first iteration
    while (it := dock.wait_iteration(last, first_timeout_s if served == 0 and first_timeout_s else timeout_s)) is not None:
        logger.info("%s: iteration %d", stage, it)
        if seed is not None:
            seed_iteration(seed, it)
        metrics = step(it)
        if report:
            dock.report(it, stage, metrics)
        if after_report is not None:
            after_report(it)
        last, served = it, served + 1
    logger.info("%s: finished after %d iterations", stage, served)
    return served


def wait_for_dock(locations: list[str], token: str | None, timeout_s: float, every_s: float = 0.5) -> None:
    """Block until every dock shard answers: a run's groups start at once, and a shard's pod may
    come up after a stage's (a slower image pull, a node still being added).

    Raises:
        DockTimeoutError: shards that did not answer within ``timeout_s`` (named).
        pyarrow.flight.FlightError: a shard answered with an error (a wrong token).
    """
    import pyarrow.flight as flight

    from dockrl.dock.errors import DockTimeoutError

    options = flight.FlightCallOptions(headers=[(b"authorization", f"Bearer {token}".encode())] if token else [], timeout=2.0)
    deadline = time.monotonic() + timeout_s
    waiting = list(locations)
    while True:
        for location in list(waiting):
            client = flight.connect(location)
            try:
                list(client.list_actions(options))
                waiting.remove(location)
            except (flight.FlightUnavailableError, flight.FlightTimedOutError):
                pass
            finally:
                client.close()
        if not waiting:
            return
        if time.monotonic() > deadline:
            raise DockTimeoutError(f"dock shards {waiting} did not answer within {timeout_s:.0f} s (--first-wait-s, else "
                                   "dock.timeout_s): their pods did not start, or the run was torn down")
        time.sleep(every_s)
