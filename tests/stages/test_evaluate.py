"""The evaluation of a run with an environment runs the rollout's multi-turn loop greedily and
scores the last model turn of each trajectory (``dockrl.stages.evaluate``)."""

from __future__ import annotations

import pytest
from fake_envs import FakeScriptedToolEnvironment, ending_model

from dockrl.config import load_config
from dockrl.engines.hf.rollout import HFRolloutEngine
from dockrl.run.data import Prompt
from dockrl.stages.evaluate import evaluate, multi_turn_accuracy
from dockrl.stages.multi_turn import TurnLimits

QUESTIONS = ["Tom has 3 apples. How many apples?", "Sara has 12 coins and gets 4 more.", "Ali has 7 cards.", "Mia has 2 books."]


class FakeRecordingScorer:
    """Fake: 1.0 for a text of odd length, 0.0 else; keeps every text and ground truth it was given."""

    def __init__(self) -> None:
        self.seen: list[tuple[str, str]] = []

    def score(self, responses, ground_truths):
        self.seen += list(zip(responses, ground_truths))
        return [float(len(r) % 2) for r in responses]


@pytest.fixture(scope="module")
def engine(tiny_model_dir, tmp_path_factory):
    return HFRolloutEngine(ending_model(tiny_model_dir, tmp_path_factory.mktemp("ending-model")), dtype="float32")


def prompts_of(tokenizer) -> list[Prompt]:
    return [Prompt(i, q, str(i), tokenizer.apply_chat_template([{"role": "user", "content": q}], add_generation_prompt=True,
                                                              tokenize=True, return_dict=False)) for i, q in enumerate(QUESTIONS)]


def test_multi_turn_evaluation_scores_the_last_turn_of_greedy_trajectories(engine):
    prompts, limits = prompts_of(engine.tokenizer), TurnLimits(max_turns=3, max_turn_tokens=16)
    env, scorer = FakeScriptedToolEnvironment(), FakeRecordingScorer()
    res = multi_turn_accuracy(engine, prompts, scorer, env, limits, correct_reward=1.0, batch_size=4)
    episodes = {e.ground_truth: e for e in env.episodes}
    assert len(episodes) == len(prompts) and all(e.closed for e in episodes.values())
    turns = [len(episodes[p.ground_truth].turns) for p in prompts]  # turns the environment saw (a cut turn is not stepped)
    assert max(turns) >= 2, "no trajectory of several turns: the last turn would be the only one"
    # the scorer got each trajectory's last model turn: the last the environment saw, or one cut at its budget it never saw
    assert [truth for _, truth in scorer.seen] == [p.ground_truth for p in prompts]
    seen = [(text, episodes[truth].turns) for text, truth in scorer.seen]
    assert any(turns and text == turns[-1] for text, turns in seen)
    assert all((turns and text == turns[-1]) or text not in turns for text, turns in seen)
    assert res["accuracy"] == sum(len(t) % 2 for t, _ in scorer.seen) / len(prompts) and res["count"] == len(prompts)
    assert res["tool_calls_mean"] == pytest.approx(sum(turns) / len(prompts))  # the fake counts one call per turn it saw
    assert 1 <= res["turns_mean"] <= 3
    # greedy: the same trajectories again
    again = FakeRecordingScorer()
    assert multi_turn_accuracy(engine, prompts, again, FakeScriptedToolEnvironment(), limits, correct_reward=1.0, batch_size=2) == res
    assert again.seen == scorer.seen


def test_evaluate_with_an_environment_reports_turns_and_tool_calls(engine, tiny_model_dir):
    cfg = load_config(None, [f"model.path={tiny_model_dir}", "env.name=calculator", "rollout.max_turns=3",
                             "rollout.max_response_length=16", "algorithm.correct_reward=1.0"])
    prompts = prompts_of(engine.tokenizer)
    single = evaluate(engine, prompts, FakeRecordingScorer(), cfg, "before")
    assert set(single) == {"eval/accuracy_before", "eval/format_rate_before"}
    multi = evaluate(engine, prompts, FakeRecordingScorer(), cfg, "after", FakeScriptedToolEnvironment())
    assert set(multi) == {"eval/accuracy_after", "eval/format_rate_after", "eval/turns_mean_after", "eval/tool_calls_mean_after",
                          "eval/tool_errors_mean_after", "eval/tool_calls_right_mean_after"}
    assert multi["eval/turns_mean_after"] >= 1
