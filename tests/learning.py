"""The shared learning harness: a few RL iterations of the tiny random model on a reward it can
learn (``fake_scorers.FakeDigitScorer``), and the reward curve they produce.

``reward_curve`` runs ``driver.train`` in-process and returns ``reward/mean`` per iteration;
``rises`` compares the mean of the last iterations with the first ones. Tests using it are
``@pytest.mark.slow``.
"""

from __future__ import annotations

import json
from pathlib import Path

from fake_scorers import FakeDigitScorer

LEARNING_OVERRIDES = (
    "run.progress=false", "trainer.iterations=6", "trainer.global_batch=4", "trainer.mini_batch=4",
    "trainer.micro_batch=16", "rollout.n=4", "rollout.max_response_length=8", "rollout.temperature=1.0", "run.num_threads=1",
    "rollout.dtype=float32", "trainer.autocast_bf16=false", "trainer.lr=5e-2", "trainer.save_every=0",
    "trainer.eval_before=false", "trainer.eval_after=false", "trainer.seed=0",
    "data.generate_train=64", "data.generate_test=4", "data.eval_size=4",
)
"""Small and fast (16 responses of at most 8 tokens per iteration), a high learning rate, no evaluation."""


def reward_curve(monkeypatch, model_dir: str | Path, out_dir: str | Path, *overrides: str, scorer: type = FakeDigitScorer) -> list[float]:
    """``reward/mean`` of each iteration of ``driver.train`` on ``model_dir`` with ``scorer`` in place
    of the verifier (in-process), under ``LEARNING_OVERRIDES`` then ``overrides``."""
    from dockrl import driver
    from dockrl.config import load_config
    from dockrl.rewards import guard

    monkeypatch.setattr(guard, "RewardScorer", scorer)
    out = Path(out_dir)
    cfg = load_config(None, [f"model.path={model_dir}", f"run.output_dir={out / 'run'}", f"run.cache_dir={out / 'cache'}",
                             *LEARNING_OVERRIDES, *overrides])
    driver.train(cfg)
    lines = [json.loads(x) for x in (out / "run" / "metrics.jsonl").read_text().splitlines()]
    return [x["reward/mean"] for x in lines]


def rises(curve: list[float], k: int = 3, by: float = 0.05) -> bool:
    """The mean of the last ``k`` iterations exceeds the mean of the first ``k`` by more than ``by``."""
    first, last = sum(curve[:k]) / k, sum(curve[-k:]) / k
    return last - first > by
