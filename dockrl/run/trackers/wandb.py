"""The ``wandb`` tracker: a Weights & Biases run, online or offline (``run.wandb_mode``).

Online it streams to ``$WANDB_BASE_URL`` (W&B's cloud when unset) with ``$WANDB_API_KEY``: on Kubeflow both come from
the Secret ``Platform.tracker_secret`` (docs/kubeflow.md). Offline it writes the run under ``<run_dir>/wandb`` only,
for ``wandb sync`` from a machine with a way out. The run (named after the run folder, in the project
``run.tracker_project``) gets the config with the lineage under ``lineage``, every iteration's metrics at step
``iteration``, the report files (``run_report``) as one artifact of type ``run-report``, the summary and its exit
code. A resumed run continues the same W&B run (its id in ``trackers.json``; W&B keeps the steps it had).
"""

from __future__ import annotations

import secrets
from pathlib import Path
from typing import Any, Mapping, Sequence

from dockrl.run.trackers.tracker import RunInfo, remember_id, remembered_id


class WandbTracker:
    """A W&B run (see the module docstring)."""

    def __init__(self, run: RunInfo):
        self.run = run
        self.run_id = remembered_id(run, "wandb")
        self._run: Any = None

    def start(self) -> None:
        import wandb  # lazy: the wandb extra; the core needs none

        run_id = self.run_id or secrets.token_hex(4)  # W&B's ids: short, of lower-case letters and digits
        remember_id(self.run, "wandb", run_id)  # before init: a run cut short in init is continued, not duplicated
        self.run.run_dir.mkdir(parents=True, exist_ok=True)
        self._run = wandb.init(
            project=self.run.project, name=self.run.title, id=run_id, resume="allow", dir=str(self.run.run_dir),
            mode=self.run.wandb_mode, config={**self.run.config, "lineage": self.run.lineage},
            # the driver's console is its own (and the pod's log); W&B would copy it
            settings=wandb.Settings(console="off", allow_val_change=True), reinit="create_new",
        )
        self.run_id = run_id

    def log(self, iteration: int, metrics: Mapping[str, float]) -> None:
        self._run.log(dict(metrics), step=iteration)

    def log_artifacts(self, paths: Sequence[Path]) -> None:
        import wandb

        artifact = wandb.Artifact(f"{self.run_id}-report", type="run-report")
        for path in paths:
            artifact.add_file(str(path))
        self._run.log_artifact(artifact)

    def finish(self, summary: Mapping[str, float], failed: bool) -> None:
        self._run.summary.update(dict(summary))
        self._run.finish(exit_code=1 if failed else 0)
