"""The generative judge (``reward_model.kind=generative``): the verdict parsers, the judge on the tiny model against
the model's own greedy generation, its bounds, its config errors, and a whole run with it (no fakes)."""

from __future__ import annotations

import json

import pytest
import torch
from judge_parsers import verdict_length

from dockrl import driver
from dockrl.config import ConfigError, DockConfig, GenerativeJudgeConfig, load_config
from dockrl.dock import GRPO_SCHEMA, open_dock
from dockrl.engines.hf.load import load_tokenizer
from dockrl.engines.hf.rollout import HFRolloutEngine
from dockrl.engines.judge import GenerativeJudge
from dockrl.rewards.verdicts import build_parser, label_parser, parse_number
from dockrl.run.setup import plan_run
from dockrl.stages.reward_model import RewardModelWorker

TEMPLATE = "Question: {prompt}\nAnswer: {response}\nReference: {ground_truth}\nScore the answer from 0 to 10."
PROMPTS = [[1, 5, 6, 7, 9], [8, 9], [3, 4, 5]]
RESPONSES = [[10, 11, 12], [12], [20, 21, 22, 23, 24, 25]]
TRUTHS = ["7", "12", None]


def test_the_number_parser_reads_the_first_number():
    assert parse_number("Score: 7/10") == 7.0
    assert parse_number("about -2.5e1 points") == -25.0
    assert parse_number(".5") == 0.5
    assert parse_number("no digits here") is None


def test_the_label_parser_scores_the_first_whole_word_label_any_case():
    parse = label_parser(["correct=1", "incorrect=0", "not correct=-1"])
    assert parse("Incorrect. The answer is correct elsewhere") == 0.0
    assert parse("it is CORRECT") == 1.0
    assert parse("Not correct") == -1.0  # the longer label where two start at the same place
    assert parse("incorrectly") is None  # whole words only
    assert build_parser("dockrl.rewards.verdicts:parse_number")("x 3") == 3.0  # a module:function


def test_a_parser_that_does_not_import_is_named():
    with pytest.raises(ConfigError, match=r"reward_model.generative.parser: got 'judge_parsers:nothing', which does not import"):
        build_parser("judge_parsers:nothing")


@pytest.fixture(scope="module")
def judge_engine(tiny_model_dir):
    return HFRolloutEngine(tiny_model_dir, dtype="float32")


def judge(engine, tiny_model_dir, **fields):
    cfg = GenerativeJudgeConfig(**{"template": TEMPLATE, "parser": "judge_parsers:verdict_length", "max_new_tokens": 6, **fields})
    return GenerativeJudge(engine, load_tokenizer(tiny_model_dir), cfg)


def test_the_judge_s_verdicts_are_the_model_s_own_greedy_generation(judge_engine, tiny_model_dir):
    j = judge(judge_engine, tiny_model_dir)
    policy = load_tokenizer(tiny_model_dir)
    ids = j.judge_prompts(PROMPTS, RESPONSES, TRUTHS)
    for p, r, g, got in zip(PROMPTS, RESPONSES, TRUTHS, ids):
        text = TEMPLATE.format(prompt=policy.decode(p, skip_special_tokens=True), response=policy.decode(r, skip_special_tokens=True),
                               ground_truth=g or "")
        assert got == policy.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True, tokenize=True,
                                                 return_dict=False)
    verdicts = j.verdicts(PROMPTS, RESPONSES, TRUTHS, micro_batch=2)
    model = judge_engine.model
    for prompt, v in zip(ids, verdicts):
        with torch.no_grad():  # alone, unpadded, greedy: what the judge must have written
            out = model.generate(torch.tensor([prompt]), attention_mask=torch.ones(1, len(prompt), dtype=torch.long), do_sample=False,
                                 max_new_tokens=6, eos_token_id=policy.eos_token_id, pad_token_id=policy.pad_token_id)
        alone = out[0, len(prompt):].tolist()
        text = policy.decode(alone[: alone.index(policy.eos_token_id) + 1] if policy.eos_token_id in alone else alone,
                             skip_special_tokens=True)
        assert v.text == text and v.parsed and v.score == verdict_length(text) and 1 <= v.tokens <= 6


def test_an_unreadable_verdict_gets_the_unparsed_score_and_a_slow_judge_fails_naming_its_bound(judge_engine, tiny_model_dir):
    verdicts = judge(judge_engine, tiny_model_dir, parser="judge_parsers:undecided", unparsed_score=-1.0).verdicts(
        PROMPTS, RESPONSES, TRUTHS, micro_batch=3)
    assert [(v.score, v.parsed) for v in verdicts] == [(-1.0, False)] * 3
    with pytest.raises(TimeoutError, match=r"reward_model.generative.timeout_s: the judge took .* s for 1 of 3 verdicts"):
        judge(judge_engine, tiny_model_dir, timeout_s=1e-6).verdicts(PROMPTS, RESPONSES, TRUTHS, micro_batch=1)


def test_the_reward_model_stage_puts_the_judge_s_scores(judge_engine, tiny_model_dir):
    dock = open_dock(DockConfig(timeout_s=5), GRPO_SCHEMA, run="test")
    dock.open_iteration(0, 4, 2)
    dock.put(range(4), {"prompt_ids": [PROMPTS[0], PROMPTS[0], PROMPTS[1], PROMPTS[1]], "ground_truth": ["7", "7", "12", "12"]})
    dock.put(range(4), {"response_ids": [RESPONSES[0], RESPONSES[2], RESPONSES[1], RESPONSES[0]]})
    j = judge(judge_engine, tiny_model_dir)
    m = RewardModelWorker(j, micro_batch=3).run_iteration(dock)
    got = dock.get(["rm_model_score"], range(4)).column("rm_model_score").to_pylist()
    want = [v.score for v in j.verdicts([PROMPTS[0], PROMPTS[0], PROMPTS[1], PROMPTS[1]],
                                        [RESPONSES[0], RESPONSES[2], RESPONSES[1], RESPONSES[0]], ["7", "7", "12", "12"], micro_batch=4)]
    assert got == pytest.approx(want, abs=1e-6)
    assert m["reward_model/unparsed_frac"] == 0.0 and m["reward_model/verdict_tokens"] >= 1
    assert m["reward_model/score_mean"] == pytest.approx(sum(want) / 4, abs=1e-6)
    dock.close()


def test_config_errors_name_the_judge_fields(tmp_path, tiny_model_dir):
    on = ["reward_model.enable=true", "reward_model.model.path=judge", "reward_model.kind=generative"]
    for extra, says in (
        ([], r"reward_model.generative.template: got ''; expected a prompt with a \{response\} field"),
        (["reward_model.generative.template=Rate {answer}"], r"expected a prompt with a \{response\}"),
        (["reward_model.generative.template='{response} {reply}'"], r"unknown field\(s\) \['reply'\]"),
        (["reward_model.generative.template='{response'"], r"is no str.format template"),
        (["reward_model.generative.template={response}", "reward_model.generative.parser=json"],
         r"reward_model.generative.parser: got 'json'; expected 'number' or 'label'"),
        (["reward_model.generative.template={response}", "reward_model.generative.parser=label"],
         r"reward_model.generative.labels: got \[\]; the label parser needs label=score pairs"),
        (["reward_model.generative.template={response}", "reward_model.generative.labels=yes=1"],
         r"reward_model.generative.labels: got \['yes=1'\]; only read by reward_model.generative.parser='label'"),
        (["reward_model.generative.template={response}", "reward_model.generative.parser=label", "reward_model.generative.labels=yes=x"],
         r"'yes=x' is not label=score"),
        (["reward_model.generative.template={response}", "reward_model.generative.max_new_tokens=0"],
         r"reward_model.generative.max_new_tokens: got 0"),
        (["reward_model.generative.template={response}", "reward_model.generative.timeout_s=0"], r"reward_model.generative.timeout_s: got 0.0"),
    ):
        with pytest.raises(ConfigError, match=says):
            load_config(None, [*on, *extra])
    with pytest.raises(ConfigError, match=r"reward_model.generative.engine: got 'vllm'; with dock.mode='inprocess' the judge shares"):
        load_config(None, [*on, "reward_model.generative.template={response}", "reward_model.generative.engine=vllm", "rollout.engine=vllm"])
    load_config(None, [*on, "reward_model.generative.template={response}", "reward_model.generative.engine=vllm", "rollout.engine=vllm",
                       "dock.mode=distributed"])  # a process of its own
    with pytest.raises(ConfigError, match=r"reward_model.generative.template: got '\{response\}'; is set but reward_model.kind=generative"):
        load_config(None, ["reward_model.enable=true", "reward_model.model.path=rm", "reward_model.generative.template={response}"])
    base = [f"model.path={tiny_model_dir}", f"run.output_dir={tmp_path / 'run'}", f"run.cache_dir={tmp_path / 'cache'}",
            "data.generate_train=20", "data.generate_test=4", *on[:1], "reward_model.kind=generative",
            "reward_model.generative.template={response}"]
    with pytest.raises(ConfigError, match=r"reward_model.model.path: got '.*nowhere'; expected a local HF folder with config.json of a "
                                          r"causal LM judge"):
        plan_run(load_config(None, [*base, f"reward_model.model.path={tmp_path / 'nowhere'}"]))


@pytest.mark.slow
def test_a_run_with_the_judge_adds_its_scores_to_the_rule_reward(tiny_model_dir, tmp_path):
    """No fakes: the built-in rule verifier, the tiny model as the judge with a fixed template and a user's parser."""
    driver.train(load_config(None, [
        f"model.path={tiny_model_dir}", f"run.output_dir={tmp_path / 'run'}", f"run.cache_dir={tmp_path / 'cache'}",
        "run.progress=false", "trainer.iterations=2", "trainer.global_batch=2", "trainer.mini_batch=2", "trainer.micro_batch=4",
        "rollout.n=4", "rollout.max_response_length=8", "rollout.dtype=float32", "trainer.autocast_bf16=false", "trainer.save_every=0",
        "data.generate_train=20", "data.generate_test=4", "data.eval_size=4", "trainer.eval_before=false",
        "reward_model.enable=true", f"reward_model.model.path={tiny_model_dir}", "reward_model.kind=generative",
        f"reward_model.generative.template={TEMPLATE!r}", "reward_model.generative.parser=judge_parsers:verdict_length",
        "reward_model.generative.max_new_tokens=6", "reward_model.micro_batch_size=4", "reward_model.model_weight=0.5",
        "reward_model.rule_weight=2.0"]))
    lines = [json.loads(x) for x in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert [x["iteration"] for x in lines] == [0, 1]
    for x in lines:
        assert x["reward_model/unparsed_frac"] == 0.0 and 1 <= x["reward_model/verdict_tokens"] <= 6
        assert x["reward_model/score_mean"] > 0 and x["timing_s/reward_model"] > 0
        assert x["reward/mean"] == pytest.approx(2.0 * x["reward/rule_mean"] + 0.5 * x["reward_model/score_mean"], abs=1e-5)
