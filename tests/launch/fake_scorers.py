"""Fake reward scorers for runs whose reward stage is another process (``algorithm.scorer=fake_scorers:...``).

A random tiny model never writes a well-formed answer, so the real verifier would give every
sample 0 and no gradient; these fakes stand in for it. The test puts this folder on the
workers' ``PYTHONPATH``.
"""

from __future__ import annotations

import random


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
