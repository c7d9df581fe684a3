"""KFP component: the run's config overrides from the UI's run parameters, checked before anything starts,
and the size of the train task's pod for that config.

The work is ``dockrl.kubeflow.steps.resolve_overrides``: the parameters that differ from their
defaults become ``section.field=value`` overrides, then the lines of ``config_overrides`` (a text, one
override per line: ``dockrl.config.parse_override_lines``), which win, all checked as the command line's
are (a bad one fails the step with the command line's error); and
``dockrl.kubeflow.steps.local_run_resources``: the accelerators, CPU and memory of a train pod that
runs the whole job (``worker_backend=local``) on ``platform`` (the JSON of ``Platform.to_json``).
The sizes are strings because KFP's driver reads a task's resources from string values only.
The outputs are declared in KFP's functional ``NamedTuple(...)`` form, which mypy does not read
as a type: only the function's own source runs in the container, so a NamedTuple class defined
beside it would not exist there.
"""

from typing import List, NamedTuple

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
    keep_checkpoints: int,
    config_overrides: str,
    platform: str,
) -> NamedTuple("Outputs", [("overrides", List[str]), ("devices", str), ("cpu", str), ("memory", str)]):  # type: ignore[valid-type]
    """The overrides every later step of the run reads (a config error fails this step), and the
    devices, CPU and memory requests of a train pod that runs every stage of that config."""
    # imported here, not at the top: KFP ships only this function's source to the task's pod
    import logging

    from dockrl.config import parse_override_lines
    from dockrl.kubeflow.steps import local_run_resources, resolve_overrides
    from dockrl.launch.platform import Platform

    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    params = {"iterations": iterations, "global_batch": global_batch, "mini_batch": mini_batch, "group_size": group_size,
              "learning_rate": learning_rate, "kl_loss_coef": kl_loss_coef, "max_response_length": max_response_length,
              "adv_estimator": adv_estimator, "model_path": model_path, "train_data": train_data, "test_data": test_data,
              "keep_checkpoints": keep_checkpoints}
    overrides = resolve_overrides(params, parse_override_lines(config_overrides))
    size = local_run_resources(overrides, Platform.from_json(platform))
    return overrides, size["devices"], size["cpu"], size["memory"]  # in the order of the outputs
