"""KFP component: supervised fine-tuning on the prepared dataset; outputs the model, metrics and run folder.

The work is ``dockrl.kubeflow.sft_task.run_sft_training`` (``dockrl sft`` in the task's own pod, on the
platform's accelerator). ``model`` holds the final checkpoint or, where the shared volume is mounted, names it
there; ``metrics`` the SFT run's summary (loss, tokens/s, wall time); ``run_dir`` the run folder without its
checkpoints.
"""

from typing import List

from kfp import dsl
from kfp.dsl import Artifact, Dataset, Input, Metrics, Model, Output

from dockrl.launch.platform import CPU_IMAGE


@dsl.component(base_image=CPU_IMAGE, install_kfp_package=False)
def sft(config_overrides: List[str], dataset: Input[Dataset], run_id: str, platform: str, model: Output[Model],
        metrics: Output[Metrics], run_dir: Output[Artifact]):
    """SFT on ``dataset`` with the config given by ``section.field=value`` overrides."""
    # imported here, not at the top: KFP ships only this function's source to the task's pod
    import logging

    from dockrl.launch.image_env import enter_image_environment

    enter_image_environment()  # first, before torch loads: on the NPU image, CANN's environment
    from dockrl.kubeflow.sft_task import run_sft_training
    from dockrl.launch.artifacts import model_location
    from dockrl.launch.platform import Platform

    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    run_sft_training(config_overrides, dataset.path, model.path, run_dir.path, log_metric=metrics.log_metric, run_id=run_id,
                     platform=Platform.from_json(platform))
    model.metadata.update({"framework": "transformers", "format": "safetensors", "stage": "sft-final-checkpoint",
                           **model_location(model.path)})
