"""Launching runs: the worker backends, and the folders the pipeline steps hand on.

The train step's job (``dockrl/kubeflow/train_task.py``) sits above the driver, so outside this package:
nothing here imports the driver.

* ``artifacts.py`` the dataset and model folders the pipeline steps (``dockrl/kubeflow/steps.py``) hand on
* ``task_mounts.py`` a local pipeline run shaped like the cluster: each task sees only the volumes it mounts
* ``distributed.py`` the stage runner of ``dock.mode=distributed``: dock shards and stages as worker groups
* ``backend.py``   worker groups, the backend protocol and its names (imports nothing of dockrl)
* ``local.py``     worker groups as local processes (``procfs.py``: what ``/proc`` says of them)
* ``jobset.py``    a run's worker groups as one JobSet (rendering: Secret, PodGroup, JobSet)
* ``pod_spec.py``  one worker pod of that JobSet: how members are placed in pods, and the pod's spec
* ``kubernetes.py`` the Kubernetes backend: creates, watches and tears down that JobSet
  (``kubernetes_watch.py``: what a watch reads; ``launcher_pod.py``: the pod that owns the JobSet)
* ``platform.py``  npu / gpu / cpu presets: image, accelerator resource, node selector, tolerations
  (``platform_checks.py``: the rules of their values; ``platform_files.py``: a site's images and fields)
"""
