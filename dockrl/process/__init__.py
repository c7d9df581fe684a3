"""The ground floor every process stands on: the driver's lifeline (``lifeline.py``), the process
environment (``env.py``), seeding (``seeding.py``) and memory readings (``memory.py``)."""
