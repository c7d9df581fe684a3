"""KFP pipelines: the GRPO pipeline (grpo.py), submitting or scheduling it (submit.py), and the rescore of a
run's kept rollouts (rescore.py).

Installed as ``dockrl.pipelines`` (pyproject.toml's package-dir; the folder stays at the top of the
repository).
"""
