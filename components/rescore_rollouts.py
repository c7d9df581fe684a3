"""KFP component: a new reward over a train task's kept rollouts, beside the one the run trained with.

The work is ``dockrl.rollouts.rescore.rescore_artifact``: ``rollouts`` is a train task's ``rollouts``
Dataset (brought into the rescore pipeline by an importer), ``scorer`` a ``module:Class`` reward
importable in the task's image, or ``judge`` the ``reward_model.*`` settings of a generative judge (one per line;
``dockrl.config.parse_override_lines``). ``rescored`` holds ``rescored.parquet`` (iteration, row, old, new,
new_bad) and ``rescore.json``; ``metrics`` each iteration's mean old and new reward.
"""

from kfp import dsl
from kfp.dsl import Dataset, Input, Metrics, Output

from dockrl.launch.platform import CPU_IMAGE


@dsl.component(base_image=CPU_IMAGE, install_kfp_package=False)
def rescore_rollouts(rollouts: Input[Dataset], scorer: str, judge: str, rescored: Output[Dataset], metrics: Output[Metrics]):
    """Score every kept row of ``rollouts`` with ``scorer`` or the judge; old and new reward side by side in ``rescored``."""
    # imported here, not at the top: KFP ships only this function's source to the task's pod
    import logging

    from dockrl.config import parse_override_lines
    from dockrl.rollouts.rescore import rescore_artifact

    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    meta, values = rescore_artifact(rollouts.path, scorer, rescored.path, judge=parse_override_lines(judge))
    rescored.metadata.update(meta)
    for key, value in values.items():
        metrics.log_metric(key, value)
