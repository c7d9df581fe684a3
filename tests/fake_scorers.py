"""Fake reward scorers for runs whose reward stage is another process (``algorithm.scorer=fake_scorers:...``).

A random tiny model never writes a well-formed answer, so the real verifier would give every
sample 0 and no gradient; these fakes stand in for it. The tests put this folder on the
workers' ``PYTHONPATH``; in-process tests import it directly (tests/ is on ``sys.path``).
"""

from __future__ import annotations

import os
import random
import signal
import zlib


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
    """Fake: scores as ``FakeHashScorer``, but SIGKILLs its own process on the first batch that
    comes after ``FAKE_KILL_AFTER_ROWS`` (environment) scored rows: with a multiple of the rows
    per iteration, at the start of scoring an iteration, its rollout done, its actor not."""

    def __init__(self, **kw):
        super().__init__(**kw)
        self.scored = 0

    def score(self, responses, ground_truths):
        if self.scored >= int(os.environ["FAKE_KILL_AFTER_ROWS"]):
            os.kill(os.getpid(), signal.SIGKILL)
        self.scored += len(responses)
        return super().score(responses, ground_truths)
