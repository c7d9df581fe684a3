"""KFP component: the run's config overrides from the UI's run parameters, checked before anything starts.

The work is ``dockrl.launch.tasks.resolve_overrides``: the parameters that differ from their
defaults become ``section.field=value`` overrides, then ``config_overrides`` (which win).
"""

from typing import List

from kfp import dsl

from dockrl.launch.platform import CPU_IMAGE


@dsl.component(base_image=CPU_IMAGE, install_kfp_package=False)
def resolve_config(
    iterations: int,
    global_batch: int,
    mini_batch: int,
    group_size: int,
    learning_rate: float,
    kl_loss_coef: float,
    max_response_length: int,
    adv_estimator: str,
    model_path: str,
    train_data: str,
    test_data: str,
    config_overrides: List[str],
) -> List[str]:
    """The overrides every later step of the run reads (a config error fails this step)."""
    import logging

    from dockrl.launch.tasks import resolve_overrides

    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    params = {"iterations": iterations, "global_batch": global_batch, "mini_batch": mini_batch, "group_size": group_size,
              "learning_rate": learning_rate, "kl_loss_coef": kl_loss_coef, "max_response_length": max_response_length,
              "adv_estimator": adv_estimator, "model_path": model_path, "train_data": train_data, "test_data": test_data}
    return resolve_overrides(params, config_overrides)
