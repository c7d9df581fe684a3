"""Fake user environments for ``env.name=fake_user_envs:...`` (tests/envs/ is on ``sys.path`` in the
tests, and a spawned process inherits it): each stands for one way a user's environment behaves."""

from __future__ import annotations

import os
import time

from dockrl.envs.base import Step


class FakeEchoEpisode:
    def __init__(self, truth: str) -> None:
        self.truth, self.turns = truth, 0

    def step(self, turn: str) -> Step:
        self.turns += 1
        if "hang" in turn:
            time.sleep(60)
        if "raise" in turn:
            raise RuntimeError("the fake environment raised on purpose")
        if "die" in turn:
            os._exit(3)
        if "wrong" in turn:
            return "not a Step"  # type: ignore[return-value]
        done = "answer" in turn
        return Step(observation=None if done else f"echo {turn} (turn {self.turns}, truth {self.truth}, pid {os.getpid()})",
                    reward=1.0 if done else 0.0, done=done, tool_calls=int(not done))

    def calls_end(self, turn: str) -> int | None:
        """A turn's call ends at its first ``;``."""
        return turn.index(";") + 1 if ";" in turn else None

    def close(self) -> None:
        pass


class FakeEchoEnvironment:
    """Fake: echoes each turn with the turn number, the ground truth and its process id; a turn holding
    ``hang`` sleeps a minute, ``raise`` raises, ``die`` exits the process, ``wrong`` returns no Step; a turn's
    call ends at its first ``;`` (``calls_end``)."""

    tools = [{"type": "function", "function": {"name": "echo", "parameters": {"type": "object", "properties": {}}}}]

    def open(self, ground_truth: str) -> FakeEchoEpisode:
        return FakeEchoEpisode(ground_truth)

    def close(self) -> None:
        pass


class FakeBrokenEnvironment:
    """Fake: its constructor raises."""

    def __init__(self) -> None:
        raise ValueError("the fake environment cannot be built")
