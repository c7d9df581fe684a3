"""KFP component: greedy accuracy of a Model on the test split of a Dataset, as Metrics.

The work is ``dockrl.launch.tasks.evaluate_model``.
"""

from typing import List

from kfp import dsl
from kfp.dsl import Dataset, Input, Metrics, Model, Output

from dockrl.launch.platform import CPU_IMAGE


@dsl.component(base_image=CPU_IMAGE, install_kfp_package=False)
def evaluate(model: Input[Model], dataset: Input[Dataset], config_overrides: List[str], metrics: Output[Metrics]):
    """``eval/accuracy``, ``eval/format_rate`` and ``eval/count`` of greedy decoding."""
    import logging

    from dockrl.launch.tasks import evaluate_model

    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    for name, value in evaluate_model(model.path, dataset.path, config_overrides).items():
        metrics.log_metric(name, value)
