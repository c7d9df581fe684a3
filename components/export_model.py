"""KFP component: export the trained checkpoint as a self-contained HF safetensors Model.

The work is ``dockrl.kubeflow.steps.export_model``.
"""

from kfp import dsl
from kfp.dsl import Input, Model, Output

from dockrl.launch.platform import CPU_IMAGE


@dsl.component(base_image=CPU_IMAGE, install_kfp_package=False)
def export_model(checkpoint: Input[Model], dtype: str, model: Output[Model]):
    """Re-save ``checkpoint`` in ``dtype`` (float32, bfloat16, float16) with its tokenizer."""
    # imported here, not at the top: KFP ships only this function's source to the task's pod
    import logging

    from dockrl.kubeflow.steps import export_model as export

    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    model.metadata.update(export(checkpoint.path, model.path, dtype))
