"""Launching runs: the pipeline steps' library functions and the worker backends.

The train step's job (``dockrl/train_task.py``) sits above the driver, so outside this package:
nothing here imports the driver.

* ``tasks.py``     prepare the dataset, export the model, evaluate it, tear a run's workers down (short pipeline steps)
* ``distributed.py`` the stage runner of ``dock.mode=distributed``: dock shards and stages as worker groups
* ``backend.py``   worker groups, the backend protocol and its names (imports nothing of dockrl)
* ``local.py``     worker groups as local processes
* ``jobset.py``    a run's worker groups as one JobSet (rendering: Secret, PodGroup, JobSet)
* ``kubernetes.py`` the Kubernetes backend: creates, watches and tears down that JobSet
* ``platform.py``  npu / gpu / cpu presets: image, accelerator resource, node selector, tolerations
"""
