"""KFP component: the launcher. Trains with GRPO and outputs the checkpoint, metrics and run folder.

The work is ``dockrl.launch.launcher.run_training``. Per-iteration metrics land in the Metrics
artifact as ``<key>/iter_<NNNN>``; the whole run folder (metrics.jsonl, TensorBoard, plot,
resolved config) is the ``run_dir`` artifact. ``platform`` is the JSON of the worker pods'
``Platform`` (``Platform.to_json``); ``run_id`` labels them (the pipeline passes its run's id).
"""

from typing import List

from kfp import dsl
from kfp.dsl import Artifact, Dataset, Input, Metrics, Model, Output

from dockrl.launch.platform import CPU_IMAGE


@dsl.component(base_image=CPU_IMAGE, install_kfp_package=False)
def train(
    config_overrides: List[str],
    dataset: Input[Dataset],
    worker_backend: str,
    run_id: str,
    namespace: str,
    platform: str,
    model: Output[Model],
    metrics: Output[Metrics],
    run_dir: Output[Artifact],
):
    """GRPO on ``dataset`` with the config given by ``section.field=value`` overrides."""
    import logging

    from dockrl.launch.launcher import run_training
    from dockrl.launch.platform import Platform

    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    run_training(config_overrides, dataset.path, model.path, run_dir.path, log_metric=metrics.log_metric,
                 worker_backend=worker_backend, run_id=run_id, namespace=namespace, platform=Platform.from_json(platform))
    model.metadata.update({"framework": "transformers", "format": "safetensors", "stage": "final-checkpoint"})
