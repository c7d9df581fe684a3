"""dockrl's side of the Kubeflow pipeline: the train task and its retry (``train_task.py``,
``train_retry.py``), the short pipeline steps (``steps.py``), ``dockrl pipeline`` (``pipeline_cli.py``)
and the pipeline run locally (``local_run.py``). The components and pipelines themselves sit in
``components/`` and ``pipelines/`` at the repository's top level."""
