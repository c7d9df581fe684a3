"""KFP component: greedy accuracy of a Model on the test split of a Dataset, as Metrics.

The work is ``dockrl.kubeflow.steps.evaluate_model``. ``device`` is compiled in: ``auto`` where the
pipeline gives the step the platform's image and one accelerator (the rollout engine the config
resolves for it: vLLM where it runs there), ``cpu`` on a platform without accelerators. With the
``kubernetes`` worker backend (``worker_backend``, ``run_id`` and ``platform`` compiled in, as for
the train task) the step only drives: the evaluation runs in a worker group of the run, a pod
rendered with every hook of the platform (``dockrl.kubeflow.steps.evaluate_on_cluster``).
"""

from typing import List

from kfp import dsl
from kfp.dsl import Dataset, Input, Metrics, Model, Output

from dockrl.launch.platform import CPU_IMAGE


@dsl.component(base_image=CPU_IMAGE, install_kfp_package=False)
def evaluate(model: Input[Model], dataset: Input[Dataset], config_overrides: List[str], device: str, worker_backend: str,
             run_id: str, platform: str, metrics: Output[Metrics]):
    """``eval/accuracy``, ``eval/format_rate`` and ``eval/count`` of greedy decoding on ``device``."""
    # imported here, not at the top: KFP ships only this function's source to the task's pod
    import logging

    from dockrl.launch.image_env import enter_image_environment

    enter_image_environment()  # first, before torch loads: on the NPU image CANN's environment, which KFP's command bypasses
    from dockrl.kubeflow.steps import TEARDOWN_WAIT_S, evaluate_model, evaluate_on_cluster, evaluate_run_id
    from dockrl.launch.kubernetes import KubernetesBackend
    from dockrl.launch.platform import Platform

    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    if worker_backend == "kubernetes":
        backend = KubernetesBackend.from_cluster(evaluate_run_id(run_id), platform=Platform.from_json(platform),
                                                 teardown_wait_s=TEARDOWN_WAIT_S)
        results = evaluate_on_cluster(model.path, dataset.path, config_overrides, run_id=run_id, backend=backend)
    else:
        results = evaluate_model(model.path, dataset.path, config_overrides, device=device)
    for name, value in results.items():
        metrics.log_metric(name, value)
