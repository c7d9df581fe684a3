"""The lease heartbeat of one dock client: renew its owner's leases while it holds any.

While a ``DockClient`` holds un-acked claims, or rows a claim in progress took on one shard while
it waits on another, a daemon thread renews all leases of its owner on every shard each
``lease_s/3`` seconds (all shards at once, at a fixed rate: a shard slow to answer delays no
other), so a live but slow worker never loses rows; when its process dies the renewals stop
and the rows return to the pool ``lease_s`` later (``dockrl.dock.shard.leases``), or at once when the
launcher calls ``release_owner``.
"""

from __future__ import annotations

import logging
import threading
import time
from concurrent.futures import Future
from typing import Any, Callable

logger = logging.getLogger(__name__)


class LeaseHeartbeat:
    """The leases one owner holds, renewed from a daemon thread started by the first ``hold``.

    Args:
        owner: the lease owner id (for the thread's name and the log).
        lease_s: the lease term, seconds; a beat every ``lease_s/3``.
        num_shards: the shards to renew on.
        renew: ``renew(s)`` sends ``renew`` of this owner to shard ``s`` and returns its answer
            (``{"leases": n, "iteration": the oldest open one or None}``).

    Thread-safe.
    """

    def __init__(self, owner: str, lease_s: float, num_shards: int, renew: Callable[[int], dict[str, Any]]) -> None:
        self.owner, self.lease_s, self.num_shards, self._renew = owner, lease_s, num_shards, renew
        self._beat = threading.Condition()
        self.held: dict[str, int] = {}  # un-acked lease id → its iteration
        self.thread: threading.Thread | None = None
        self._closed = False

    def hold(self, lease: str, iteration: int) -> None:
        """Track an un-acked lease; start the heartbeat thread on the first."""
        with self._beat:
            if self._closed:
                return
            self.held[lease] = iteration
            if self.thread is None:  # it beats at a fixed rate: a hold never wakes it (a thread switch per claim)
                self.thread = threading.Thread(target=self._run, name=f"dock-lease-{self.owner}", daemon=True)
                self.thread.start()

    def drop(self, *leases: str) -> None:
        """Stop renewing ``leases`` (acked, handed back, or gone with their iteration)."""
        with self._beat:
            for lease in leases:
                self.held.pop(lease, None)

    def close(self, timeout_s: float) -> None:
        """Stop renewing and wait up to ``timeout_s`` for the thread to end."""
        with self._beat:
            self._closed = True
            self._beat.notify_all()
            thread = self.thread
        if thread is not None:
            thread.join(timeout_s)

    def _run(self) -> None:
        """Renew this owner's leases every ``lease_s/3`` while it holds any (a beat with none held sends nothing).

        Each beat sends ``renew`` to every shard at once, on a fixed rate, without waiting for the
        answers: a shard slow to answer (a loaded machine) delays neither the other shards'
        renewals nor the next beat (that shard gets its next renewal once it answered).
        """
        period = self.lease_s / 3
        in_flight: dict[int, Future] = {}
        next_beat = time.monotonic() + period  # a lease taken now is renewed within a period, well inside its term
        while True:
            with self._beat:
                while not self._closed and (left := next_beat - time.monotonic()) > 0:
                    self._beat.wait(left)  # close() wakes it early
                if self._closed:
                    return
                next_beat = max(next_beat + period, time.monotonic())  # before the skip: an idle beat waits a period too
                if not self.held:
                    continue
            for s in [s for s, f in in_flight.items() if f.done()]:
                self._renewed(s, in_flight.pop(s))
            for s in range(self.num_shards):
                if s not in in_flight:
                    in_flight[s] = self._send(s)

    def _send(self, s: int) -> Future:
        """``renew`` on shard ``s`` from a daemon thread (a call in flight never holds up the process's exit)."""
        beat: Future = Future()

        def send() -> None:
            try:
                beat.set_result(self._renew(s))
            except BaseException as e:  # noqa: BLE001 - handed to the heartbeat
                beat.set_exception(e)

        threading.Thread(target=send, name=f"dock-lease-renew-{s}", daemon=True).start()
        return beat

    def _renewed(self, s: int, beat: Future) -> None:
        """The answer of one shard to a heartbeat ``renew``."""
        try:
            iteration = beat.result()["iteration"]
        except Exception as e:  # noqa: BLE001 - a missed beat is retried; expiry is what protects the rows
            logger.warning("dock lease heartbeat of %s to shard %d failed: %s", self.owner, s, e)
            return
        if s == 0 and iteration is not None:
            # claims of an iteration older than the open one will never be acked: stop renewing for them.
            # Older only: this answer may have waited a beat, and claims of a newer iteration must stay.
            with self._beat:
                for lease in [k for k, it in self.held.items() if it < iteration]:
                    del self.held[lease]
