"""KFP component: the exit handler's task. Tears down a run's workers, whatever happened.

The work is ``dockrl.kubeflow.steps.teardown_run``; with the local backend and nothing
registered it removes nothing and still succeeds. The workers live in the run's own namespace
(the pod's, ``POD_NAMESPACE``).
"""

from kfp import dsl

from dockrl.launch.platform import CPU_IMAGE


@dsl.component(base_image=CPU_IMAGE, install_kfp_package=False)
def teardown_workers(run_id: str, worker_backend: str, status: dsl.PipelineTaskFinalStatus):
    """Remove every worker labelled with ``run_id`` in this pod's namespace."""
    # imported here, not at the top: KFP ships only this function's source to the task's pod
    import logging

    from dockrl.kubeflow.steps import teardown_run

    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    logging.getLogger("teardown").info("run %s ended %s %s", run_id, status.state, status.error_message or "")
    teardown_run(worker_backend, run_id)
