"""The advantage estimators' registry: ``algorithm.adv_estimator`` names one entry of ``ESTIMATORS``.

An entry says what the config rules need to know of an estimator (does it compare the responses
to one prompt, does it read the critic's values, does it score per-token rewards) and names its
function by import path (``module:function``), as the stage table names its loops: the config
checks names and properties at load without importing torch, and the advantage stage imports the
function where it runs (``dockrl.algorithms.advantages.compute_advantages``). Adding an estimator
is its function plus one entry here (and its name in ``AdvEstimator``, for mypy;
``tests/algorithms/test_estimators.py`` keeps the two equal).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Literal

from dockrl.process.imports import import_object

AdvEstimator = Literal["grpo", "rloo", "reinforce_plus_plus", "gae", "dr_grpo"]
"""The built-in estimators' names, for mypy: ``ESTIMATORS``' keys."""


@dataclass(frozen=True, kw_only=True)
class Estimator:
    """One advantage estimator: its function and the properties the config rules read."""

    function: str
    """``module:function`` of ``(cfg: AlgorithmConfig, inputs: AdvantageInputs) -> (advantages, returns)``
    (``dockrl.algorithms.advantages``), each ``(B, T)`` float32 and 0 on padding."""
    grouped: bool = False
    """It compares the responses to one prompt: ``rollout.n`` must be at least 2."""
    needs_values: bool = False
    """It reads the critic's values: it needs ``critic.enable``, and the critic serves it alone."""
    token_rewards: bool = False
    """It scores per-token rewards (the outcome at the last token, minus ``algorithm.kl_in_reward_coef`` × KL)."""

    def load(self) -> Callable[..., Any]:
        """The function ``function`` names, imported.

        Raises:
            ImportError, AttributeError: it does not import.
        """
        return import_object(self.function)


_ADVANTAGES = "dockrl.algorithms.advantages"

ESTIMATORS: dict[str, Estimator] = {
    "grpo": Estimator(function=f"{_ADVANTAGES}:grpo_estimator", grouped=True),
    "rloo": Estimator(function=f"{_ADVANTAGES}:rloo_estimator", grouped=True),
    "reinforce_plus_plus": Estimator(function=f"{_ADVANTAGES}:reinforce_plus_plus_estimator", token_rewards=True),
    "gae": Estimator(function=f"{_ADVANTAGES}:gae_estimator", needs_values=True, token_rewards=True),
    "dr_grpo": Estimator(function=f"{_ADVANTAGES}:dr_grpo_estimator", grouped=True),
}
"""Every advantage estimator by its ``algorithm.adv_estimator`` name."""


def estimator_names(**properties: bool) -> str:
    """The names of the estimators with ``properties`` (all when none are given), quoted, as ``'a', 'b' or 'c'``."""
    names = [repr(n) for n, e in ESTIMATORS.items() if all(getattr(e, k) == v for k, v in properties.items())]
    return names[0] if len(names) == 1 else f"{', '.join(names[:-1])} or {names[-1]}"
