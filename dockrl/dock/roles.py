"""Who may do what on a dock shard: the driver's token and one token per stage process.

A distributed run has a bearer token for the driver, which only the driver's process holds, and
one for each stage process (``dockrl.launch.distributed``: the rollout's, the reward's, ...; each
process holds its own only). ``ShardAccess`` maps the token a call presents to its role, the
driver or a stage, and says what that role may do:

* the driver: everything.
* a stage (``StageRights``, from its rows of the stage table, ``dockrl.stages.table``): claim,
  ack and release as its own consumers only, claim and read the columns it consumes (and those it
  writes), put the columns it produces, and the calls every token may make (describe, stats,
  leases, reports, waits); never an action of ``DRIVER_ACTIONS`` (open, close and finish the
  run's iterations, ``drop`` rows, ``snapshot``/``restore``, the driver's lease). A rollout, which
  may run model-written code, can thus not write rewards or advantages, nor read them; the stage
  that ends dynamic sampling's rounds (``StageRights.drop``) may ``drop`` rows and write the gate.

``snapshot`` and ``restore`` take a ``uri``; a shard given ``snapshot_places`` refuses any other
than a folder under one of them (a local path, or ``s3://bucket/key`` with the same query as the
place: the same endpoint), whoever asks.
"""

from __future__ import annotations

import hmac
import json
import posixpath
from dataclasses import dataclass
from typing import Any, Iterable
from urllib.parse import urlsplit

from dockrl.dock.schema import Schema

DRIVER = "driver"
"""The role of the driver's token (a stage's role is its name)."""
DRIVER_ACTIONS = frozenset({
    "open_iteration", "close_iteration", "flush_rollouts", "announce_iteration", "finish", "drop", "snapshot", "restore",
    "driver_beat",
})
"""Actions a stage's token may not call (the driver's own); ``drop`` is allowed to a stage with ``StageRights.drop``."""
_CONSUMER_ACTIONS = frozenset({"claim", "release", "ack", "missing"})
_READ_ACTIONS = frozenset({"claim", "missing", "locate"})


class AccessDenied(PermissionError):
    """A call its token's role may not make, or a snapshot outside the run's places (the shard
    answers it as Flight's ``FlightUnauthorizedError``)."""


@dataclass(frozen=True, kw_only=True)
class StageRights:
    """What the token of one stage process may do on a shard beyond the calls every token may make."""

    stage: str
    """The stage process (``dockrl worker --stage``): the role's name in errors."""
    consumers: frozenset[str]
    """Consumers it may claim, ack and release as (the schema's ``consumers``)."""
    reads: frozenset[str]
    """Columns it may claim and read."""
    writes: frozenset[str]
    """Columns it may put."""
    drop: bool = False
    """It may ``drop`` rows (dynamic sampling's advantage stage, which ends each round)."""

    def to_arg(self, token_env: str) -> str:
        """The shard's ``--stage-rights`` value: these rights and the environment variable holding the token (JSON)."""
        return json.dumps({"stage": self.stage, "token_env": token_env, "consumers": sorted(self.consumers),
                           "reads": sorted(self.reads), "writes": sorted(self.writes), "drop": self.drop})

    @classmethod
    def from_arg(cls, text: str) -> tuple[str, StageRights]:
        """(token environment variable, rights) of a ``--stage-rights`` value (``to_arg``).

        Raises:
            ValueError: not such a JSON object (the message names the field).
        """
        try:
            data = json.loads(text)
        except json.JSONDecodeError as e:
            raise ValueError(f"--stage-rights {text!r}: not JSON ({e})") from None
        fields = {"stage": str, "token_env": str, "consumers": list, "reads": list, "writes": list, "drop": bool}
        if not isinstance(data, dict) or set(data) != set(fields):
            raise ValueError(f"--stage-rights {text!r}: expected a JSON object with exactly the fields {sorted(fields)}")
        for name, kind in fields.items():
            if not isinstance(data[name], kind) or (kind is list and not all(isinstance(c, str) for c in data[name])):
                raise ValueError(f"--stage-rights {text!r}: field {name!r} must be a {'list of strings' if kind is list else kind.__name__}")
        return data["token_env"], cls(stage=data["stage"], consumers=frozenset(data["consumers"]), reads=frozenset(data["reads"]),
                                      writes=frozenset(data["writes"]), drop=data["drop"])


@dataclass(frozen=True)
class ShardAccess:
    """The tokens of a shard and what each role may do (see the module docstring).

    Args:
        driver_token: the driver's bearer token (every right).
        schema: the shard's column schema: the stages' rights must name its columns and consumers.
        stages: (token, rights) of each stage process; empty: there is one token, the driver's.
        snapshot_places: folders or ``s3://`` prefixes snapshots may go to; empty: anywhere.

    Raises:
        ValueError: two stages of one name, a stage called ``driver``, or rights naming a column
            or consumer the schema lacks.
    """

    driver_token: str
    schema: Schema
    stages: tuple[tuple[str, StageRights], ...] = ()
    snapshot_places: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        names = [rights.stage for _, rights in self.stages]
        if len(set(names)) != len(names) or DRIVER in names:
            raise ValueError(f"dock shard: stage rights for {names}; expected distinct stage names other than {DRIVER!r}")
        columns = {c.name for c in self.schema.columns}
        for _, rights in self.stages:
            unknown = sorted((rights.reads | rights.writes) - columns) + sorted(rights.consumers - set(self.schema.consumers))
            if unknown:
                raise ValueError(f"dock shard: the rights of stage {rights.stage!r} name {unknown}, which schema "
                                 f"v{self.schema.version} has neither as a column nor as a consumer")

    def role(self, authorization: str) -> str | None:
        """The role of an ``authorization`` header's value (``Bearer <token>``): ``DRIVER``, a stage's
        name, or None for no known token."""
        given = authorization.encode()
        # every token compared every time, in constant time: the answer's timing says nothing of any of them
        found = DRIVER if hmac.compare_digest(given, f"Bearer {self.driver_token}".encode()) else None
        for token, rights in self.stages:
            if hmac.compare_digest(given, f"Bearer {token}".encode()) and found is None:
                found = rights.stage
        return found

    def check_action(self, role: str, action: str, body: dict[str, Any]) -> None:
        """Raises ``AccessDenied`` unless ``role`` may call ``action`` with ``body`` (a snapshot's place for every role)."""
        if action in ("snapshot", "restore"):
            self.check_place(str(body.get("uri", "")))
        if role == DRIVER:
            return
        if action in DRIVER_ACTIONS and not (action == "drop" and self._rights(role).drop):
            raise AccessDenied(f"dock shard: {action!r} is the driver's; a stage's token may not call it")
        ack = body.get("ack") if action == "commit" else None  # a commit may carry the ack of its claim
        consumer = body.get("consumer") if action in _CONSUMER_ACTIONS else ack.get("consumer") if isinstance(ack, dict) else None
        self.check(role, consumer=consumer, reads=body.get("columns", ()) if action in _READ_ACTIONS else (),
                   writes=body.get("objects", {}) if action == "commit" else ())

    def check(self, role: str, *, consumer: str | None = None, reads: Iterable[str] = (), writes: Iterable[str] = ()) -> None:
        """Raises ``AccessDenied`` unless ``role`` may act as ``consumer`` (None: no consumer), read the
        columns ``reads`` and put the columns ``writes``."""
        if role == DRIVER:
            return
        rights = self._rights(role)
        if consumer is not None and consumer not in rights.consumers:
            raise AccessDenied(f"dock shard: the {role} stage's token may not act as consumer {consumer!r}; "
                               f"its own: {sorted(rights.consumers)}")
        if bad := sorted(set(reads) - rights.reads):
            raise AccessDenied(f"dock shard: the {role} stage's token may not read columns {bad}; it consumes {sorted(rights.reads)}")
        if bad := sorted(set(writes) - rights.writes):
            raise AccessDenied(f"dock shard: the {role} stage's token may not put columns {bad}; it produces {sorted(rights.writes)}")

    def check_place(self, uri: str) -> None:
        """Raises ``AccessDenied`` unless ``uri`` lies under one of ``snapshot_places``."""
        if self.snapshot_places and not any(_under(uri, place) for place in self.snapshot_places):
            raise AccessDenied(f"dock shard: snapshot uri {uri!r} is outside the run's places {list(self.snapshot_places)}")

    def _rights(self, role: str) -> StageRights:
        return next(rights for _, rights in self.stages if rights.stage == role)


def _under(uri: str, place: str) -> bool:
    """``uri`` is ``place`` or below it: same scheme, bucket and query; a path under the place's, no ``..``."""
    a, b = urlsplit(uri), urlsplit(place)
    if (a.scheme, a.netloc, a.query) != (b.scheme, b.netloc, b.query) or ".." in a.path.split("/"):
        return False
    path, root = posixpath.normpath(a.path or "/"), posixpath.normpath(b.path or "/")
    return path == root or path.startswith(root.rstrip("/") + "/")
