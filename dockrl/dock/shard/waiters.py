"""The blocked takes of one shard controller and their wake-ups.

Waiting is event-driven, never a sleep-poll loop: a blocked take waits on a condition of its
own (sharing the controller's lock), woken only when it can proceed (``Waiters.wake``), oldest
first and no more takes than the rows allow. A take that was woken but took nothing hands the
wake-up on.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass
from typing import Sequence

from dockrl.dock.errors import DockTimeoutError
from dockrl.dock.shard.iteration import IterationTable
from dockrl.dock.shard.records import ReadyView


@dataclass(eq=False)
class Waiter:
    """A take blocked for consumer ``ci``: woken (``cond.notify``) only when it can proceed."""

    ci: int
    view: ReadyView
    count: int
    at_least: int
    wait_held: bool
    owner: str
    cond: threading.Condition
    notified: bool = False


def can_take(num_pending: int, held: int, available: int, at_least: int, wait_held: bool) -> bool:
    """Whether a take proceeds now: enough rows available, or none left to wait for.

    A take of no rows with none pending means every row of the consumer is acked, finished
    (outputs written), or leased by the claiming owner itself; while rows are leased by another
    owner and not finished (``held``), a take with nothing to take blocks: they may come back.
    """
    if num_pending == 0:  # done, unless rows other owners hold may come back
        return not (held > 0 and at_least > 0 and wait_held)
    want = min(at_least, num_pending)
    return available >= want and (want > 0 or at_least == 0)


def timeout_error(
    what: str, timeout: float, it: IterationTable, ci: int, columns: Sequence[str], wanted: int, ready: int, held: int,
) -> DockTimeoutError:
    """The error of a take of consumer ``ci`` that waited ``timeout`` seconds for ``wanted`` rows
    ready in ``columns`` (``ready`` were): it names the columns still missing, how many rows lack
    each, and the rows other owners hold."""
    held_note = (
        f"; {held} rows are leased by other owners and not yet acked (they come back if their leases "
        "expire or are released)" if held else ""
    )
    return DockTimeoutError(
        f"{what} timed out after {timeout:.1f}s in iteration {it.iteration}: "
        f"wanted {wanted} rows ready in {list(columns)}, {ready} ready; "
        f"columns still missing (rows lacking): {it.missing(ci, columns)}{held_note}"
    )


class Waiters:
    """The blocked takes by consumer, oldest first; every method is called with ``lock`` held."""

    def __init__(self, lock: threading.RLock) -> None:
        self._lock = lock
        self._by_ci: dict[int, list[Waiter]] = {}

    def add(self, ci: int, view: ReadyView, count: int, at_least: int, wait_held: bool, owner: str) -> Waiter:
        """A new blocked take of consumer ``ci``, last in line."""
        waiter = Waiter(ci, view, count, at_least, wait_held, owner, threading.Condition(self._lock))
        self._by_ci.setdefault(ci, []).append(waiter)
        return waiter

    def forget(self, waiter: Waiter | None) -> None:
        """Take ``waiter`` out of line (it took, gave up, or waits for another consumer now)."""
        if waiter is not None:
            waiters = self._by_ci.get(waiter.ci, [])
            if waiter in waiters:
                waiters.remove(waiter)

    def wake(self, it: IterationTable, ci: int) -> None:
        """Wake the blocked takes of consumer ``ci`` that can proceed now, oldest first, no more than the rows allow."""
        waiters = self._by_ci.get(ci)
        if not waiters:
            return
        budget: dict[int, int] = {}  # rows of each view not yet promised to a woken waiter
        for w in waiters:
            if w.notified:
                continue
            unit = w.view.unit
            available = budget.get(id(w.view), w.view.navail * unit)
            if can_take(it.npending[ci], it.held(ci, w.owner), available, w.at_least, w.wait_held):
                w.notified = True
                budget[id(w.view)] = available - min(available, w.count)
                w.cond.notify()

    def wake_all(self) -> None:
        """Wake every blocked take (the open iteration changed): each re-checks."""
        for waiters in self._by_ci.values():
            for w in waiters:
                w.notified = True
                w.cond.notify()
