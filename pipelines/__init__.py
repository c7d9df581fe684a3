"""KFP pipelines: the GRPO pipeline (grpo.py) and submitting or scheduling it (submit.py).

Installed as ``dockrl.pipelines`` (pyproject.toml's package-dir; the folder stays at the top of the
repository).
"""
