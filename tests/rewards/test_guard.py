"""Every scorer under one timeout; bad rewards counted and, past algorithm.max_bad_reward_frac, a failed run naming the scorer."""

from __future__ import annotations

import math
import time
from pathlib import Path

import numpy as np
import pytest

from dockrl.config import DockConfig, load_config
from dockrl.dock import GRPO_SCHEMA, open_dock
from dockrl.rewards.guard import ScorerError, ScorerProcess, check_rewards
from dockrl.stages.reward import RewardWorker

FAKES = str(Path(__file__).parents[1])  # tests/fake_scorers.py


def alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


@pytest.fixture(autouse=True)
def fakes_importable(monkeypatch):
    monkeypatch.syspath_prepend(FAKES)


@pytest.mark.parametrize("result, rewards, bad", [
    ([1.0, 0, np.float32(0.5)], [1.0, 0.0, 0.5], {}),
    ([math.nan, math.inf, -math.inf], [0.0, 0.0, 0.0], {"nan": 1, "inf": 2}),
    (["1.1", None, True], [0.0, 0.0, 0.0], {"str": 1, "NoneType": 1, "bool": 1}),
    (np.array([0.1, 0.2, 0.3]), [0.0] * 3, {"wrong count (a ndarray result for 3 responses)": 3}),
    ([1.0, 1.0], [0.0] * 3, {"wrong count (a 2 values result for 3 responses)": 3}),
    ("1.1", [0.0] * 3, {"wrong count (a str result for 3 responses)": 3}),
    (None, [0.0] * 3, {"wrong count (a NoneType result for 3 responses)": 3}),
])
def test_check_rewards_counts_what_is_not_one_finite_number_per_response(result, rewards, bad):
    got, reasons = check_rewards(result, 3)
    assert got == rewards and dict(reasons) == bad


def test_a_hanging_scorer_costs_its_timeout_and_is_restarted():
    scorer = ScorerProcess("fake_scorers:FakeHangingScorer", {}, timeout_s=0.3)
    try:
        scorer.start()  # not timed: a process start and the scorer's imports
        pid = scorer._child.proc.pid
        start = time.monotonic()
        assert scorer.score(["a", "b"], ["1", "2"]) == [0.0, 0.0]
        assert 0.5 < time.monotonic() - start < 5  # 2 × 0.3 s, plus the kill
        assert scorer.counters()["timeouts"] == 2 and not alive(pid)
        assert scorer.score(["c"], ["3"]) == [0.0] and scorer.counters()["timeouts"] == 3  # a fresh process, the same limit
    finally:
        scorer.close()


def test_a_raising_scorer_fails_naming_the_field_and_its_traceback():
    scorer = ScorerProcess("fake_scorers:FakeCrashingScorer", {"timeout_s": 1.0}, timeout_s=1.0)
    try:
        with pytest.raises(ScorerError, match=r"algorithm.scorer='fake_scorers:FakeCrashingScorer' raised during score:\n"
                                              r"(.|\n)*RuntimeError: fake scorer crash: the verifier blew up"):
            scorer.score(["a"], ["1"])
    finally:
        scorer.close()


class FakeTokenizer:
    """Fake tokenizer: every response decodes to its token ids as text."""

    def batch_decode(self, ids, skip_special_tokens=True):
        return [str(row) for row in ids]


def reward_iteration(path: str, **worker):
    dock = open_dock(DockConfig(timeout_s=5), GRPO_SCHEMA, run="test")
    dock.open_iteration(0, 8, 4)
    dock.put(range(8), {"prompt_ids": [[1]] * 8, "ground_truth": ["7"] * 8})
    dock.put(range(8), {"response_ids": [[k] for k in range(8)]})
    scorer = ScorerProcess(path, {}, timeout_s=0.2)
    try:
        return RewardWorker(scorer, FakeTokenizer(), correct_reward=1.0, scorer_name=path, **worker).run_iteration(dock)
    finally:
        scorer.close()
        dock.close()


@pytest.mark.parametrize("path, reason", [
    ("fake_scorers:FakeNaNScorer", "nan: 8"),
    ("fake_scorers:FakeStringScorer", "str: 8"),
    ("fake_scorers:FakeShortScorer", "wrong count (a 3 values result for 4 responses): 8"),
    ("fake_scorers:FakeHangingScorer", "timed out: 8"),
])
def test_an_iteration_of_bad_rewards_fails_naming_the_scorer(path, reason):
    with pytest.raises(ScorerError) as err:
        reward_iteration(path, batch_size=4, max_bad_frac=0.25)
    assert str(err.value).startswith(f"algorithm.scorer={path!r}: 8 of 8 rewards of this iteration were bad ({reason})")
    assert "algorithm.max_bad_reward_frac=0.25" in str(err.value)


def test_a_few_bad_rewards_are_counted_not_fatal():
    m = reward_iteration("fake_scorers:FakeMostlyFineScorer", batch_size=4, max_bad_frac=0.25)
    assert m["reward/invalid"] == 2 and m["reward/mean"] == pytest.approx(1.1 * 6 / 8)


def test_the_limit_is_a_fraction():
    assert load_config(None, ["algorithm.max_bad_reward_frac=0"]).algorithm.max_bad_reward_frac == 0
    with pytest.raises(ValueError, match=r"algorithm.max_bad_reward_frac: got 1.5; expected a fraction from 0 to 1"):
        load_config(None, ["algorithm.max_bad_reward_frac=1.5"])
