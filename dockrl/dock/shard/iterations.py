"""The iterations open on one dock shard: a ``ShardController`` for each, their layouts, and their snapshots.

``ShardService`` (``dockrl.dock.shard.service``) holds one ``ShardIterations`` and answers the requests
with the controller of the iteration each names (``at``). Several iterations may be open at once
(``dock.max_inflight``); they open in order and are checked against the row mapping
(``ShardLayout``). A snapshot stores every open iteration's controller together with its layout:
the oldest at ``uri``, each further one at ``<uri>/open-<k>``, named in the stored ``more``.
"""

from __future__ import annotations

import threading
from typing import Any

from dockrl.dock.control import RunControl
from dockrl.dock.errors import DockError
from dockrl.dock.schema import Schema
from dockrl.dock.shard.controller import ShardController
from dockrl.dock.shard.iteration import IterationTable
from dockrl.dock.shard.layout import ShardLayout
from dockrl.dock.snapshot import join_uri


class ShardIterations:
    """The controllers and layouts of the iterations open on one shard.

    Args:
        schema: the column schema shared by every shard and front end.
        name: where the shard is, for messages (``grpc://host:port``, ``local://shard-0``).
        timeout_s: default claim timeout of each controller, seconds.
        lease_s: default lease term of each controller, seconds.
        control: the shard's control channel (its open and closed iterations follow these).

    ``docks`` and ``layouts`` are replaced, never changed, so that they may be read without the
    lock (a snapshot in progress holds it, and beats must not wait). Thread-safe.
    """

    def __init__(self, schema: Schema, *, name: str, timeout_s: float, lease_s: float, control: RunControl) -> None:
        self.schema, self.name, self.timeout_s, self.lease_s, self.control = schema, name, timeout_s, lease_s, control
        self.lock = threading.Lock()
        self.idle = ShardController(schema, timeout_s=timeout_s, lease_s=lease_s)  # never opened: answers "no iteration is open"
        self.docks: dict[int, ShardController] = {}  # of the open iterations this shard owns rows of
        self.layouts: dict[int, dict[str, int]] = {}  # of every open iteration, oldest first
        self.closed_stats: dict[str, float] = {}  # counters of the controllers of closed iterations
        self.closed = False

    def newest(self) -> ShardController:
        """The controller of the open iteration (of the newest when several are open; a never
        opened one, which refuses every call, when none is)."""
        docks = list(self.docks.values())
        return docks[-1] if docks else self.idle

    def at(self, iteration: int | None) -> ShardController:
        """The controller of ``iteration`` (None: the only open one).

        Raises:
            DockError: that iteration is not open on this shard while others are (with one or
                none open, that controller refuses it with its own message).
        """
        docks = self.docks
        found = docks.get(iteration) if iteration is not None else None
        if found is not None:
            return found
        if len(docks) <= 1:
            return next(iter(docks.values()), self.idle)
        open_now = sorted(docks)
        if iteration is None:
            raise DockError(f"iterations {open_now} are open on dock shard {self.name}: name the iteration")
        raise DockError(f"iteration {iteration} is not open; the open iterations are {open_now}")

    def stats(self) -> dict[str, float]:
        """The controllers' counters (``ShardController.stats``) over every iteration so far."""
        total = dict(self.closed_stats)
        for controller in [*list(self.docks.values()), self.idle]:
            for key, value in controller.stats().items():
                total[key] = total.get(key, 0) + value
        return total

    def close_all(self) -> None:
        """Fail blocked claims and waits, and every later one. Idempotent."""
        with self.lock:
            if self.closed:
                return
            self.closed = True
            docks, self.docks, self.layouts = list(self.docks.values()), {}, {}
        self.control.shutdown(f"dock shard at {self.name} is shutting down")
        for controller in docks:
            controller.close_iteration()

    def open(self, req: dict[str, Any]) -> None:
        """The ``open_iteration`` request (``dockrl.dock.shard.service``)."""
        req = dict(req)
        max_open = int(req.pop("max_open", 1))
        iteration, first, stop = req["iteration"], req["first_row"], req["stop_row"]
        with self.lock:
            if self.closed:
                raise DockError(f"open_iteration({iteration}): dock shard at {self.name} is shutting down")
            if iteration in self.layouts or len(self.layouts) >= max_open:
                open_now = list(self.layouts)
                raise DockError(
                    f"open_iteration({iteration}): iteration {open_now[0]} is still open" if len(open_now) == 1 else
                    f"open_iteration({iteration}): iterations {open_now} are still open (at most {max_open}: dock.max_inflight)"
                )
            if self.layouts and iteration < max(self.layouts):
                raise DockError(f"open_iteration({iteration}): iteration {max(self.layouts)} is open; iterations open in order")
            shard, num_shards = req["shard"], req["num_shards"]
            if not 0 <= shard < num_shards:
                raise DockError(f"open_iteration({iteration}): shard {shard} is not one of {num_shards} shards")
            expected = ShardLayout(iteration, req["num_rows"], req["group_size"], num_shards).shard_meta(shard)
            if req != expected:
                raise DockError(f"open_iteration({iteration}): shard layout {req} does not match the row mapping {expected}")
            if stop > first:  # a shard may own no group when there are fewer groups than shards
                controller = ShardController(self.schema, timeout_s=self.timeout_s, lease_s=self.lease_s)
                controller.open_iteration(iteration, stop - first, req["group_size"], first_row=first, total_rows=req["num_rows"])
                self.docks = {**self.docks, iteration: controller}  # replaced, not changed: read without the lock
            self.layouts = {**self.layouts, iteration: expected}

    def close(self, iteration: int | None = None) -> list[tuple[int, IterationTable]]:
        """The ``close_iteration`` request: close ``iteration`` (None: every open one). Returns the closed iterations'
        tables this shard held rows of, with its shard index (``ShardService`` keeps their rows: ``run.keep_rollouts``)."""
        closed: list[tuple[int, IterationTable]] = []
        with self.lock:
            closing = list(self.layouts) if iteration is None else [iteration] if iteration in self.layouts else []
            shard_of = {k: self.layouts[k]["shard"] for k in closing}
            self.layouts = {k: v for k, v in self.layouts.items() if k not in closing}
            docks = [(k, self.docks[k]) for k in closing if k in self.docks]
            self.docks = {k: v for k, v in self.docks.items() if k not in closing}
            for k, controller in docks:
                table = controller.close_iteration()
                if table is not None:
                    closed.append((shard_of[k], table))
                for key, value in controller.stats().items():
                    self.closed_stats[key] = self.closed_stats.get(key, 0) + value
            self.control.set_closed(iteration)
        return closed

    def announce(self, iteration: int) -> None:
        """The ``announce_iteration`` request (on shard 0): ``iteration`` must be open here."""
        with self.lock:
            if iteration not in self.layouts:
                open_now = list(self.layouts) or None
                raise DockError(f"announce({iteration}): iteration {open_now if open_now is None or len(open_now) > 1 else open_now[0]} "
                                f"is open on dock shard 0 at {self.name}")
            self.control.set_open(iteration)

    def described(self) -> list[dict[str, int]]:
        """The layouts of the open iterations, oldest first (copies)."""
        with self.lock:
            return [dict(v) for v in self.layouts.values()]

    @staticmethod
    def _snapshots(uri: str, layout: dict[str, int] | None, more: list[dict[str, int]]) -> list[tuple[dict[str, int] | None, str, dict]]:
        """Where each open iteration's controller is stored, and the ``extra`` stored with it: the
        oldest (or none) at ``uri``, naming the others (``more``), each of them at ``<uri>/open-<k>``."""
        first = (layout, uri, {"layout": layout} | ({"more": more} if more else {}))
        return [first, *((m, join_uri(uri, f"open-{m['iteration']}"), {"layout": m}) for m in more)]

    def snapshot(self, uri: str) -> None:
        """The ``snapshot`` request: write every open iteration's controller and layout under ``uri``."""
        with self.lock:  # no open/close while the layouts and the controllers are written together
            layouts = list(self.layouts.values())
            places = self._snapshots(uri, layouts[0] if layouts else None, layouts[1:])
            for layout, where, extra in reversed(places):  # the oldest's, naming the others, last
                controller = self.idle if layout is None else self.docks.get(layout["iteration"], self.idle)
                controller.snapshot(where, extra=extra)

    def restore(self, uri: str, layout: dict[str, int] | None, more: list[dict[str, int]]) -> None:
        """The ``restore`` request: load the snapshot at ``uri`` taken with ``layout`` and ``more`` (none open here)."""
        with self.lock:
            if self.closed:
                raise DockError(f"restore from {uri!r}: dock shard at {self.name} is shutting down")
            if self.layouts:
                raise DockError(f"restore from {uri!r}: iteration {next(iter(self.layouts))} is open on this shard; close it first")
            docks, layouts = {}, {}
            for lay, where, extra in self._snapshots(uri, layout, more):
                controller = ShardController(self.schema, timeout_s=self.timeout_s, lease_s=self.lease_s)
                controller.restore(where, extra=extra)
                if lay is not None:
                    layouts[lay["iteration"]] = lay
                    if lay["stop_row"] > lay["first_row"]:  # a shard that owns no group of it stores none
                        docks[lay["iteration"]] = controller
            self.docks, self.layouts = docks, layouts
