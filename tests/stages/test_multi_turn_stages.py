"""The stages after a multi-turn rollout, hand-computed: the reward scores the last model turn and
adds the environment's turn rewards; the advantages, the outcome reward's place and GAE skip the
observation tokens (``loss_mask``); the config refuses what a multi-turn rollout cannot run with."""

from __future__ import annotations

import pytest
import torch

from dockrl.algorithms import gae, response_mask, token_rewards
from dockrl.config import AlgorithmConfig, Config, ConfigError, DockConfig, load_config
from dockrl.dock import GRPO_SCHEMA, open_dock
from dockrl.rewards import RewardScorer
from dockrl.stages.advantage import AdvantageWorker
from dockrl.stages.reward import RewardWorker


class FakeTokenizer:
    """Fake tokenizer: token id k decodes to ``texts[k]``, the texts of a row's tokens joined."""

    def __init__(self, texts: dict[int, str]) -> None:
        self.texts = texts

    def batch_decode(self, ids, skip_special_tokens=True):
        return ["".join(self.texts[t] for t in row) for row in ids]


def test_reward_scores_the_last_model_turn_plus_the_turn_rewards():
    # row 0: turn "#### 3" (tool call), observation, turn "#### 7" (the answer); row 1: one turn "#### 3"
    texts = {1: "#### 3", 2: "<obs>", 3: "#### 7"}
    dock = open_dock(DockConfig(timeout_s=5), GRPO_SCHEMA, run="test")
    dock.open_iteration(0, 2, 2)
    dock.put(range(2), {"prompt_ids": [[9], [9]], "ground_truth": ["7", "7"]})
    dock.put(range(2), {"response_ids": [[1, 2, 2, 3], [1]], "turn_starts": [[0, 3], [0]], "turn_ends": [[1, 4], [1]],
                        "turn_rewards": [[0.25, 0.5], [0.25]]})
    with RewardScorer(timeout_s=5) as scorer:
        m = RewardWorker(scorer, FakeTokenizer(texts), correct_reward=1.0, multi_turn=True).run_iteration(dock)
    got = dock.get(["rm_score", "correct"], range(2)).to_pydict()
    # the verifier: 1.1 for a correct answer in the format, 0.1 for the format alone; plus Σ turn rewards
    assert got["rm_score"] == pytest.approx([1.1 + 0.75, 0.1 + 0.25])
    assert got["correct"] == [True, False]  # row 0's first turn "#### 3" is a tool call, not its answer
    assert m["reward/env_mean"] == pytest.approx(0.5) and m["reward/verifier_mean"] == pytest.approx(0.6)
    dock.close()


def test_advantages_are_zero_on_observations_and_gae_skips_them():
    dock = open_dock(DockConfig(timeout_s=5), GRPO_SCHEMA, run="test")
    dock.open_iteration(0, 2, 2)
    dock.put(range(2), {"prompt_ids": [[9], [9]], "response_ids": [[1, 2, 2, 3], [1, 3]], "loss_mask": [[1, 0, 0, 1], [1, 1]],
                        "rm_score": [1.0, 0.0], "values": [[0.5, 9.0, 9.0, 0.25], [0.5, 0.5]]})
    AdvantageWorker(AlgorithmConfig(adv_estimator="grpo"), multi_turn=True).run_iteration(dock)
    adv = dock.get(["advantages"], range(2)).column("advantages").to_pylist()
    assert adv[0][1] == adv[0][2] == 0.0 and adv[0][0] == adv[0][3] > 0 and adv[1][0] == adv[1][1] < 0
    dock.close()
    # GAE, γ = λ = 1, hand-computed: the reward sits on token 3 (the last sampled one), the values of
    # the observation tokens 1-2 (9.0) are never read: A_3 = 1 - 0.25, A_0 = 1 - 0.5
    mask = response_mask([4], 4, [[1, 0, 0, 1]])
    assert mask.tolist() == [[1.0, 0.0, 0.0, 1.0]]
    rewards = token_rewards(torch.tensor([1.0]), mask)
    assert rewards.tolist() == [[0.0, 0.0, 0.0, 1.0]]
    adv, returns = gae(rewards, torch.tensor([[0.5, 9.0, 9.0, 0.25]]), mask, 1.0, 1.0)
    assert adv.tolist() == [[0.5, 0.0, 0.0, 0.75]] and returns.tolist() == [[1.0, 0.0, 0.0, 1.0]]


def test_response_mask_names_a_row_whose_loss_mask_does_not_fit():
    with pytest.raises(ValueError, match="row 1 has 2 tokens but a loss_mask of 3"):
        response_mask([1, 2], 3, [[1], [1, 0, 1]])


@pytest.mark.parametrize("overrides, field", [
    (["rollout.max_turns=0"], "rollout.max_turns"),
    (["rollout.max_turns=3"], "rollout.max_turns"),  # no environment
    (["rollout.max_total_tokens=-1"], "rollout.max_total_tokens"),
    (["rollout.max_total_tokens=64"], "rollout.max_total_tokens"),  # no environment
    (["env.name=calculator", "rollout.partial_tokens=8", "dock.mode=distributed", "dock.max_inflight=2"], "rollout.partial_tokens"),
    (["env.name=calculator", "algorithm.overlong_buffer.enable=true"], "algorithm.overlong_buffer.enable"),
])
def test_config_refuses_what_a_multi_turn_rollout_cannot_run_with(overrides, field):
    with pytest.raises(ConfigError, match=f"^{field}: got"):
        load_config(None, overrides)


def test_a_multi_turn_config_loads():
    cfg = load_config(None, ["env.name=calculator", "rollout.max_turns=4", "rollout.max_total_tokens=512"])
    assert isinstance(cfg, Config) and cfg.rollout.max_turns == 4 and cfg.rollout.max_total_tokens == 512
