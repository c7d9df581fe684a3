"""KFP component: export the trained checkpoint as a self-contained HF safetensors Model.

The work is ``dockrl.kubeflow.steps.export_model_artifact``: the model goes to the run folder on the shared
volume, or to ``uri`` (``s3://``, the store of the run's ``dock`` settings), and the artifact names it (its
metadata: where, how big, dtype, parameters); with ``copy`` the artifact holds the model itself (uploaded
to KFP's artifact store).
"""

from typing import List

from kfp import dsl
from kfp.dsl import Input, Model, Output

from dockrl.launch.platform import CPU_IMAGE


@dsl.component(base_image=CPU_IMAGE, install_kfp_package=False)
def export_model(checkpoint: Input[Model], dtype: str, copy: bool, uri: str, config_overrides: List[str], model: Output[Model]):
    """Re-save ``checkpoint`` in ``dtype`` (float32, bfloat16, float16) with its tokenizer; ``uri``: to the object store."""
    # imported here, not at the top: KFP ships only this function's source to the task's pod
    import logging

    from dockrl.kubeflow.steps import export_model_artifact

    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    model.metadata.update(export_model_artifact(checkpoint.path, model.path, dtype, copy=copy, uri=uri, overrides=config_overrides))
