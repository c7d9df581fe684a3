"""Fake reward scorers for runs whose reward stage is another process (``algorithm.scorer=fake_scorers:...``).

A random tiny model never writes a well-formed answer, so the real verifier would give every
sample 0 and no gradient; these fakes stand in for it. The tests put this folder on the
workers' ``PYTHONPATH``; in-process tests import it directly (tests/ is on ``sys.path``).
"""

from __future__ import annotations

import math
import multiprocessing
import os
import random
import signal
import time
import zlib

from dockrl.config.env_sections import SandboxConfig
from dockrl.isolation.runner import run_program


class FakeRandomScorer:
    """Fake: seeded random rewards from {0, 0.1, 1.1}, so every group is likely to carry signal."""

    def __init__(self, **_):
        self.rng = random.Random(0)

    def score(self, responses, ground_truths):
        return [self.rng.choice([0.0, 0.1, 1.1]) for _ in responses]

    def counters(self):
        return {"timeouts": 0, "errors": 0, "scored": 0}

    def close(self):
        pass


class FakeDigitScorer(FakeRandomScorer):
    """Fake: a reward the tiny random model learns to please within a few iterations at a high
    learning rate: the fraction of the response's characters that are digits (0 for an empty
    response). Dense (every response scores between 0 and 1) and independent of the prompt, so a
    shift of the output distribution towards the digit tokens earns it (``tests/learning.py``)."""

    def score(self, responses, ground_truths):
        return [sum(c.isdigit() for c in r) / len(r) if r else 0.0 for r in responses]


class FakeProgramDigitScorer(FakeRandomScorer):
    """Fake: ``FakeDigitScorer``'s reward, computed by a program run in the sandbox for each response (the response its
    stdin), where ``env.sandbox.backend`` says (``dockrl.isolation.runner.run_program``): a run's rewards, and so what it
    learns, depend on every program's result coming back whole from wherever it ran."""

    PROGRAM = "import sys\ntext = sys.stdin.buffer.read().decode()\nprint(repr(sum(c.isdigit() for c in text) / len(text) if text else 0.0))"

    def __init__(self, sandbox_backend="local", **_):
        super().__init__()
        self.limits = SandboxConfig(backend=sandbox_backend, wall_s=30.0)

    def score(self, responses, ground_truths):
        results = [run_program(self.PROGRAM, self.limits, stdin=r) for r in responses]
        bad = [r for r in results if not r.ok]
        assert not bad, f"a program of the fake scorer failed: {bad[0]}"
        return [float(r.stdout) for r in results]


class FakeCrashingScorer(FakeRandomScorer):
    """Fake: raises on every batch, as a buggy verifier would: the process that scores dies."""

    def score(self, responses, ground_truths):
        raise RuntimeError("fake scorer crash: the verifier blew up")


class FakeHashScorer(FakeRandomScorer):
    """Fake: a reward from a hash of the response text (CRC-32, the same in every process), so a
    resumed run scores a response exactly as the uninterrupted run did."""

    def score(self, responses, ground_truths):
        return [(0.0, 0.1, 1.1)[zlib.crc32(r.encode()) % 3] for r in responses]


class FakeKillingScorer(FakeHashScorer):
    """Fake: scores as ``FakeHashScorer``, but SIGKILLs the reward stage's process (the parent of
    the scorer's own process, where a custom scorer runs) on the first batch that comes after
    ``FAKE_KILL_AFTER_ROWS`` (environment) scored rows: with a multiple of the rows per
    iteration, at the start of scoring an iteration, its rollout done, its actor not."""

    def __init__(self, **kw):
        super().__init__(**kw)
        self.scored = 0

    def score(self, responses, ground_truths):
        if self.scored >= int(os.environ["FAKE_KILL_AFTER_ROWS"]):
            stage = os.getppid() if multiprocessing.parent_process() is not None else os.getpid()
            os.kill(stage, signal.SIGKILL)
            os.kill(os.getpid(), signal.SIGKILL)
        self.scored += len(responses)
        return super().score(responses, ground_truths)


class FakeNaNScorer(FakeRandomScorer):
    """Fake: a NaN for every response, as a scorer dividing by a zero count would."""

    def score(self, responses, ground_truths):
        return [math.nan for _ in responses]


class FakeHangingScorer(FakeRandomScorer):
    """Fake: never returns, as a scorer waiting on a dead service would."""

    def score(self, responses, ground_truths):
        time.sleep(3600)


class FakeStringScorer(FakeRandomScorer):
    """Fake: rewards as strings ("1.1"), as a scorer that parsed a reward model's text answer and forgot float()."""

    def score(self, responses, ground_truths):
        return ["1.1" for _ in responses]


class FakeShortScorer(FakeRandomScorer):
    """Fake: one reward fewer than responses."""

    def score(self, responses, ground_truths):
        return [0.0 for _ in responses][1:]


class FakeMostlyFineScorer(FakeRandomScorer):
    """Fake: one inf among otherwise good rewards (counted, under the default limit)."""

    def score(self, responses, ground_truths):
        return [math.inf, *(1.1 for _ in responses[1:])]


class FakeSolvedScorer(FakeRandomScorer):
    """Fake: every response is correct (1.1), so every group is solved and dynamic sampling filters it out."""

    def score(self, responses, ground_truths):
        return [1.1 for _ in responses]
