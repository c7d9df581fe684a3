"""KFP component: the launcher. Trains with GRPO and outputs the checkpoint, metrics, curves and run folder.

The work is ``dockrl.kubeflow.train_task.run_training``. The Metrics artifact holds the run's
summary, one scalar per number (final and best reward and accuracy, KL, tokens/s, wall time:
``dockrl.run.metrics.run_summary``), which the UI's compare-runs table lines up; ``summary`` is a
Markdown page of it (``run_summary_markdown``) and ``curves`` an HTML page of the run's curves and a
table of every metric (``metrics_report_html``), both shown in the run's Visualizations; the run
folder (metrics.jsonl: every metric of every iteration, TensorBoard, plot, resolved config) is the
``run_dir`` artifact. ``rollouts`` is the Dataset of the rollouts the run kept (``run.keep_rollouts``; empty when
off): Parquet by iteration with the run's config and tokenizer, its metadata the run id, iterations,
rows and schema version (``dockrl.launch.artifacts.rollouts_metadata``), an input for later
pipelines (``dockrl.pipelines.rescore``; docs/rollouts.md); ``rollouts_page`` its HTML page (reward per
iteration, length histograms, best and worst responses: ``dockrl.rollouts.page``), a second
Visualization. ``worker_backend`` and ``platform`` (the JSON of ``Platform.to_json``) are compiled in;
``run_id`` labels the workers (the pipeline passes its run's id). The workers run in the launcher
pod's own namespace: its owner reference, Role, NetworkPolicy, shared volume and
Secrets are all namespaced.
"""

from typing import List

from kfp import dsl
from kfp.dsl import HTML, Artifact, Dataset, Input, Markdown, Metrics, Model, Output

from dockrl.launch.platform import CPU_IMAGE


@dsl.component(base_image=CPU_IMAGE, install_kfp_package=False)
def train(
    config_overrides: List[str],
    dataset: Input[Dataset],
    worker_backend: str,
    run_id: str,
    platform: str,
    model: Output[Model],
    metrics: Output[Metrics],
    run_dir: Output[Artifact],
    curves: Output[HTML],
    summary: Output[Markdown],
    rollouts: Output[Dataset],
    rollouts_page: Output[HTML],
):
    """GRPO on ``dataset`` with the config given by ``section.field=value`` overrides."""
    # imported here, not at the top: KFP ships only this function's source to the task's pod
    import logging
    from pathlib import Path

    from dockrl.launch.image_env import enter_image_environment

    # first, before torch (and with it torch_npu) loads: on the NPU image, CANN's environment,
    # which KFP's own command bypasses (the process starts again through the image's entry point)
    enter_image_environment()
    from dockrl.kubeflow.train_task import run_training
    from dockrl.launch.artifacts import model_location, rollouts_metadata
    from dockrl.launch.platform import Platform
    from dockrl.rollouts.page import rollouts_page_of_folder
    from dockrl.run.metrics import metrics_report_html, run_summary_markdown

    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    run_training(config_overrides, dataset.path, model.path, run_dir.path, log_metric=metrics.log_metric,
                 worker_backend=worker_backend, run_id=run_id,
                 platform=Platform.from_json(platform), rollouts_dir=rollouts.path)
    model.metadata.update({"framework": "transformers", "format": "safetensors", "stage": "final-checkpoint",
                           **model_location(model.path)})
    Path(curves.path).write_text(metrics_report_html(run_dir.path))
    Path(summary.path).write_text(run_summary_markdown(run_dir.path), encoding="utf-8")
    rollouts.metadata.update(rollouts_metadata(rollouts.path, run_id))
    Path(rollouts_page.path).write_text(rollouts_page_of_folder(rollouts.path), encoding="utf-8")
