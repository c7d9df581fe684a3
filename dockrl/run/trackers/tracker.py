"""The ``Tracker`` protocol, what a tracker knows of its run (``RunInfo``), and where it keeps its run's id.

A tracker's constructor takes a ``RunInfo`` and does no I/O beyond checking its settings (a missing tracking URI
fails the run before it starts, naming the variable); ``start`` opens or, on a resumed run, continues the tracker's
run (its id kept in ``<run_dir>/trackers.json``); the other calls may fail (a server gone): ``TrackerSet`` catches it.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal, Mapping, Protocol, Sequence

from dockrl.process.source import commit_label

if TYPE_CHECKING:
    from dockrl.checkpoint.resume_point import ResumePoint
    from dockrl.config import Config

IMAGE_ENV = "DOCKRL_IMAGE"
"""The image the run's driver runs in (the pipeline sets it on its train task); unset on a laptop."""
IDS_FILE = "trackers.json"
"""``<run_dir>/trackers.json``: each tracker's run id, so a resumed run continues the same tracker run."""


class Tracker(Protocol):
    """An experiment tracker of one dockrl run (an entry of ``dockrl.config.trackers.TRACKERS``)."""

    def start(self) -> None:
        """Open the tracker's run (a resumed run: continue it) with the config and the lineage."""

    def log(self, iteration: int, metrics: Mapping[str, float]) -> None:
        """One iteration's metrics (``reward/mean``, ``actor/kl``, ...) at step ``iteration``."""

    def log_artifacts(self, paths: Sequence[Path]) -> None:
        """Keep ``paths`` (the curves, the rollouts page) with the run; a tracker without artifacts ignores them."""

    def finish(self, summary: Mapping[str, float], failed: bool) -> None:
        """The run's summary (accuracies, seconds), then close the tracker's run as finished or failed."""


@dataclass(frozen=True, kw_only=True)
class RunInfo:
    """What a tracker knows of its run."""

    run_dir: Path
    """``run.output_dir``: TensorBoard's events and W&B's offline files go there, and ``trackers.json``."""
    name: str = ""
    """The run's name in the tracker: the run folder's name when empty."""
    config: dict[str, Any] = field(default_factory=dict)
    """The resolved config as nested dicts (``Config.to_dict``)."""
    config_yaml: str = ""
    """The config as ``config.yaml`` holds it (``dump_config``)."""
    lineage: dict[str, str] = field(default_factory=dict)
    """``config_sha256``, ``resumed_from`` (a checkpoint, or ''), ``resume_iteration``, ``image``, ``commit``."""
    resume_from: int | None = None
    """The first iteration of a resumed run (None: a fresh run); TensorBoard purges its steps from it."""
    project: str = "dockrl"
    """``run.tracker_project``: the MLflow experiment, the W&B project."""
    wandb_mode: Literal["online", "offline"] = "online"
    """``run.wandb_mode``."""

    @property
    def title(self) -> str:
        return self.name or self.run_dir.resolve().name


def run_info(cfg: Config, point: ResumePoint | None) -> RunInfo:
    """The ``RunInfo`` of a planned run (``point``: the checkpoint it resumes from, or None)."""
    from dockrl.config import dump_config
    from dockrl.rollouts.keep import config_hash

    lineage = {"config_sha256": config_hash(cfg), "resumed_from": str(point.checkpoint) if point else "",
               "resume_iteration": str(point.next_iteration) if point else "", "image": os.environ.get(IMAGE_ENV, ""),
               "commit": commit_label()}
    return RunInfo(run_dir=Path(cfg.run.output_dir), config=cfg.to_dict(), config_yaml=dump_config(cfg), lineage=lineage,
                   resume_from=point.next_iteration if point else None, project=cfg.run.tracker_project,
                   wandb_mode=cfg.run.wandb_mode)


def remembered_id(run: RunInfo, tracker: str) -> str:
    """The id of ``tracker``'s run that a resumed run continues ('' for a fresh run, or none kept)."""
    path = run.run_dir / IDS_FILE
    if run.resume_from is None or not path.is_file():
        return ""
    try:
        return str(json.loads(path.read_text(encoding="utf-8")).get(tracker, ""))
    except (ValueError, AttributeError):
        return ""


def remember_id(run: RunInfo, tracker: str, run_id: str) -> None:
    """Keep ``tracker``'s run id in ``<run_dir>/trackers.json`` (written atomically)."""
    path = run.run_dir / IDS_FILE
    try:
        ids = json.loads(path.read_text(encoding="utf-8")) if path.is_file() else {}
    except ValueError:
        ids = {}
    ids[tracker] = run_id
    tmp = path.with_suffix(".json.tmp")
    tmp.write_text(json.dumps(ids, indent=2, sort_keys=True) + "\n", encoding="utf-8")
    os.replace(tmp, path)


def flat_config(config: Mapping[str, Any], prefix: str = "") -> dict[str, Any]:
    """``{"trainer": {"lr": 1e-6}}`` as ``{"trainer.lr": 1e-6}`` (MLflow's params are flat)."""
    out: dict[str, Any] = {}
    for key, value in config.items():
        if isinstance(value, Mapping):
            out |= flat_config(value, f"{prefix}{key}.")
        else:
            out[f"{prefix}{key}"] = value
    return out
