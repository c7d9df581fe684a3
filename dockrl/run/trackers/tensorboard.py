"""The ``tensorboard`` tracker: every iteration's metrics as scalars in ``<run_dir>/tensorboard``, the lineage as text.

A Kubeflow TensorBoard reads the folder from the shared volume while the run trains (docs/kubernetes.md). A resumed
run purges the steps from its first iteration on, which an interrupted attempt wrote after its checkpoint, so every
iteration appears once. TensorBoard keeps no files: ``log_artifacts`` does nothing.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Mapping, Sequence

from dockrl.run.trackers.tracker import RunInfo


class TensorBoardTracker:
    """Scalars at step ``iteration`` in ``<run_dir>/tensorboard`` (``torch.utils.tensorboard.SummaryWriter``)."""

    def __init__(self, run: RunInfo):
        self.run = run
        self.log_dir = run.run_dir / "tensorboard"
        self._writer: Any = None

    def start(self) -> None:
        from torch.utils.tensorboard import SummaryWriter  # lazy: it imports torch; reading metrics does not need it

        self._writer = SummaryWriter(log_dir=str(self.log_dir), purge_step=self.run.resume_from)
        if self.run.lineage:
            rows = "\n".join(f"| {k} | {v} |" for k, v in self.run.lineage.items())
            self._writer.add_text("lineage", f"| | |\n|---|---|\n{rows}", global_step=self.run.resume_from or 0)

    def log(self, iteration: int, metrics: Mapping[str, float]) -> None:
        for key, value in metrics.items():
            self._writer.add_scalar(key, value, global_step=iteration)
        self._writer.flush()

    def log_artifacts(self, paths: Sequence[Path]) -> None:
        """TensorBoard keeps no files."""

    def finish(self, summary: Mapping[str, float], failed: bool) -> None:
        self._writer.close()
