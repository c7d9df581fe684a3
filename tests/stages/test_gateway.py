"""The agent gateway (``dockrl.stages.gateway``): a two-turn tool agent written against the real ``openai`` client
(``tests/tool_agent.py``) runs as a process per session, through the rollout stage, on the HF and the vLLM engine.
The trained ids are, token for token, the ids the model sampled plus the ids of what the agent inserted (never
re-tokenized), the loss mask is 0 on the agent's text, tool calls come back in the OpenAI format, and an agent that
never ends, crashes, sleeps or edits the conversation fails alone, scored as failed and counted."""

from __future__ import annotations

import json
import shlex
import sys
import time
from pathlib import Path

import openai
import pytest
import torch
from fake_envs import ending_model
from test_multi_turn import RecordingEngine, build_engine

from dockrl import driver
from dockrl.config import DockConfig, RolloutConfig, load_config
from dockrl.dock import GRPO_SCHEMA, open_dock
from dockrl.engines.hf.rollout import HFRolloutEngine
from dockrl.engines.hf.train import HFTrainEngine
from dockrl.engines.rollout_engine import Sample
from dockrl.stages.gateway import AgentGateway, GatewayLimits
from dockrl.stages.multi_turn import ObservationTokens, TurnLimits
from dockrl.stages.reward import RewardWorker
from dockrl.stages.rollout import RolloutWorker

AGENT = [sys.executable, str(Path(__file__).resolve().parents[1] / "tool_agent.py")]
SYSTEM = "Compute with the calculator, then answer as #### <number>."
COLUMNS = ["response_ids", "rollout_log_prob", "loss_mask", "turn_starts", "turn_ends", "truncated", "session_reward"]


class FakeRecordingScorer:
    """Fake scorer: 0.5 for every text; keeps the texts it was given."""

    def __init__(self) -> None:
        self.seen: list[str] = []

    def score(self, responses, ground_truths):
        self.seen += list(responses)
        return [0.5] * len(responses)

    def counters(self) -> dict[str, int]:
        return {"timeouts": 0, "errors": 0}


@pytest.fixture(scope="module")
def model_dir(tiny_model_dir, tmp_path_factory):
    return ending_model(tiny_model_dir, tmp_path_factory.mktemp("ending-model"))


def tasks_of(tok, questions: list[str]) -> tuple[list[list[int]], dict[tuple, dict]]:
    """Each question's prompt ids and task (its chat messages), as the run's prompts render them."""
    prompts, tasks = [], {}
    for q in questions:
        messages = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": q}]
        ids = tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=True, return_dict=False)
        prompts.append(list(ids))
        tasks[tuple(ids)] = {"messages": messages, "tools": []}
    return prompts, tasks


def serve(engine, questions: list[str], group: int, limits: GatewayLimits, tmp_path: Path, monkeypatch) -> tuple[list, list, dict, dict]:
    """One rollout iteration of ``group`` sessions per question through the gateway: the rows, the prompts, the
    agents' transcripts by row and the rollout's metrics."""
    transcripts = tmp_path / "transcripts"
    transcripts.mkdir()
    monkeypatch.setenv("AGENT_TRANSCRIPTS", str(transcripts))
    prompts, tasks = tasks_of(engine.tokenizer, questions)
    prompts = [p for p in prompts for _ in range(group)]
    rows = len(prompts)
    dock = open_dock(DockConfig(timeout_s=5), GRPO_SCHEMA, run="test")
    dock.open_iteration(0, rows, group)
    dock.put(range(rows), {"prompt_ids": prompts, "ground_truth": ["408"] * rows})
    gateway = AgentGateway(engine, AGENT, limits, tool_parser="hermes")
    try:
        cfg = RolloutConfig(n=group, max_response_length=limits.turns.max_turn_tokens, max_turns=limits.turns.max_turns, batch_size=rows)
        metrics = RolloutWorker(engine, cfg, gateway=gateway, tasks=lambda ids: tasks[tuple(ids)]).run_iteration(dock)
    finally:
        gateway.close()
    out = dock.get(COLUMNS, range(rows)).to_pylist()
    by_row = {}
    for f in transcripts.iterdir():
        t = json.loads(f.read_text())
        by_row[int(t["ids"][0].split("-")[1])] = t
    scorer = FakeRecordingScorer()
    RewardWorker(scorer, engine.tokenizer, correct_reward=1.0, sessions=True).run_iteration(dock)
    rewards = dock.get(["rm_score"], range(rows)).column(0).to_pylist()
    return out, prompts, by_row, metrics | {"rm_score": rewards, "scored": scorer.seen}


def check_trained_ids(engine, recording, prompt, row, transcript, observe) -> None:
    """Each turn's trained ids are what the engine sampled from exactly the trained prefix; between two turns lie the
    ids of the agent's inserted messages (after the template's end-of-turn token where a turn was cut at its calls)."""
    ids, starts, ends = row["response_ids"], row["turn_starts"], row["turn_ends"]
    assistant = [k for k, m in enumerate(transcript["messages"]) if m["role"] == "assistant"]
    assert len(starts) == len(assistant) == 2
    for k, (start, end) in enumerate(zip(starts, ends)):
        sample = next(s for c, s in recording.calls if c == prompt + ids[:start] and s.response_ids[:end - start] == ids[start:end])
        assert row["rollout_log_prob"][start:end] == pytest.approx(sample.log_probs[:end - start], abs=1e-6)
        if k == 0:
            cut = len(sample.response_ids) > end - start  # ended at its tool calls: the EOS is the template's
            inserted = transcript["messages"][assistant[0] + 1:assistant[1]]
            template = [{key: m[key] for key in ("role", "content", "tool_call_id") if key in m} for m in inserted]
            assert ids[end:starts[1]] == ([engine.eos_id] if cut else []) + observe.messages(template)
    in_turn = [any(s <= t < e for s, e in zip(starts, ends)) for t in range(len(ids))]
    assert row["loss_mask"] == [int(x) for x in in_turn]  # 0 on every token of the agent's text and the template's


@pytest.mark.parametrize("kind", ["hf", pytest.param("vllm", marks=pytest.mark.slow)])
def test_the_openai_client_drives_a_two_turn_agent_and_the_trained_ids_are_the_sampled_plus_the_inserted(
        kind, model_dir, tmp_path, monkeypatch):
    torch.manual_seed(0)
    engine = build_engine(kind, model_dir)
    try:
        recording = RecordingEngine(engine)
        limits = GatewayLimits(turns=TurnLimits(max_turns=3, max_turn_tokens=64), max_sessions=4)
        questions = ["What is 12 times 34?", "What is 408 plus 0? REWARD"]
        rows, prompts, transcripts, metrics = serve(recording, questions, 2, limits, tmp_path, monkeypatch)
    finally:
        if kind == "vllm":
            engine.close()
    observe = ObservationTokens(engine.tokenizer)
    assert metrics["rollout/sessions"] == 4 and metrics["rollout/sessions_failed"] == 0 and metrics["rollout/turns_mean"] == 2
    for r, (prompt, row) in enumerate(zip(prompts, rows)):
        check_trained_ids(engine, recording, prompt, row, transcripts[r], observe)
        # the agent got the model's text and its log-probs; the posted reward replaces the scorer's
        assert row["session_reward"] == (0.75 if r >= 2 else None) and metrics["rm_score"][r] == pytest.approx(row["session_reward"] or 0.5)
    assert len(metrics["scored"]) == 2  # the scorer saw the two sessions without a posted reward

    # the actor's teacher-forced log-probs of the trained ids equal the rollout's on every sampled token
    actor = HFTrainEngine(model_dir, trainable=False)
    recomputed = actor.log_probs(prompts, [row["response_ids"] for row in rows], temperature=1.0, micro_batch=4)
    for row, lps in zip(rows, recomputed):
        got = [lp for lp, m in zip(row["rollout_log_prob"], row["loss_mask"]) if m]
        want = [lp for lp, m in zip(lps, row["loss_mask"]) if m]
        torch.testing.assert_close(torch.tensor(got), torch.tensor(want), atol=1e-4, rtol=0)


class FakeToolCallingEngine:
    """Fake engine: the real tokenizer, and turns scripted as text: the first a Hermes tool call of the calculator
    followed by more text (so the turn is cut at its call), the second the answer with EOS."""

    def __init__(self, tokenizer, eos_id: int) -> None:
        self.tokenizer, self.eos_id, self.pad_id, self.calls = tokenizer, eos_id, eos_id, []

    def generate(self, prompts, *, max_new_tokens, **_):
        out = []
        for p in prompts:
            first = not any(list(p[:len(c)]) == c for c, _ in self.calls)  # no turn of this session before
            text = ('<tool_call>\n{"name": "calculator", "arguments": {"expression": "12 * 34"}}\n</tool_call> and then more'
                    if first else "#### 408")
            ids = self.tokenizer.encode(text, add_special_tokens=False)[:max_new_tokens] + ([] if first else [self.eos_id])
            sample = Sample(ids, [-0.25] * len(ids), first)
            self.calls.append((list(p), sample))
            out.append(sample)
        return out


def test_tool_calls_come_back_in_the_openai_format_and_the_turn_ends_at_them(model_dir, tmp_path, monkeypatch):
    real = HFRolloutEngine(model_dir, dtype="float32")
    engine = FakeToolCallingEngine(real.tokenizer, real.eos_id)
    limits = GatewayLimits(turns=TurnLimits(max_turns=3, max_turn_tokens=512))  # the tiny tokenizer splits the JSON finely
    rows, prompts, transcripts, metrics = serve(engine, ["What is 12 times 34?"], 1, limits, tmp_path, monkeypatch)
    messages = transcripts[0]["messages"]
    call = messages[2]["tool_calls"][0]
    assert call["type"] == "function" and call["function"]["name"] == "calculator"
    assert json.loads(call["function"]["arguments"]) == {"expression": "12 * 34"}
    assert messages[3] == {"role": "tool", "tool_call_id": call["id"], "content": "408"}  # the agent ran its tool
    assert messages[4]["content"] == "#### 408"
    row = rows[0]
    first = row["response_ids"][row["turn_starts"][0]:row["turn_ends"][0]]
    assert real.tokenizer.decode(first).endswith("</tool_call>")  # cut where the call ends: "and then more" is not trained
    check_trained_ids(engine, engine, prompts[0], row, transcripts[0], ObservationTokens(real.tokenizer))
    assert metrics["rollout/tool_calls_mean"] == 1 and metrics["rollout/sessions_failed"] == 0


def test_misbehaving_agents_fail_alone_scored_as_failed(model_dir, tmp_path, monkeypatch, caplog):
    """An agent that never ends is cut at the session's turns; one that crashes and one that edits the conversation
    fail with why; each is scored ``failed_reward`` and counted, and the well-behaved sessions of the same batch are
    whole."""
    torch.manual_seed(0)
    engine = HFRolloutEngine(model_dir, dtype="float32")
    # turns of up to 64 tokens: the tiny model's end after ~9 (a well-behaved agent's turn cut at its budget would fail it)
    limits = GatewayLimits(turns=TurnLimits(max_turns=3, max_turn_tokens=64, max_total_tokens=4096), failed_reward=-1.0)
    questions = ["What is 1 + 1?", "FOREVER: what is 2 + 2?", "CRASH: what is 3 + 3?", "EDIT: what is 5 + 5?", "What is 6 + 6?"]
    rows, _, transcripts, metrics = serve(engine, questions, 1, limits, tmp_path, monkeypatch)
    assert metrics["rollout/sessions"] == 5 and metrics["rollout/sessions_failed"] == 3
    assert [r["session_reward"] for r in rows] == [None, -1.0, -1.0, -1.0, None]
    assert metrics["rm_score"][1:4] == [-1.0] * 3 and len(metrics["scored"]) == 2
    assert sorted(transcripts) == [0, 4] and all(len(rows[k]["turn_starts"]) == 2 for k in (0, 4))
    forever, crashed, edited = rows[1:4]
    assert forever["truncated"] and len(forever["turn_starts"]) == 3  # cut at its budget: its 4th request was refused
    assert len(crashed["turn_starts"]) == 1 and len(edited["turn_starts"]) == 1
    log = caplog.text
    assert "a request past the session's 3 model turns (rollout.max_turns)" in log
    assert "the agent exited with status 1" in log and "RuntimeError: the agent broke after its first turn" in log
    assert "Error code: 400 - message 2 differs from the session's: the conversation so far is fixed" in log


def test_a_session_past_its_time_fails_and_its_agent_is_killed(model_dir, tmp_path, monkeypatch, caplog):
    engine = HFRolloutEngine(model_dir, dtype="float32")
    limits = GatewayLimits(turns=TurnLimits(max_turns=2, max_turn_tokens=16), session_timeout_s=3.0)
    start = time.monotonic()
    rows, _, transcripts, metrics = serve(engine, ["SLEEP: what is 4 + 4?"], 1, limits, tmp_path, monkeypatch)
    assert time.monotonic() - start < 60  # the agent sleeps for ten minutes: it was killed
    assert metrics["rollout/sessions_failed"] == 1 and rows[0]["session_reward"] == 0.0 and not transcripts
    assert rows[0]["turn_starts"] == [] and rows[0]["loss_mask"] == [0]  # no turn: one template token, out of the loss
    assert "the session lasted more than 3 s (session_timeout_s)" in caplog.text


def test_a_request_without_a_session_key_is_refused(model_dir):
    engine = HFRolloutEngine(model_dir, dtype="float32")
    gateway = AgentGateway(engine, AGENT, GatewayLimits(turns=TurnLimits(max_turns=2, max_turn_tokens=8)))
    try:
        client = openai.OpenAI(base_url=gateway.url, api_key="not-a-session", max_retries=0)
        with pytest.raises(openai.AuthenticationError, match="no session has this key"):
            client.chat.completions.create(model="policy", messages=[{"role": "user", "content": "hi"}])
    finally:
        gateway.close()


@pytest.mark.slow  # one short in-process run of the tiny model whose rollout serves the agent's sessions
@pytest.mark.parametrize("mode", ["inprocess", pytest.param("distributed", marks=pytest.mark.slow)])
def test_a_run_trains_through_the_gateway(model_dir, tmp_path, mode):
    """In process, and with the rollout and reward as processes of their own whose stage tokens (the stage table's
    rights) let the rollout write ``session_reward`` and the reward claim it."""
    run = tmp_path / "run"
    cfg = load_config(None, [f"dock.mode={mode}", "dock.timeout_s=120", 
        f"model.path={model_dir}", f"run.output_dir={run}", f"run.cache_dir={tmp_path / 'cache'}", "run.progress=false",
        "trainer.iterations=2", "trainer.global_batch=2", "trainer.mini_batch=2", "trainer.micro_batch=4", "rollout.n=2",
        "rollout.max_response_length=32", "rollout.max_turns=3", "rollout.engine=hf", "rollout.dtype=float32",
        "trainer.autocast_bf16=false", "trainer.eval_before=false", "trainer.eval_after=false", "data.generate_train=8",
        "data.generate_test=4", "data.eval_size=4", "trainer.lr=1e-3", f"env.agent.command={shlex.join(AGENT)}",
    ])
    driver.train(cfg)
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert [r["iteration"] for r in rows] == [0, 1]
    for r in rows:  # every session is a row the actor trained on; the reward stage took the failed ones' reward as decided
        assert r["rollout/sessions"] == 4 and r["rollout/turns_max"] >= 2 and r["actor/sequences"] == 4
        assert r["reward/sessions_decided"] == r["rollout/sessions_failed"]  # no agent here posts a reward


COMPLETIONS_AGENT = """
import json, os, sys
import openai

task = json.load(sys.stdin)
client = openai.OpenAI(max_retries=0, timeout=120)
first = client.completions.create(model="policy", prompt=task["prompt"], logprobs=1)
prompt = task["prompt"] + first.choices[0].text + "<|im_end|>" + sys.argv[1]
second = client.completions.create(model="policy", prompt=prompt, logprobs=1)
with open(os.path.join(os.environ["AGENT_TRANSCRIPTS"], first.id + ".json"), "w") as f:
    json.dump({"ids": [first.id], "logprobs": [c.choices[0].logprobs.token_logprobs for c in (first, second)]}, f)
"""


def test_completions_extend_the_session_text_with_the_agents_text_as_ids(model_dir, tmp_path, monkeypatch):
    """``/v1/completions``: the agent's prompt begins with the session's text, what it adds is tokenized once and
    appended after the sampled ids; the log-probs it gets are the trained ones."""
    torch.manual_seed(0)
    engine = HFRolloutEngine(model_dir, dtype="float32")
    agent = tmp_path / "completions_agent.py"
    agent.write_text(COMPLETIONS_AGENT)
    added = "\n<|im_start|>user\nAgain.<|im_end|>\n<|im_start|>assistant\n"
    transcripts = tmp_path / "transcripts"
    transcripts.mkdir()
    monkeypatch.setenv("AGENT_TRANSCRIPTS", str(transcripts))
    prompts, tasks = tasks_of(engine.tokenizer, ["What is 12 times 34?"])
    gateway = AgentGateway(engine, [sys.executable, str(agent), added], GatewayLimits(turns=TurnLimits(max_turns=2, max_turn_tokens=64)))
    try:
        (result,) = gateway.run(prompts, [tasks[tuple(prompts[0])]])
    finally:
        gateway.close()
    t = result.trajectory
    assert not result.failure and t.turns == 2 and t.response_ids[t.turn_ends[0] - 1] == engine.eos_id
    assert t.response_ids[t.turn_ends[0]:t.turn_starts[1]] == engine.tokenizer.encode(added, add_special_tokens=False)
    (transcript,) = [json.loads(f.read_text()) for f in transcripts.iterdir()]
    for k, logprobs in enumerate(transcript["logprobs"]):
        assert logprobs == pytest.approx(t.log_probs[t.turn_starts[k]:t.turn_ends[k]], abs=1e-6)
