"""Fake environments for multi-turn rollouts of the tiny random model, and a tiny model whose turns end.

A random tiny model never writes a tool call, so a real tool environment would answer every turn
with a parse error; ``FakeScriptedToolEnvironment`` answers from a script instead, whatever the
turn says, so trajectories of several turns happen and every token path is exercised. The tests
import it directly (tests/ is on ``sys.path``) or name it by import path
(``fake_envs:FakeScriptedToolEnvironment``) with tests/ on the ``PYTHONPATH``.
"""

from __future__ import annotations

import shutil
from pathlib import Path

from dockrl.envs.base import Step


class FakeScriptedEpisode:
    """Fake episode: model turn k (from 1) gets ``observations[k-1]`` (with the turn number and the
    ground truth appended) and reward ``reward``; the turn after the last observation ends the
    trajectory. Each turn is one tool call, failed when its text holds no digit."""

    def __init__(self, observations: tuple[str, ...], ground_truth: str, reward: float) -> None:
        self.observations, self.ground_truth, self.reward = observations, ground_truth, reward
        self.turns: list[str] = []
        self.closed = False

    def step(self, turn: str) -> Step:
        assert not self.closed, "stepped a closed episode"
        self.turns.append(turn)
        k = len(self.turns)
        error = int(not any(ch.isdigit() for ch in turn))
        if k > len(self.observations):
            return Step(reward=self.reward, done=True, tool_calls=1, tool_errors=error)
        return Step(observation=f"{self.observations[k - 1]} (turn {k}; {self.ground_truth})", reward=self.reward, tool_calls=1,
                    tool_errors=error)

    def close(self) -> None:
        self.closed = True


class FakeScriptedToolEnvironment:
    """Fake tool environment: every episode follows the same script (``FakeScriptedEpisode``); it
    keeps the episodes it opened so a test can read what each saw."""

    tools: list[dict] = []

    def __init__(self, observations: tuple[str, ...] = ("result: 42", "error: name 'x' is not defined"), reward: float = 0.25,
                 **_: object) -> None:
        self.observations, self.reward = tuple(observations), reward
        self.episodes: list[FakeScriptedEpisode] = []
        self.closed = False

    def open(self, ground_truth: str) -> FakeScriptedEpisode:
        episode = FakeScriptedEpisode(self.observations, ground_truth, self.reward)
        self.episodes.append(episode)
        return episode

    def close(self) -> None:
        self.closed = True


EOS_BOOST = 0.5
"""``ending_model``'s extra EOS weight: with it the tiny model's turns end after ~9 tokens at τ = 1 (measured)."""


def ending_model(tiny_model_dir: Path, out: Path) -> Path:
    """The tiny random model with its weights edited so that its turns end at EOS after a few tokens.

    Dimension 0 of every (tied) embedding row is set to 1.0, so the residual stream carries a
    positive constant there and the final norm's output has a large positive component 0 at every
    position; the EOS row gets ``1.0 + EOS_BOOST`` there, which adds a positive logit to EOS alone
    (the constant itself shifts every logit equally). A random model otherwise emits EOS once in
    ~500 tokens, and a multi-turn rollout needs turns that end.
    """
    import torch  # lazy: only the tests that build it pay for the import
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir)
    with torch.no_grad():
        embedding = model.get_input_embeddings().weight
        embedding[:, 0] = 1.0
        embedding[model.config.eos_token_id, 0] = 1.0 + EOS_BOOST
    model.save_pretrained(out)
    for f in Path(tiny_model_dir).iterdir():
        if f.name not in ("model.safetensors", "config.json", "generation_config.json"):
            shutil.copy(f, out / f.name)
    return out
