"""The run's progress bar: ``Progress`` shows an ETA bar over iterations (tqdm) with a few of the
metrics of each (``DEFAULT_PROGRESS_KEYS``); the metrics themselves are written by ``dockrl.run.metrics``.
"""

from __future__ import annotations

import numbers
from types import TracebackType
from typing import Any, Mapping, Sequence

from tqdm import tqdm

DEFAULT_PROGRESS_KEYS = ("reward/mean", "reward/accuracy", "actor/kl")


class Progress:
    """Progress bar with ETA over iterations (tqdm), with a few metrics as postfix.

    ``update(metrics)`` advances one iteration and shows ``keys`` present in ``metrics``
    (floats to 3 decimals). With ``enable=False`` nothing is printed.
    """

    def __init__(
        self,
        total: int,
        desc: str,
        enable: bool = True,
        initial: int = 0,
        keys: Sequence[str] = DEFAULT_PROGRESS_KEYS,
    ):
        self.keys = tuple(keys)
        self._n = int(initial)
        self._bar = tqdm(total=total, desc=desc, initial=initial, disable=not enable, dynamic_ncols=True)

    @property
    def n(self) -> int:
        """Iterations counted so far (including ``initial``), also when disabled."""
        return self._n

    def update(self, metrics: Mapping[str, Any] | None = None) -> None:
        """Advance by one iteration and refresh the postfix from ``metrics``."""
        if metrics:
            postfix = {}
            for key in self.keys:
                if key in metrics and metrics[key] is not None:
                    value = metrics[key]
                    is_float = isinstance(value, numbers.Real) and not isinstance(value, numbers.Integral)
                    postfix[key] = f"{value:.3f}" if is_float else str(value)
            if postfix:
                self._bar.set_postfix(postfix, refresh=False)
        self._n += 1
        self._bar.update(1)

    def close(self) -> None:
        self._bar.close()

    def __enter__(self) -> Progress:
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None) -> None:
        self.close()
