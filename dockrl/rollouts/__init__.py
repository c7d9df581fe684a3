"""Kept rollouts (``run.keep_rollouts``) after the run: where they are written (``keep.py``), reading
them a page at a time (``page.py``), training on them again (``replay.py``), scoring them again
(``rescore.py``) and ``dockrl rollouts`` (``cli.py``)."""
