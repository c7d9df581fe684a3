"""``RewardScorer``: the built-in rule reward (``dockrl.rewards.math_verifier.score_response``) scored in
worker processes, so a hung verifier costs at most ``timeout_s`` seconds per sample and never blocks
later samples.
"""

from __future__ import annotations

import functools
import multiprocessing
import os
import time
from collections.abc import Callable, Sequence
from concurrent.futures import Future, ProcessPoolExecutor
from concurrent.futures import TimeoutError as FutureTimeout
from concurrent.futures.process import BrokenProcessPool
from types import TracebackType

from dockrl.process.lifeline import guard_pool_worker
from dockrl.rewards.math_verifier import score_response

# longest a fresh verifier worker may take to start (an interpreter, sympy imports), seconds: generous, a
# loaded machine took over 60 s
_START_TIMEOUT_S = 180.0


class RewardScorer:
    """Scores batches of ``(response, ground_truth)`` in worker processes, with a per-sample timeout.

    Each sample is one task in a :class:`~concurrent.futures.ProcessPoolExecutor` using the
    ``spawn`` start method: fresh interpreters that talk to this process over pipes only, so
    they never inherit the trainer's CUDA context or thread locks, as ``fork`` would, and no
    socket listens for them. Not ``forkserver``: before Python 3.14 its server unpickles
    whatever reaches its Unix socket in the temporary folder, and a program of the same user
    (a model-written one in the sandbox, ``dockrl.isolation.sandbox``) could run code through it.
    A script that creates a scorer needs an ``if __name__ == "__main__":`` guard.

    A sample whose verifier runs longer than ``timeout_s`` seconds scores 0.0 and counts in
    ``timeouts``; one that raises (or crashes its worker) scores 0.0 and counts in ``errors``.
    On a timeout, the pool's processes are killed, the pool is replaced and the unfinished
    samples are resubmitted, so a call returns within about ``timeout_s`` per hung sample
    plus normal work. Use as a context manager or call :meth:`close`.
    """

    def __init__(
        self,
        *,
        timeout_s: float = 5.0,
        correct_reward: float = 1.0,
        format_reward: float = 0.1,
        num_workers: int = 1,
        verify_fn: Callable[[str, str], float] | None = None,
    ) -> None:
        """Args: ``timeout_s`` > 0 seconds per sample; ``num_workers`` >= 1 processes;
        ``verify_fn(response, ground_truth) -> reward`` must be picklable (module-level or a
        ``functools.partial`` of one); default :func:`score_response` with the rewards bound.

        Raises:
            ValueError: ``timeout_s <= 0`` or ``num_workers < 1``.
        """
        if timeout_s <= 0 or num_workers < 1:
            raise ValueError(f"RewardScorer: need timeout_s > 0 and num_workers >= 1, got {timeout_s}, {num_workers}")
        self.timeout_s = float(timeout_s)
        self.num_workers = int(num_workers)
        self.verify_fn = verify_fn or functools.partial(score_response, correct_reward=correct_reward, format_reward=format_reward)
        self._counts = {"timeouts": 0, "errors": 0, "scored": 0}
        self._pool: ProcessPoolExecutor | None = None

    def _get_pool(self) -> ProcessPoolExecutor:
        """The worker pool, started and warm: per-sample clocks never include a worker's start-up.

        Raises:
            TimeoutError: the workers did not start within ``_START_TIMEOUT_S`` seconds.
        """
        if self._pool is None:
            ctx = multiprocessing.get_context("spawn")  # no listening socket (class docstring)
            # the workers exit with this process, even when it is SIGKILLed (else they and the
            # resource tracker live on, waiting on their task queue)
            self._pool = ProcessPoolExecutor(max_workers=self.num_workers, mp_context=ctx,
                                             initializer=guard_pool_worker, initargs=(os.getpid(),))
            try:  # the verifier itself, so its module is imported too (a worker unpickles it on first use)
                for ready in [self._pool.submit(self.verify_fn, "#### 1", "1") for _ in range(self.num_workers)]:
                    ready.result(timeout=_START_TIMEOUT_S)
            except FutureTimeout:
                self._kill_pool()
                raise TimeoutError(
                    f"RewardScorer: {self.num_workers} verifier worker processes did not start within {_START_TIMEOUT_S:.0f} s"
                ) from None
        return self._pool

    def _kill_pool(self) -> None:
        """Kill the workers (a hung one ignores shutdown) and drop the pool."""
        pool, self._pool = self._pool, None
        if pool is None:
            return
        processes = list((getattr(pool, "_processes", None) or {}).values())  # private, stable since 3.8
        for proc in processes:
            proc.kill()
        pool.shutdown(wait=False, cancel_futures=True)
        for proc in processes:
            proc.join(timeout=1.0)

    def score(self, responses: Sequence[str], ground_truths: Sequence[str]) -> list[float]:
        """Rewards of ``responses[i]`` against ``ground_truths[i]``, in order.

        Raises:
            ValueError: the two sequences differ in length.
        """
        if len(responses) != len(ground_truths):
            raise ValueError(f"RewardScorer.score: {len(responses)} responses but {len(ground_truths)} ground truths")
        rewards = [0.0] * len(responses)
        pending = list(range(len(responses)))
        while pending:
            pool = self._get_pool()
            futures: dict[int, Future[float]] = {i: pool.submit(self.verify_fn, responses[i], ground_truths[i]) for i in pending}
            started = time.monotonic()  # sample k's clock starts once samples before it are done
            for pos, i in enumerate(pending):
                try:
                    rewards[i] = float(futures[i].result(timeout=max(0.0, started + self.timeout_s - time.monotonic())))
                    self._counts["scored"] += 1
                except FutureTimeout:
                    self._counts["timeouts"] += 1
                    self._kill_pool()
                    pending = pending[pos + 1 :]
                    break
                except BrokenProcessPool:  # a worker died (e.g. segfault); blame this sample
                    self._counts["errors"] += 1
                    self._kill_pool()
                    pending = pending[pos + 1 :]
                    break
                except Exception:  # noqa: BLE001 - a raising verifier scores 0.0
                    self._counts["errors"] += 1
                started = time.monotonic()
            else:
                pending = []
        return rewards

    def counters(self) -> dict[str, int]:
        """Cumulative ``{'timeouts': n, 'errors': n, 'scored': n}`` over all :meth:`score` calls."""
        return dict(self._counts)

    def close(self) -> None:
        """Shut the worker pool down; the scorer restarts one if used again."""
        if self._pool is not None:
            self._pool.shutdown(wait=True, cancel_futures=True)
            self._pool = None

    def __enter__(self) -> RewardScorer:
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None) -> None:
        self.close()
