"""The ``mlflow`` tracker: a run on an MLflow tracking server, through ``mlflow.MlflowClient``.

The server is ``$MLFLOW_TRACKING_URI`` and its credentials MLflow's own variables (``MLFLOW_TRACKING_USERNAME`` and
``MLFLOW_TRACKING_PASSWORD``, or ``MLFLOW_TRACKING_TOKEN``): on Kubeflow they come from the Secret
``Platform.tracker_secret`` as the object store's keys come from theirs (docs/kubeflow.md). The run (named after the
run folder, in the experiment ``run.tracker_project``) gets the config as params (``section.field``) and as the
artifact ``config.yaml``, the lineage as tags ``dockrl.<key>``, every iteration's metrics at step ``iteration``, the
report files (``run_report``) as artifacts, the summary as metrics, and its end state. A resumed run continues the
same MLflow run (its id in ``trackers.json``) and updates the lineage tags.

MLflow's client retries a request for minutes by default; a tracker must not hold the driver that long, so unless the
environment says otherwise a request is tried ``HTTP_DEFAULTS`` times with a short timeout, and ``TrackerSet``
retries later.
"""

from __future__ import annotations

import os
import time
from pathlib import Path
from typing import Any, Mapping, Sequence

from dockrl.config.errors import fail
from dockrl.run.trackers.tracker import RunInfo, flat_config, remember_id, remembered_id

URI_ENV = "MLFLOW_TRACKING_URI"
HTTP_DEFAULTS = {"MLFLOW_HTTP_REQUEST_MAX_RETRIES": "2", "MLFLOW_HTTP_REQUEST_BACKOFF_FACTOR": "1",
                 "MLFLOW_HTTP_REQUEST_TIMEOUT": "10"}
"""MLflow's request settings where the environment sets none: at most ~13 s per call to a server that is gone."""
PARAM_CHARS = 6000
"""Longest param value MLflow's stores take; a longer config value is cut (``config.yaml`` holds it whole)."""
BATCH = 100
"""Params (and, well within MLflow's 1,000, metrics) per ``log_batch`` request: MLflow's limit for params."""


class MlflowTracker:
    """A run on ``$MLFLOW_TRACKING_URI`` (see the module docstring).

    Raises:
        ConfigError: naming ``run.trackers``: ``$MLFLOW_TRACKING_URI`` is unset.
    """

    def __init__(self, run: RunInfo):
        uri = os.environ.get(URI_ENV, "")
        if not uri:
            raise fail("run.trackers", "mlflow", f"needs the tracking server's URI in ${URI_ENV} (in a pipeline: the key "
                       f"{URI_ENV} of the Secret dockrl-trackers, docs/kubeflow.md)")
        for key, value in HTTP_DEFAULTS.items():
            os.environ.setdefault(key, value)
        from mlflow import MlflowClient  # lazy: the mlflow extra; the core needs none

        self.run, self.client = run, MlflowClient(tracking_uri=uri)
        self.run_id = remembered_id(run, "mlflow")

    def start(self) -> None:
        from mlflow.entities import Param

        tags = {f"dockrl.{k}": v for k, v in self.run.lineage.items()}
        if self.run_id:  # a resumed run: the same MLflow run, its lineage as of this attempt
            self.client.update_run(self.run_id, status="RUNNING")
            for key, value in tags.items():
                self.client.set_tag(self.run_id, key, value)
            return
        experiment = self.client.get_experiment_by_name(self.run.project)
        experiment_id = experiment.experiment_id if experiment else self.client.create_experiment(self.run.project)
        self.run_id = self.client.create_run(experiment_id, run_name=self.run.title, tags=tags).info.run_id
        remember_id(self.run, "mlflow", self.run_id)
        params = [Param(k, str(v)[:PARAM_CHARS]) for k, v in sorted(flat_config(self.run.config).items())]
        for i in range(0, len(params), BATCH):
            self.client.log_batch(self.run_id, params=params[i:i + BATCH])
        if self.run.config_yaml:
            self.client.log_text(self.run_id, self.run.config_yaml, "config.yaml")

    def _metrics(self, metrics: Mapping[str, float], step: int) -> None:
        from mlflow.entities import Metric

        stamp = int(time.time() * 1000)
        batch: list[Any] = [Metric(k, float(v), stamp, step) for k, v in metrics.items()]
        for i in range(0, len(batch), BATCH):
            self.client.log_batch(self.run_id, metrics=batch[i:i + BATCH])

    def log(self, iteration: int, metrics: Mapping[str, float]) -> None:
        self._metrics(metrics, iteration)

    def log_artifacts(self, paths: Sequence[Path]) -> None:
        for path in paths:
            self.client.log_artifact(self.run_id, str(path))

    def finish(self, summary: Mapping[str, float], failed: bool) -> None:
        if summary:
            self._metrics(summary, 0)
        self.client.set_terminated(self.run_id, status="FAILED" if failed else "FINISHED")
