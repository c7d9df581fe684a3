"""The controller's claim / ack / release / expire state machine against a small reference model.

A hypothesis ``RuleBasedStateMachine`` drives one in-process ``ShardController`` through random
sequences of puts, claims (blocking with a zero timeout, and the non-blocking ``take``, also
under an existing lease id), acks (of whole claims, parts of them, rows never leased, stale
leases), releases, ``release_owner``, ``renew``, clock steps past lease expiries, and a
snapshot restored into a fresh dock. After every step the dock's consumed and acked bits, its
leases (id, owner, rows) and its counters must equal those of ``Model``, which is written from
the documented rules (``dockrl.dock.shard.leases``), not from the implementation:

* a claim takes the first ``count`` ready rows not consumed by the consumer (whole groups when
  asked), or fails when fewer than ``min(count, rows not taken)`` are ready; with nothing left
  to take it is empty, unless rows other owners hold (un-finished) may still come back;
* a lease ends by its ack (for good), by its expiry, by ``release_owner`` or by a restore; an
  un-acked end returns the rows to the pool except finished ones (every output of the consumer
  written), which count as acked; a whole-group lease returns a partly finished group whole;
* an ack is accepted for rows held under the lease, acked under it before, or handed back by
  its end and not taken since; anything else raises and names the rows.

The clock is ``FakeClock`` (the dock module's ``time`` replaced for the example's duration), so
expiries are exact and nothing sleeps. 50 examples by default (a few seconds); set
``DOCKRL_LEASE_MACHINE_EXAMPLES`` to search longer (600 take ~4 minutes on 2 busy cores).
"""

from __future__ import annotations

import logging
import os
import tempfile
from dataclasses import dataclass, field

import lease_helpers as lh
import numpy as np
import pytest
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import Bundle, RuleBasedStateMachine, initialize, invariant, multiple, rule

import dockrl.dock.shard.controller as controller
import dockrl.dock.shard.controller_core as controller_core
import dockrl.dock.shard.leases as leases
from dockrl.dock import GRPO_SCHEMA, DockError, DockTimeoutError
from dockrl.dock.shard.controller import ShardController

OWNERS = ("a", "b", "c")
INPUTS = {"reward": ["prompt_ids"], "advantage": ["rm_score"]}
OUTPUTS = {c: tuple(col.name for col in GRPO_SCHEMA.columns if col.producer == c) for c in INPUTS}  # the schema's producers
CELLS = {
    "prompt_ids": lambda r: [r, r + 100][: 1 + r % 2],
    "rm_score": lambda r: float(r) / 2,
    "correct": lambda r: r % 2 == 0,
    "advantages": lambda r: [float(r) - 0.5] * (1 + r % 2),
    "returns": lambda r: [float(r) + 0.5] * (1 + r % 2),
}
assert {c for outs in OUTPUTS.values() for c in outs} <= set(CELLS), "a cell maker per output column of the schema"
TERMS = (1.0, 2.5)


class FakeClock:
    """Stands in for the ``time`` module inside ``dockrl.dock.shard.controller`` and ``dockrl.dock.shard.controller_core`` (they hand
    the time to ``dockrl.dock.shard.leases``): ``monotonic()`` moves only when told."""

    def __init__(self) -> None:
        self.now = 1000.0

    def monotonic(self) -> float:
        return self.now


@dataclass
class ModelLease:
    owner: str
    consumer: str
    term: float
    expiry: float
    whole: bool
    rows: set[int] = field(default_factory=set)


@dataclass
class Model:
    """The documented semantics of one consumer table, on plain sets and dicts."""

    num_rows: int
    g: int
    written: dict[str, set[int]] = field(default_factory=lambda: {c: set() for c in CELLS})
    consumed: dict[str, set[int]] = field(default_factory=lambda: {c: set() for c in INPUTS})  # leased or acked
    acked: dict[str, set[int]] = field(default_factory=lambda: {c: set() for c in INPUTS})
    acked_by: dict[tuple[str, int], str] = field(default_factory=dict)
    leases: dict[str, ModelLease] = field(default_factory=dict)
    ended: dict[str, tuple[str, set[int]]] = field(default_factory=dict)
    rows_returned: int = 0
    leases_expired: int = 0

    def finished(self, consumer: str, r: int) -> bool:
        return all(r in self.written[c] for c in OUTPUTS[consumer])

    def done_rows(self, lease: ModelLease) -> set[int]:
        done = {r for r in lease.rows if self.finished(lease.consumer, r)}
        if lease.whole:  # a group with an unfinished row goes back whole
            done = {r for r in done if all(k in done or k not in lease.rows for k in self.group(r))}
        return done

    def group(self, r: int) -> range:
        return range(r - r % self.g, r - r % self.g + self.g)

    def end(self, ids: list[str]) -> int:
        returned = 0
        for lid in ids:
            lease = self.leases.pop(lid)
            done = self.done_rows(lease)
            before = self.ended.get(lid, (lease.consumer, set()))[1]  # an id that ended before and was taken up again
            self.ended[lid] = (lease.consumer, before | lease.rows)
            for r in lease.rows:
                if r in done:
                    self.acked[lease.consumer].add(r)
                    self.acked_by[lease.consumer, r] = lid
                else:
                    self.consumed[lease.consumer].discard(r)
                    returned += 1
        self.rows_returned += returned
        return returned

    def expire(self, now: float) -> None:
        ids = [lid for lid, lease in self.leases.items() if lease.expiry <= now]
        self.leases_expired += len(ids)
        self.end(ids)

    def holder(self, consumer: str, r: int) -> str | None:
        return next((lid for lid, lease in self.leases.items() if lease.consumer == consumer and r in lease.rows), None)

    def detach(self, consumer: str, rows: set[int]) -> None:
        for lid in [lid for lid, lease in self.leases.items() if lease.consumer == consumer]:
            self.leases[lid].rows -= rows
            if not self.leases[lid].rows:
                del self.leases[lid]

    def held(self, consumer: str, owner: str) -> int:
        return sum(len(lease.rows - self.done_rows(lease)) for lease in self.leases.values()
                   if lease.consumer == consumer and lease.owner != owner)

    def take(self, consumer: str, count: int, whole: bool, at_least: int, owner: str, lid: str, term: float,
             now: float) -> tuple[list[int], int, int] | None:
        """Rows taken, pending after, held; None where the dock must time out."""
        self.expire(now)
        pending = [r for r in range(self.num_rows) if r not in self.consumed[consumer]]
        held = self.held(consumer, owner)
        ready = {r for r in pending if all(r in self.written[c] for c in INPUTS[consumer])}
        if whole:
            ready = {r for r in ready if all(k in ready for k in self.group(r))}
        candidates = sorted(ready)
        if not pending:
            if held and at_least > 0:
                return None  # rows other owners hold may come back: wait for them
        elif len(candidates) < min(at_least, len(pending)):
            return None
        rows = candidates[:count]
        if rows:
            lease = self.leases.setdefault(lid, ModelLease(owner, consumer, term, 0.0, False))
            lease.whole |= whole
            lease.rows |= set(rows)
            lease.expiry = now + term
            self.consumed[consumer] |= set(rows)
        return rows, len(pending) - len(rows), held

    def ack(self, consumer: str, lid: str, rows: list[int], now: float) -> list[int]:
        """Apply an ack; return the refused rows."""
        self.expire(now)
        ended_consumer, ended_rows = self.ended.get(lid, (consumer, set()))
        ended_rows = ended_rows if ended_consumer == consumer else set()
        ok, bad = set(), []
        for r in rows:
            held = self.holder(consumer, r) == lid
            before = self.acked_by.get((consumer, r)) == lid
            late = r in ended_rows and r not in self.consumed[consumer]
            (ok.add(r) if held or before or late else bad.append(r))
        self.detach(consumer, {r for r in ok if self.holder(consumer, r) == lid})
        for r in ok:
            self.consumed[consumer].add(r)
            self.acked[consumer].add(r)
            self.acked_by[consumer, r] = lid
        return bad

    def restored(self) -> Model:
        """The model of a fresh dock that loaded this one's snapshot: every lease ended there."""
        new = Model(self.num_rows, self.g, written={c: set(v) for c, v in self.written.items()})
        for consumer in INPUTS:
            new.acked[consumer] = set(self.acked[consumer])
        for lease in self.leases.values():
            new.acked[lease.consumer] |= self.done_rows(lease)
        for consumer in INPUTS:
            new.consumed[consumer] = set(new.acked[consumer])
            new.rows_returned += len(self.consumed[consumer] - new.acked[consumer])
        return new


class LeaseMachine(RuleBasedStateMachine):
    claims = Bundle("claims")

    def __init__(self) -> None:
        super().__init__()
        self.clock = FakeClock()
        self._real_time = controller.time
        controller.time = controller_core.time = self.clock
        self.dock: ShardController | None = None
        self.model: Model | None = None
        self.tmp = tempfile.TemporaryDirectory(prefix="lease-machine-")
        self._log = logging.getLogger(leases.__name__)
        self._log_level = self._log.level
        self._log.setLevel(logging.ERROR)  # a warning per ended lease: thousands per run
        self.snapshots = 0

    def teardown(self) -> None:
        controller.time = controller_core.time = self._real_time
        self._log.setLevel(self._log_level)
        self.tmp.cleanup()

    @initialize(g=st.integers(1, 3), groups=st.integers(1, 4))
    def open(self, g: int, groups: int) -> None:
        self.dock = ShardController(GRPO_SCHEMA, timeout_s=0.0, lease_s=TERMS[0])
        self.dock.open_iteration(0, g * groups, g)
        self.model = Model(g * groups, g)

    # --- writes ------------------------------------------------------------------------------
    @rule(column=st.sampled_from(sorted(CELLS)), data=st.data())
    def put(self, column: str, data: st.DataObject) -> None:
        rows = data.draw(st.lists(st.integers(0, self.model.num_rows - 1), min_size=1, max_size=4, unique=True), label="rows")
        values = {column: [CELLS[column](r) for r in rows]}
        if set(rows) & self.model.written[column]:
            with pytest.raises(DockError, match="already written"):
                self.dock.put(rows, values)
        else:
            self.dock.put(rows, values)
            self.model.written[column] |= set(rows)

    # --- claims ------------------------------------------------------------------------------
    @rule(target=claims, consumer=st.sampled_from(sorted(INPUTS)), owner=st.sampled_from(OWNERS),
          units=st.integers(1, 4), whole=st.booleans(), term=st.sampled_from(TERMS))
    def claim(self, consumer: str, owner: str, units: int, whole: bool, term: float):
        count = units * (self.model.g if whole else 1)
        expected = self.model.take(consumer, count, whole, count, owner, "?", term, self.clock.now)
        if expected is None:
            with pytest.raises(DockTimeoutError, match=f"claim by '{consumer}' timed out"):
                lh.claim(self.dock, consumer, INPUTS[consumer], count, whole_groups=whole, owner=owner, lease_s=term)
            return multiple()
        claim = lh.claim(self.dock, consumer, INPUTS[consumer], count, whole_groups=whole, owner=owner, lease_s=term)
        assert claim.rows == expected[0]
        for column in INPUTS[consumer]:
            assert claim.batch.column(column).to_pylist() == [CELLS[column](r) for r in claim.rows]
        if not claim.rows:
            assert claim.lease == ""
            return multiple()
        self.model.leases[claim.lease] = self.model.leases.pop("?")  # the id the dock chose
        return (consumer, owner, claim.lease, tuple(claim.rows))

    @rule(target=claims, consumer=st.sampled_from(sorted(INPUTS)), owner=st.sampled_from(OWNERS),
          count=st.integers(1, 6), term=st.sampled_from(TERMS))
    def take_ready(self, consumer: str, owner: str, count: int, term: float):
        """The non-blocking half of a sharded claim's sweep (``at_least=0``)."""
        expected = self.model.take(consumer, count, False, 0, owner, "?", term, self.clock.now)
        taken = self.dock.take(consumer, INPUTS[consumer], count, at_least=0, owner=owner, lease_s=term)
        assert (taken.rows, taken.pending, taken.held) == expected
        if not taken.rows:
            return multiple()
        self.model.leases[taken.lease] = self.model.leases.pop("?")
        return (consumer, owner, taken.lease, tuple(taken.rows))

    @rule(target=claims, known=claims, same_owner=st.booleans(), count=st.integers(1, 4))
    def take_under_existing_lease(self, known, same_owner: bool, count: int):
        """A sharded claim adds rows to its lease sweep after sweep; another owner may not."""
        consumer, owner, lid, rows = known
        lease = self.model.leases.get(lid)
        owner = owner if lease is None else lease.owner  # an ended id may have been taken up by another owner since
        if not same_owner:
            other = OWNERS[(OWNERS.index(owner) + 1) % len(OWNERS)]
            if lease is not None:
                with pytest.raises(DockError, match=f"lease '{lid}' belongs to owner '{owner}'"):
                    self.dock.take(consumer, INPUTS[consumer], count, at_least=0, owner=other, lease=lid)
                return multiple()
            owner = other  # an ended lease id is free again: it starts a new lease of this owner
        term = TERMS[0]
        expected = self.model.take(consumer, count, False, 0, owner, lid, term, self.clock.now)
        taken = self.dock.take(consumer, INPUTS[consumer], count, at_least=0, owner=owner, lease=lid, lease_s=term)
        assert (taken.rows, taken.pending, taken.held, taken.lease) == (*expected, lid)
        return (consumer, owner, lid, tuple(sorted(set(rows) | set(taken.rows))))

    # --- ends of leases ----------------------------------------------------------------------
    @rule(known=claims, part=st.sampled_from(["all", "some", "foreign"]), data=st.data())
    def ack(self, known, part: str, data: st.DataObject) -> None:
        consumer, _, lid, rows = known
        if part == "some":
            rows = data.draw(st.lists(st.sampled_from(rows), min_size=1, unique=True), label="acked part")
        elif part == "foreign":
            rows = data.draw(st.lists(st.integers(0, self.model.num_rows - 1), min_size=1, max_size=3, unique=True),
                             label="rows")
        bad = self.model.ack(consumer, lid, list(rows), self.clock.now)
        if bad:
            with pytest.raises(DockError, match=f"ack by '{consumer}'") as info:
                self.dock.ack_rows(consumer, lid, list(rows))
            named = {int(x) for x in str(info.value).replace("[", " ").replace("]", " ").replace(",", " ").split() if x.isdigit()}
            assert set(sorted(bad)[:10]) <= named, f"{info.value} does not name the refused rows {bad}"
        else:
            self.dock.ack_rows(consumer, lid, list(rows))

    @rule(consumer=st.sampled_from(sorted(INPUTS)), data=st.data())
    def release(self, consumer: str, data: st.DataObject) -> None:
        """The undo of a claim that failed midway: only rows taken and not acked."""
        rows = data.draw(st.lists(st.integers(0, self.model.num_rows - 1), min_size=1, max_size=3, unique=True), label="rows")
        self.model.expire(self.clock.now)  # no expiry runs in release: keep the model in step by expiring first
        self.dock.renew("nobody")  # ... and the dock too (renew expires, and renews no lease of 'nobody')
        taken = self.model.consumed[consumer] - self.model.acked[consumer]
        if not set(rows) <= taken:
            with pytest.raises(DockError, match=f"release by '{consumer}'"):
                self.dock.release(consumer, rows)
            return
        self.dock.release(consumer, rows)
        self.model.detach(consumer, set(rows))
        self.model.consumed[consumer] -= set(rows)

    @rule(owner=st.sampled_from(OWNERS))
    def release_owner(self, owner: str) -> None:
        ids = [lid for lid, lease in self.model.leases.items() if lease.owner == owner]
        assert self.dock.release_owner(owner) == self.model.end(ids)

    @rule(owner=st.sampled_from(OWNERS))
    def renew(self, owner: str) -> None:
        self.model.expire(self.clock.now)
        mine = [lease for lease in self.model.leases.values() if lease.owner == owner]
        for lease in mine:
            lease.expiry = self.clock.now + lease.term
        assert self.dock.renew(owner) == len(mine)

    @rule(dt=st.sampled_from([0.4, 1.0, 2.6]))
    def tick(self, dt: float) -> None:
        self.clock.now += dt  # expiries are applied by the next call that looks at leases

    @rule()
    def snapshot_and_restore(self) -> None:
        """A checkpoint taken now and loaded into a fresh dock: leases end, finished rows count as acked."""
        self.snapshots += 1
        uri = f"{self.tmp.name}/snap-{self.snapshots}"
        self.model.expire(self.clock.now)
        self.dock.snapshot(uri)
        fresh = ShardController(GRPO_SCHEMA, timeout_s=0.0, lease_s=TERMS[0])
        fresh.restore(uri)
        self.dock, self.model = fresh, self.model.restored()

    # --- the comparison ----------------------------------------------------------------------
    @invariant()
    def dock_equals_model(self) -> None:
        if self.dock is None:
            return
        it = self.dock._it
        for consumer in INPUTS:
            ci = it.consumer_index[consumer]
            assert set(np.flatnonzero(it.consumed[:, ci]).tolist()) == self.model.consumed[consumer], consumer
            assert set(np.flatnonzero(it.acked[:, ci]).tolist()) == self.model.acked[consumer], consumer
        leases = {lid: (lease.owner, self.dock.schema.consumers[lease.consumer], set(lease.rows)) for lid, lease in it.leases.items()}
        assert leases == {lid: (m.owner, m.consumer, m.rows) for lid, m in self.model.leases.items()}
        # the controller's incremental state (available rows per view, rows held per owner) equals a recount
        for (ci, cols, unit), view in it.views.items():
            full = it.ready[:, list(cols)].all(axis=1)
            ok = (full & ~it.consumed[:, ci]).reshape(-1, unit).all(axis=1)
            assert view.navail == int(ok.sum()) and (view.avail == ok).all() and not ok[: view.lo].any(), (ci, cols, unit)
        for consumer in INPUTS:
            for owner in OWNERS:
                assert it.held(it.consumer_index[consumer], owner) == self.model.held(consumer, owner), (consumer, owner)
        stats = self.dock.stats()
        assert (stats["dock/rows_returned"], stats["dock/leases_expired"]) == (self.model.rows_returned, self.model.leases_expired)
        # expiries not yet applied must not change what the dock says is missing either
        for consumer, columns in INPUTS.items():
            lacking = sum(1 for r in range(self.model.num_rows)
                          if r not in self.model.consumed[consumer] and r not in self.model.written[columns[0]])
            assert self.dock.missing(consumer, columns) == ({columns[0]: lacking} if lacking else {})


LeaseMachine.TestCase.settings = settings(
    max_examples=int(os.environ.get("DOCKRL_LEASE_MACHINE_EXAMPLES", "50")), stateful_step_count=40,
    deadline=None, suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much],
)
test_lease_state_machine = LeaseMachine.TestCase
