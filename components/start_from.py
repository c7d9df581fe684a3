"""KFP component: the next step's config overrides, starting from the model of the step before.

The work is ``dockrl.kubeflow.sft_task.start_from_overrides``: ``model`` (a model artifact, which holds the
model or names it on the shared volume) becomes ``model.path`` of the overrides the next step reads, so the
alignment pipeline's GRPO steps start from the SFT step's model, with the lineage of the artifact.
"""

from typing import List

from kfp import dsl
from kfp.dsl import Input, Model

from dockrl.launch.platform import CPU_IMAGE


@dsl.component(base_image=CPU_IMAGE, install_kfp_package=False)
def start_from(config_overrides: List[str], model: Input[Model]) -> List[str]:
    """``config_overrides`` with ``model.path`` set to ``model``'s (checked as the command line's overrides)."""
    # imported here, not at the top: KFP ships only this function's source to the task's pod
    import logging

    from dockrl.kubeflow.sft_task import start_from_overrides

    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    return start_from_overrides(config_overrides, model.path)
