"""KFP pipelines: the GRPO pipeline (grpo.py) and submitting or scheduling it (submit.py)."""
