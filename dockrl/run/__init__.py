"""A run's set-up and its life beside the loop: the plan (``setup.py``), the run directory's lock
(``lock.py``), the prompts (``data.py``), the packaged and tiny models (``models.py``), the metrics log
(``metrics.py``), the progress bar (``progress.py``) and the driver's dock lease (``driver_lease.py``)."""
