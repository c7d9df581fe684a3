"""Row indexes of the dock as int64 numpy arrays: runs of consecutive rows, and distinct values.

A claim usually takes consecutive rows, so the controller, the shard and the Flight wire
(``dockrl.dock.flight.wire``) handle a run ``[start, stop)`` in O(1) instead of row by row
(``one_run``), and send several runs as an ``(k, 2)`` array (``row_runs``, ``runs_rows``).
"""

from __future__ import annotations

import numpy as np


def one_run(rows: np.ndarray) -> tuple[int, int] | None:
    """``(start, stop)`` when the ascending, distinct ``rows`` are the consecutive rows ``[start, stop)``; else None.

    None too for no rows. The caller vouches that ``rows`` ascend and are distinct: only the
    ends and the length are read (O(1)).
    """
    n = len(rows)
    if n and int(rows[-1]) - int(rows[0]) + 1 == n:
        return int(rows[0]), int(rows[-1]) + 1
    return None


def distinct(a: np.ndarray) -> np.ndarray:
    """The distinct values of ``a`` ascending (cheap when ``a`` is ascending already, as rows mostly are)."""
    if len(a) < 2:
        return a
    if (a[1:] >= a[:-1]).all():
        return a[np.concatenate(([True], a[1:] != a[:-1]))]
    return np.unique(a)


def row_runs(rows: np.ndarray) -> np.ndarray:
    """The ascending, distinct int64 ``rows`` as runs of consecutive rows: an int64 ``(k, 2)`` array of ``[start, stop)``."""
    n = len(rows)
    if not n:
        return np.zeros((0, 2), dtype=np.int64)
    run = one_run(rows)
    if run is not None:
        return np.array([run], dtype=np.int64)
    breaks = np.flatnonzero(np.diff(rows) != 1) + 1
    starts = np.concatenate(([0], breaks))
    stops = np.concatenate((breaks, [n]))
    return np.stack([rows[starts], rows[stops - 1] + 1], axis=1).astype(np.int64, copy=False)


def runs_rows(runs: np.ndarray) -> np.ndarray:
    """The rows of ``runs`` (``row_runs``), in order, as an int64 array."""
    if len(runs) == 1:
        return np.arange(runs[0, 0], runs[0, 1], dtype=np.int64)
    return np.concatenate([np.zeros(0, dtype=np.int64), *(np.arange(a, b, dtype=np.int64) for a, b in runs.tolist())])
