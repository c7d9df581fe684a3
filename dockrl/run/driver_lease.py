"""The driver's lease on the dock shards, over Arrow Flight: the pod-side tie of ``dockrl.process.lifeline``.

* ``DriverLease``: the driver side; a thread renews the lease on every shard (``driver_beat``).
* ``shard_lease_quiet``: the worker side's question to dock shard 0 (``driver_quiet``), which
  ``dockrl.process.lifeline.watch_driver`` asks every ``timeout/4`` seconds.
* ``wait_for_shards``: the readiness probe a driver or worker runs before its first call to the shards.

Apart from ``dockrl.process.lifeline`` because these need pyarrow, and the parent tie (rewards, local
workers) does not.
"""

from __future__ import annotations

import json
import threading
import time
from typing import Callable, Sequence

import pyarrow.flight as flight

from dockrl.dock.errors import DockTimeoutError
from dockrl.dock.tls import DockTLS, connect


def _flight_options(token: str | None, timeout: float):
    return flight.FlightCallOptions(headers=[(b"authorization", f"Bearer {token}".encode())] if token else [], timeout=timeout)


def wait_for_shards(locations: Sequence[str], token: str | None, timeout_s: float, *, check: Callable[[], None] | None = None,
                    tls: DockTLS | None = None) -> None:
    """Block until every dock shard answers; ``check()`` (a worker backend's: raises when a
    process died) runs between tries; ``tls``: the run's mutual TLS, client end (None: plain).

    A readiness probe (as a kubelet's): a shard listens only once its process has imported
    pyarrow, and gRPC offers no readiness event through pyarrow, so it asks every 0.1 s on a
    fresh connection (a failed channel would otherwise back off for seconds).

    Raises:
        DockTimeoutError: shards that did not answer within ``timeout_s`` (named).
        pyarrow.flight.FlightError: a shard answered with an error (a wrong token).
    """
    options, deadline = _flight_options(token, 2.0), time.monotonic() + timeout_s
    for location in locations:
        while True:
            if check is not None:
                check()
            client = connect(location, tls)
            try:
                list(client.list_actions(options))
                break
            except (flight.FlightUnavailableError, flight.FlightTimedOutError):
                if time.monotonic() > deadline:
                    raise DockTimeoutError(f"dock shard at {location} did not answer within {timeout_s:.0f} s: its process "
                                           "or pod did not start, or the run was torn down") from None
                time.sleep(0.1)
            finally:
                client.close()


def shard_lease_quiet(location: str, token: str | None, rpc_timeout_s: float = 5.0, tls: DockTLS | None = None) -> Callable[[], float]:
    """``lease_quiet`` for ``watch_driver``: asks the shard at ``location`` (``driver_quiet``)
    how many seconds ago the driver last renewed its lease. The returned function raises a
    Flight error when the shard does not answer."""
    client = connect(location, tls)
    options = _flight_options(token, rpc_timeout_s)

    def quiet() -> float:
        results = list(client.do_action(flight.Action("driver_quiet", b"{}"), options))
        return float(json.loads(results[0].body.to_pybytes())["quiet_s"])

    return quiet


class DriverLease:
    """The driver's lease on every dock shard: a thread sends ``driver_beat`` to each every
    ``timeout_s/4`` seconds (at most 5), to shards that do not answer yet too (they may still
    be starting). ``stop()`` ends it; the shards and workers then stop ``timeout_s`` later
    unless torn down first.

    Args:
        locations: ``grpc://host:port`` of every shard.
        token: the shards' bearer token (None without auth).
        timeout_s: ``run.driver_timeout_s``.
        tls: the run's mutual TLS, client end (None: plain connections).
    """

    def __init__(self, locations: Sequence[str], token: str | None, timeout_s: float, tls: DockTLS | None = None) -> None:
        self.period = min(timeout_s / 4, 5.0)
        self._clients = [connect(loc, tls) for loc in locations]
        self._options = _flight_options(token, min(self.period, 2.0))
        self._stop = threading.Event()
        self.beats = 0
        self._thread = threading.Thread(target=self._run, name="dockrl-driver-lease", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while True:
            for client in self._clients:
                try:
                    list(client.do_action(flight.Action("driver_beat", b"{}"), self._options))
                    self.beats += 1
                except flight.FlightError:  # starting, or gone: the driver's own checks report dead shards
                    pass
            if self._stop.wait(self.period):
                return

    def stop(self) -> None:
        """Stop renewing (the run is over); waits for the thread. Safe to call twice."""
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(timeout=10)
        for client in self._clients:
            client.close()
        self._clients = []
