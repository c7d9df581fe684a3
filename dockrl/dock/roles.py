"""Who may do what on a dock shard: the driver's token and the stages' token.

A distributed run has two bearer tokens (``dockrl.launch.distributed``): the driver's, which only
the driver's process holds, and the stages', which every stage process holds (the rollout among
them, which may run model-written code). ``ShardAccess`` maps the token a call presents to its
``Role`` and says what that role may do:

* ``driver``: everything.
* ``stage``: claim, read, put and commit the stages' columns, leases, reports and waits; never
  an action of ``DRIVER_ACTIONS`` (open, close and finish the run's iterations, ``drop`` rows,
  ``snapshot``/``restore``, the driver's lease) nor a put of a column the driver produces
  (``Column.producer == "driver"``: prompts, ground truth). With dynamic sampling
  (``stages_sample``) the advantage stage ends each round itself: the stages may then ``drop``
  rows and write the ``released`` gate.

``snapshot`` and ``restore`` take a ``uri``; a shard given ``snapshot_places`` refuses any other
than a folder under one of them (a local path, or ``s3://bucket/key`` with the same query as the
place: the same endpoint), whoever asks.
"""

from __future__ import annotations

import hmac
import posixpath
from dataclasses import dataclass
from typing import Iterable, Literal
from urllib.parse import urlsplit

from dockrl.dock.schema import Schema

Role = Literal["driver", "stage"]

DRIVER_ACTIONS = frozenset({
    "open_iteration", "close_iteration", "flush_rollouts", "announce_iteration", "finish", "drop", "snapshot", "restore",
    "driver_beat",
})
"""Actions the stages' token may not call (the driver's own)."""
SAMPLING_ACTIONS = frozenset({"drop"})
"""Of those, what dynamic sampling's advantage stage calls: allowed to stages with ``stages_sample``."""
SAMPLING_COLUMNS = frozenset({"released"})
"""Driver-produced columns that dynamic sampling's advantage stage writes (each round's gate)."""


class AccessDenied(PermissionError):
    """A call its token's role may not make, or a snapshot outside the run's places (the shard
    answers it as Flight's ``FlightUnauthorizedError``)."""


@dataclass(frozen=True)
class ShardAccess:
    """The tokens of a shard and what each role may do (see the module docstring).

    Args:
        driver_token: the driver's bearer token (every right).
        stage_token: the stages' bearer token; None: there is one token, the driver's.
        schema: the shard's column schema (who produces each column).
        stages_sample: dynamic sampling runs: stages may ``drop`` and write the gate.
        snapshot_places: folders or ``s3://`` prefixes snapshots may go to; empty: anywhere.
    """

    driver_token: str
    stage_token: str | None
    schema: Schema
    stages_sample: bool = False
    snapshot_places: tuple[str, ...] = ()

    def role(self, authorization: str) -> Role | None:
        """The role of an ``authorization`` header's value (``Bearer <token>``), None for no known token."""
        given = authorization.encode()
        # both compared every time, in constant time: the answer's timing says nothing of either token
        driver = hmac.compare_digest(given, f"Bearer {self.driver_token}".encode())
        stage = self.stage_token is not None and hmac.compare_digest(given, f"Bearer {self.stage_token}".encode())
        return "driver" if driver else "stage" if stage else None

    def check_action(self, role: Role, action: str, body: dict) -> None:
        """Raises ``AccessDenied`` unless ``role`` may call ``action`` with ``body``."""
        if role == "stage" and action in DRIVER_ACTIONS and not (self.stages_sample and action in SAMPLING_ACTIONS):
            raise AccessDenied(f"dock shard: {action!r} is the driver's; a stage's token may not call it")
        if action in ("snapshot", "restore"):
            self.check_place(str(body.get("uri", "")))
        if role == "stage" and action == "commit":
            self.check_columns(role, body.get("objects", {}))

    def check_columns(self, role: Role, columns: Iterable[str]) -> None:
        """Raises ``AccessDenied`` when ``role`` may not put one of ``columns`` (the driver's columns)."""
        if role == "driver":
            return
        allowed = SAMPLING_COLUMNS if self.stages_sample else frozenset()
        driver = {c.name for c in self.schema.columns if c.producer == "driver"} - allowed
        theirs = sorted(set(columns) & driver)
        if theirs:
            raise AccessDenied(f"dock shard: columns {theirs} are the driver's; a stage's token may not put them")

    def check_place(self, uri: str) -> None:
        """Raises ``AccessDenied`` unless ``uri`` lies under one of ``snapshot_places``."""
        if self.snapshot_places and not any(_under(uri, place) for place in self.snapshot_places):
            raise AccessDenied(f"dock shard: snapshot uri {uri!r} is outside the run's places {list(self.snapshot_places)}")


def _under(uri: str, place: str) -> bool:
    """``uri`` is ``place`` or below it: same scheme, bucket and query; a path under the place's, no ``..``."""
    a, b = urlsplit(uri), urlsplit(place)
    if (a.scheme, a.netloc, a.query) != (b.scheme, b.netloc, b.query) or ".." in a.path.split("/"):
        return False
    path, root = posixpath.normpath(a.path or "/"), posixpath.normpath(b.path or "/")
    return path == root or path.startswith(root.rstrip("/") + "/")
