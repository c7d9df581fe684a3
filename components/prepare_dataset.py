"""KFP component: write the run's train and test prompt files into a Dataset artifact.

The work is ``dockrl.kubeflow.steps.prepare_dataset`` (seeded generated problems, or the files
named by ``data.train_path`` / ``data.test_path``).
"""

from typing import List

from kfp import dsl
from kfp.dsl import Dataset, Output

from dockrl.launch.platform import CPU_IMAGE


@dsl.component(base_image=CPU_IMAGE, install_kfp_package=False)
def prepare_dataset(config_overrides: List[str], dataset: Output[Dataset]):
    """Train/test prompts in GSM8K format for the config given by ``section.field=value`` overrides."""
    # imported here, not at the top: KFP ships only this function's source to the task's pod
    import logging

    from dockrl.kubeflow.steps import prepare_dataset as prepare

    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    dataset.metadata.update(prepare(config_overrides, dataset.path))
