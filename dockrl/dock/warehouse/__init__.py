"""Where the payload of the dock's columns lives: the backend protocol (``base.py``), the S3 warehouse
(``s3.py``), the backends that need no extra and the choice of a run's warehouse (``stores.py``)."""
