"""Experiment trackers: a run's metrics, config and lineage, logged live from the driver.

``run.trackers`` names them (the registry ``dockrl.config.trackers.TRACKERS``). Each implements the small
``Tracker`` protocol (``tracker.py``): ``start`` (open the tracker's run with the config and the lineage: config hash,
resume point, image, commit), ``log`` (one iteration's metrics), ``log_artifacts`` (the curves and the rollouts
page, ``dockrl.run.metrics.run_report``), ``finish``. ``TrackerSet`` (``guard.py``) holds the run's trackers and keeps their failures
away from training: counted, warned about once per outage, retried with backoff, the iterations held meanwhile.
The adapters: ``tensorboard.py`` (event files in the run folder), ``mlflow.py`` (a tracking server, through its
client), ``wandb.py`` (W&B online or offline).
"""

from dockrl.run.trackers.guard import TrackerSet
from dockrl.run.trackers.tracker import RunInfo, Tracker, run_info

__all__ = ["RunInfo", "Tracker", "TrackerSet", "run_info"]
