"""Checkpoints: where they are and when (``resume.py``), the point a run resumes from
(``resume_point.py``), which are kept (``pruning.py``) and the optimizer's state (``optimizer_state.py``)."""
