"""Every reward scorer under one timeout, and its rewards checked: a custom scorer in a process of its own.

``algorithm.scorer`` (``module:Class``) names a user's scorer. ``ScorerProcess`` builds it in
a child process (``spawn``) and calls its ``score`` there, so a scorer that hangs costs at most
``algorithm.reward_timeout_s`` per sample of the batch: past that, the child is killed, the
batch scores 0 and counts as timed out, and the next batch starts a fresh child. A scorer that
raises fails the run with its traceback, naming ``algorithm.scorer``. The child exits with
its owner, even when the owner is SIGKILLed (``dockrl.process.lifeline.guard_pool_worker``).

``check_rewards`` turns what a scorer returned into one float per response: a value that is
not a finite real number (NaN, inf, a string, None), and every value of a result that is not
a sequence of the right length, becomes 0.0 and is counted as bad, with the reason. The reward
stage (``dockrl.stages.reward``) fails the run once more than ``algorithm.max_bad_reward_frac``
of an iteration's rewards were bad (timed out, failed, or not finite numbers).
"""

from __future__ import annotations

import inspect
import logging
import math
import numbers
from collections import Counter
from typing import Any, Protocol, Sequence

from dockrl.config import AlgorithmConfig, ConfigError
from dockrl.isolation.user_code import START_TIMEOUT_S, ChildDied, ChildRaised, UserProcess
from dockrl.process.imports import import_object
from dockrl.rewards.scorer import RewardScorer

logger = logging.getLogger(__name__)

class ScorerError(RuntimeError):
    """The reward scorer failed the run (raised, or gave too many bad rewards); names ``algorithm.scorer``."""


class _ScorerServer:
    """The child's side: the scorer."""

    def __init__(self, scorer: Any) -> None:
        self.scorer = scorer

    def hello(self) -> None:
        return None

    def handle(self, op: str, args: tuple) -> Any:
        if op == "score":
            out = self.scorer.score(*args)
            return list(out) if isinstance(out, (list, tuple)) else out
        if op == "counters":
            return dict(self.scorer.counters())
        raise ValueError(f"unknown request {op!r}")

    def close(self) -> None:
        self.scorer.close()


class ScorerProcess:
    """A custom scorer (``module:Class``, built with ``kwargs``) run in a child process, with the
    scorer protocol (``score``, ``counters``, ``close``) of ``dockrl.rewards.RewardScorer``.

    Args:
        path: ``algorithm.scorer``.
        kwargs: the constructor's keyword arguments (``timeout_s``, ``correct_reward``, ``format_reward``).
        timeout_s: ``algorithm.reward_timeout_s``: a batch of n samples may take ``n × timeout_s`` seconds.

    ``counters()`` adds this process's ``timeouts`` (samples of batches that ran out of time)
    to the scorer's own counters.
    """

    def __init__(self, path: str, kwargs: dict, *, timeout_s: float) -> None:
        self.path, self.kwargs, self.timeout_s = path, dict(kwargs), float(timeout_s)
        self._child: UserProcess | None = None  # None: not started, or killed (the next score starts a fresh one)
        self._timeouts = 0
        self._last_counters: dict[str, int] = {}

    def start(self) -> None:
        """Start the scorer's process and build the scorer, if not running (``score`` does it when needed).

        Raises:
            ScorerError: the scorer does not build (its traceback in the message) within ``START_TIMEOUT_S``.
        """
        if self._child is None:
            self._start()

    def _start(self) -> None:
        self._child = child = UserProcess(self.path, self.kwargs, _ScorerServer, name=f"dockrl-scorer {self.path}")
        if not child.wait(START_TIMEOUT_S):
            self._kill()
            raise ScorerError(f"algorithm.scorer={self.path!r}: its process did not build the scorer within {START_TIMEOUT_S:.0f} s")
        self._answer("start")

    def _answer(self, what: str) -> Any:
        assert self._child is not None, "the scorer's process runs"
        try:
            return self._child.answer()
        except ChildDied as e:
            self._child = None  # killed: the next score starts a fresh one
            raise ScorerError(f"algorithm.scorer={self.path!r}: its process died during {what} (exit code {e.args[0]})") from None
        except ChildRaised as e:
            raise ScorerError(f"algorithm.scorer={self.path!r} raised during {what}:\n{e.args[0]}") from None

    def _kill(self) -> None:
        child, self._child = self._child, None
        if child is not None:
            child.kill()

    def score(self, responses: Sequence[str], ground_truths: Sequence[str]) -> Any:
        """What the scorer returns for the batch (checked by ``check_rewards``), or ``[0.0] * n``
        when it ran longer than ``n × timeout_s`` (its process is killed; counted in ``timeouts``).

        Raises:
            ScorerError: the scorer raised (its traceback in the message) or its process died.
        """
        n = len(responses)
        if n == 0:
            return []
        self.start()
        limit = self.timeout_s * max(1, n)
        assert self._child is not None, "started above"
        self._child.request("score", (list(responses), list(ground_truths)))
        if not self._child.wait(limit):
            self._kill()
            self._timeouts += n
            logger.warning("algorithm.scorer=%r: a batch of %d responses took longer than %.0f s (algorithm.reward_timeout_s="
                           "%g per response): scored 0, its process restarted", self.path, n, limit, self.timeout_s)
            return [0.0] * n
        return self._answer("score")

    def counters(self) -> dict[str, int]:
        """The scorer's counters (as last read, when its process was restarted) plus this process's ``timeouts``."""
        if self._child is not None:
            self._child.request("counters", ())
            self._last_counters = {k: int(v) for k, v in self._answer("counters").items()}
        out = {"timeouts": 0, "errors": 0, "scored": 0} | self._last_counters
        out["timeouts"] += self._timeouts
        return out

    def close(self) -> None:
        """Close the scorer and stop its process. Safe to call twice."""
        child, self._child = self._child, None
        if child is not None:
            child.close(10)


def _real(value: Any) -> float | None:
    """``value`` as a finite float, or None when it is not a finite real number (bools are not rewards)."""
    if isinstance(value, bool):
        return None
    if not isinstance(value, numbers.Real) and hasattr(value, "item") and getattr(value, "ndim", 0) == 0:
        value = value.item()  # a 0-d numpy array or torch tensor
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        return None
    value = float(value)
    return value if math.isfinite(value) else None


def check_rewards(result: Any, n: int) -> tuple[list[float], Counter]:
    """One float per response from what a scorer returned for ``n`` responses.

    Returns:
        The rewards (bad ones replaced by 0.0) and the count of bad ones by reason
        (``nan``, ``inf``, ``str``, ``NoneType``, … ; ``wrong count`` for every value of a
        result that is not a sequence of ``n`` values).
    """
    if isinstance(result, (str, bytes)) or not isinstance(result, Sequence) or len(result) != n:
        got = f"{len(result)} values" if isinstance(result, Sequence) and not isinstance(result, (str, bytes)) else type(result).__name__
        return [0.0] * n, Counter({f"wrong count (a {got} result for {n} responses)": n})
    rewards, bad = list[float](), Counter[str]()
    for value in result:
        real = _real(value)
        if real is None:
            try:
                reason = "nan" if math.isnan(value) else "inf" if math.isinf(value) else type(value).__name__
            except TypeError:
                reason = type(value).__name__
            bad[reason if not isinstance(value, bool) else "bool"] += 1
            real = 0.0
        rewards.append(real)
    return rewards, bad


class Scorer(Protocol):
    """What the reward stage and the evaluation call: ``RewardScorer`` or ``ScorerProcess``."""

    def score(self, responses: Sequence[str], ground_truths: Sequence[str]) -> Any: ...
    def counters(self) -> dict[str, int]: ...
    def close(self) -> None: ...


def build_scorer(a: AlgorithmConfig, sandbox_backend: str = "local") -> Scorer:
    """The reward scorer: ``algorithm.scorer`` (``module:Class``) if set, else the GSM8K rule verifier.

    A custom scorer runs in a process of its own under ``algorithm.reward_timeout_s`` per
    sample (``ScorerProcess``); the built-in verifier times each sample itself. A scorer whose class takes
    ``sandbox_backend`` (one that runs programs, as ``dockrl.rewards.code.CodeScorer``) is built with
    ``sandbox_backend`` (``env.sandbox.backend``).

    Raises:
        ConfigError: ``algorithm.scorer`` names no importable class (the import's error appended).
    """
    kwargs: dict[str, Any] = dict(timeout_s=a.reward_timeout_s, correct_reward=a.correct_reward, format_reward=a.format_reward)
    if not a.scorer:
        return RewardScorer(timeout_s=a.reward_timeout_s, correct_reward=a.correct_reward, format_reward=a.format_reward)
    try:
        cls = import_object(a.scorer)  # here, so a typo fails before any process starts
    except (ImportError, AttributeError) as e:
        raise ConfigError(f"algorithm.scorer: got {a.scorer!r}, which does not import ({type(e).__name__}: {e}); "
                          "expected 'package.module:Class' importable here (and in every worker: PYTHONPATH)") from e
    try:
        takes_backend = "sandbox_backend" in inspect.signature(cls).parameters
    except (TypeError, ValueError):  # a class whose signature Python cannot read takes the three arguments only
        takes_backend = False
    if takes_backend:
        kwargs["sandbox_backend"] = sandbox_backend
    elif sandbox_backend != "local":
        logger.warning("env.sandbox.backend=%s: algorithm.scorer=%r takes no sandbox_backend, so whatever it runs runs its own way",
                       sandbox_backend, a.scorer)
    return ScorerProcess(a.scorer, kwargs, timeout_s=a.reward_timeout_s)
