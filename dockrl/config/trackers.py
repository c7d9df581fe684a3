"""The experiment trackers' registry: ``run.trackers`` names entries of ``TRACKERS``.

An entry names its class by import path (``module:Class``, as ``ESTIMATORS`` names its functions), so the
config checks the names at load without importing TensorBoard, MLflow or W&B, and says what the run needs:
the package extra that installs its client and whether it keeps files (the curves, the rollouts page) as
run artifacts. The classes are in ``dockrl/run/trackers/``; each implements ``dockrl.run.trackers.Tracker``.
Adding a tracker is its class plus one entry here (and its name in ``TrackerName``, for mypy;
``tests/run/test_trackers.py`` keeps the two equal).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal

from dockrl.process.imports import import_object

TrackerName = Literal["tensorboard", "mlflow", "wandb"]
"""The built-in trackers' names, for mypy: ``TRACKERS``' keys."""


@dataclass(frozen=True, kw_only=True)
class TrackerEntry:
    """One experiment tracker: its class, the package that provides its client, whether it has artifacts."""

    cls: str
    """``module:Class`` of a ``dockrl.run.trackers.Tracker``, built as ``Class(run: RunInfo)``."""
    module: str
    """The client's top-level module: the run checks it imports before it starts (``check_installed``)."""
    extra: str = ""
    """The package extra that installs the client (``pip install 'dockrl[<extra>]'``); "" for a core dependency."""
    artifacts: bool = False
    """The tracker keeps files with a run: the curves and the rollouts page go to it when the run ends."""

    def load(self) -> Any:
        """The class ``cls`` names, imported.

        Raises:
            ImportError, AttributeError: it does not import.
        """
        return import_object(self.cls)


_TRACKERS = "dockrl.run.trackers"

TRACKERS: dict[str, TrackerEntry] = {
    "tensorboard": TrackerEntry(cls=f"{_TRACKERS}.tensorboard:TensorBoardTracker", module="tensorboard"),
    "mlflow": TrackerEntry(cls=f"{_TRACKERS}.mlflow:MlflowTracker", module="mlflow", extra="mlflow", artifacts=True),
    "wandb": TrackerEntry(cls=f"{_TRACKERS}.wandb:WandbTracker", module="wandb", extra="wandb", artifacts=True),
}
"""Every experiment tracker by its ``run.trackers`` name."""
