"""Tests of the prompt data: the seeded problem generator and the validating loader."""

from __future__ import annotations

import json
import operator
import re
import time
import tracemalloc

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from dockrl.config import DEFAULT_SYSTEM_PROMPT
from dockrl.run.data import MAX_ROW_BYTES, final_answer_of, generate_problems, load_prompts, write_jsonl

STEP = re.compile(r"^(\d+) ([+\-*]) (\d+) = (\d+)$")
OPS = {"+": operator.add, "-": operator.sub, "*": operator.mul}


@pytest.fixture(scope="module")
def tokenizer(tiny_model_dir):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(tiny_model_dir)


# --- generator -------------------------------------------------------------------------------


def test_generator_is_seeded():
    first = generate_problems(40, seed=7)
    assert first == generate_problems(40, seed=7)
    assert first != generate_problems(40, seed=8)
    assert len(first) == 40 and len({p["question"] for p in first}) > 20
    assert generate_problems(10, seed=7) == first[:10]  # a prefix does not depend on count
    assert generate_problems(0, seed=7) == []


@pytest.mark.parametrize(("min_steps", "max_steps", "max_number"), [(1, 1, 10), (1, 2, 20), (2, 4, 50), (3, 3, 3)])
def test_answers_follow_the_worked_steps(min_steps, max_steps, max_number):
    problems = generate_problems(
        150, seed=min_steps * 100 + max_number, min_steps=min_steps, max_steps=max_steps, max_number=max_number
    )
    seen_ops = set()
    for p in problems:
        assert set(p) == {"question", "answer"}
        match = re.fullmatch(r"(.+)\.\n#### (\d+)", p["answer"], flags=re.DOTALL)
        assert match, p["answer"]
        work, final = match.group(1), int(match.group(2))
        assert final_answer_of(p["answer"]) == str(final)

        steps = [STEP.fullmatch(s) for s in work.split(". ")]
        assert all(steps), work
        assert min_steps <= len(steps) <= max_steps
        start = int(re.search(r" has (\d+) ", p["question"]).group(1))
        assert 2 <= start <= max_number
        total = start
        for step in steps:
            a, op, b, c = int(step[1]), step[2], int(step[3]), int(step[4])
            assert a == total, f"step {step[0]!r} does not continue from {total}"
            assert OPS[op](a, b) == c, step[0]
            seen_ops.add(op)
            total = c
        assert total == final > 0
        assert p["question"].endswith("have now?")
    if max_steps >= 2:
        assert seen_ops == {"+", "-", "*"}


@pytest.mark.parametrize(("min_steps", "max_steps"), [(0, 2), (3, 2), (-1, -1)])
def test_generator_rejects_bad_step_range(min_steps, max_steps):
    with pytest.raises(ValueError, match="min_steps"):
        generate_problems(3, seed=0, min_steps=min_steps, max_steps=max_steps)


# --- loader ----------------------------------------------------------------------------------

GOOD = [
    {"question": "Tom has 3 apples. Tom buys 4 more apples. How many apples does Tom have now?", "answer": "3 + 4 = 7.\n#### 7"},
    {"question": "Sara has 1,200 coins. How many coins?", "answer": "She has 1,200.\n#### 1,200"},
]
GOOD_TRUTHS = ["7", "1200"]


def prompt_len(tokenizer, question: str, system_prompt: str = DEFAULT_SYSTEM_PROMPT) -> int:
    messages = ([{"role": "system", "content": system_prompt}] if system_prompt else []) + [
        {"role": "user", "content": question}
    ]
    return len(tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True, return_dict=False))


def test_jsonl_keeps_good_rows_and_reports_bad_lines(tmp_path, tokenizer):
    limit = max(prompt_len(tokenizer, row["question"]) for row in GOOD)  # the longest good prompt fits exactly
    lines = [
        json.dumps(GOOD[0]),  # 1
        '{"question": "broken", ',  # 2 invalid JSON
        "",  # 3 blank: skipped, not reported
        json.dumps({"question": "no answer"}),  # 4 missing field
        json.dumps({"question": "q", "answer": "the answer is 5"}),  # 5 no ####
        json.dumps({"question": "Tom has 3 apples. " * 40, "answer": "#### 3"}),  # 6 too long
        json.dumps(GOOD[1]),  # 7
        json.dumps([1, 2]),  # 8 not an object
        json.dumps({"question": 5, "answer": "#### 5"}),  # 9 question not a string
        json.dumps({"question": "q", "answer": "####  "}),  # 10 empty final answer
    ]
    path = tmp_path / "train.jsonl"
    path.write_text("\n".join(lines) + "\n")
    with path.open("ab") as f:
        f.write(b'{"question": "caf\xe9 5", "answer": "#### 5"}\n')  # 11 not UTF-8 (latin-1)

    prompts, report = load_prompts(path, tokenizer, system_prompt=DEFAULT_SYSTEM_PROMPT, max_prompt_length=limit)

    assert [p.question for p in prompts] == [row["question"] for row in GOOD]
    assert [p.ground_truth for p in prompts] == GOOD_TRUTHS
    assert [p.index for p in prompts] == [0, 1]
    assert all(isinstance(t, int) for p in prompts for t in p.prompt_ids)
    assert report.kept == 2 and report.path == str(path)
    assert [n for n, _ in report.bad] == [2, 4, 5, 6, 8, 9, 10, 11]
    reasons = dict(report.bad)
    assert "invalid JSON" in reasons[2] and "'utf-8' codec can't decode" in reasons[11]
    assert "missing" in reasons[4] and "missing" in reasons[8] and "missing" in reasons[9]
    assert "####" in reasons[5] and "####" in reasons[10]
    assert "tokens" in reasons[6] and f"max_prompt_length={limit}" in reasons[6]
    summary = report.summary()
    assert "kept 2 rows, dropped 8" in summary
    for n in (2, 4, 5, 6, 8, 9, 10, 11):
        assert f"line {n}:" in summary


def test_max_prompt_length_boundary(tmp_path, tokenizer):
    path = write_jsonl(GOOD[:1], tmp_path / "one.jsonl")
    n = prompt_len(tokenizer, GOOD[0]["question"])
    prompts, report = load_prompts(path, tokenizer, system_prompt=DEFAULT_SYSTEM_PROMPT, max_prompt_length=n)
    assert len(prompts[0].prompt_ids) == n and report.bad == []
    with pytest.raises(ValueError, match=f"prompt has {n} tokens > data.max_prompt_length={n - 1}"):
        load_prompts(path, tokenizer, system_prompt=DEFAULT_SYSTEM_PROMPT, max_prompt_length=n - 1)


def test_no_usable_row_raises_with_the_reasons(tmp_path, tokenizer):
    path = tmp_path / "bad.jsonl"
    path.write_text('not json\n{"question": "q", "answer": "no hashes"}\n')
    with pytest.raises(ValueError) as info:
        load_prompts(path, tokenizer, system_prompt="", max_prompt_length=256)
    msg = str(info.value)
    assert "line 1: invalid JSON" in msg
    assert "line 2: answer has no final '#### <number>'" in msg
    assert "kept 0 rows" in msg


def test_no_usable_row_says_each_reason_once_in_one_line(tmp_path, tokenizer, caplog):
    path = tmp_path / "bad.jsonl"
    path.write_text('not json\n{"question": "q", "answer": "no hashes"}\n')
    with caplog.at_level("WARNING"), pytest.raises(ValueError) as info:
        load_prompts(path, tokenizer, system_prompt="", max_prompt_length=256)
    msg = str(info.value)
    assert "\n" not in msg and msg.startswith(f"no usable row in {path}: kept 0 rows, dropped 2 (line 1: invalid JSON: ")
    assert (caplog.text + msg).count("line 2: answer has no final '#### <number>'") == 1


@pytest.mark.parametrize("suffix", [".jsonl", ".json"])
def test_a_file_saved_with_a_utf8_bom_keeps_its_first_row(tmp_path, tokenizer, suffix):
    path = tmp_path / f"bom{suffix}"
    path.write_text("".join(json.dumps(row) + "\n" for row in GOOD), encoding="utf-8-sig")  # as Excel and Notepad save UTF-8
    prompts, report = load_prompts(path, tokenizer, system_prompt="", max_prompt_length=256)
    assert [p.ground_truth for p in prompts] == GOOD_TRUTHS and report.bad == []
    path.write_text(json.dumps(GOOD), encoding="utf-8-sig")
    with pytest.raises(ValueError, match="a JSON array; expected JSON Lines"):  # recognised behind the BOM too
        load_prompts(path, tokenizer, system_prompt="", max_prompt_length=256)


def test_empty_file_raises(tmp_path, tokenizer):
    path = tmp_path / "empty.jsonl"
    path.write_text("\n\n")
    with pytest.raises(ValueError, match="no usable row"):
        load_prompts(path, tokenizer, system_prompt="", max_prompt_length=256)


def test_blank_questions_and_answers_are_counted_and_skipped_with_their_line(tmp_path, tokenizer):
    rows = [GOOD[0], {"question": "", "answer": "#### 3"}, {"question": "  \n\t", "answer": "#### 3"}, {"question": "q", "answer": "  "}]
    prompts, report = load_prompts(write_jsonl(rows, tmp_path / "blank.jsonl"), tokenizer, system_prompt="", max_prompt_length=256)
    assert [p.question for p in prompts] == [GOOD[0]["question"]]
    assert report.bad == [(2, "the question is empty"), (3, "the question is empty"), (4, "answer has no final '#### <number>'")]


@pytest.mark.parametrize("suffix", ["jsonl", "parquet"])
def test_a_100_mb_row_is_dropped_unread_in_seconds(tmp_path, tokenizer, suffix):
    """Dropped before it is parsed or tokenized (a 16 MB line once took 46 s and 6 GB), memory bounded."""
    huge = {"question": "Tom has 3 apples. " * (100 * 2**20 // 18), "answer": "#### 3"}
    path = tmp_path / f"huge.{suffix}"
    if suffix == "jsonl":
        with path.open("w") as f:
            f.write(json.dumps(GOOD[0]) + "\n" + json.dumps(huge) + "\n" + json.dumps(GOOD[1]) + "\n")
    else:
        pq.write_table(pa.Table.from_pylist([GOOD[0], huge, GOOD[1]]), path)
    del huge
    tracemalloc.start()
    start = time.perf_counter()
    prompts, report = load_prompts(path, tokenizer, system_prompt="", max_prompt_length=256)
    seconds, (_, peak) = time.perf_counter() - start, tracemalloc.get_traced_memory()
    tracemalloc.stop()
    assert [p.question for p in prompts] == [GOOD[0]["question"], GOOD[1]["question"]]
    assert len(report.bad) == 1 and report.bad[0][0] == 2 and f"> {MAX_ROW_BYTES}" in report.bad[0][1], report.bad
    assert seconds < 5, seconds
    if suffix == "jsonl":  # Parquet's column is read whole by Arrow (outside Python's allocator)
        assert peak < 16 * 2**20, peak


def test_parquet_loads_like_jsonl(tmp_path, tokenizer):
    rows = [*GOOD, {"question": "q", "answer": "no final answer"}]
    jsonl = write_jsonl(rows, tmp_path / "rows.jsonl")
    parquet = tmp_path / "rows.parquet"
    pq.write_table(pa.Table.from_pylist(rows), parquet)

    kw = {"system_prompt": DEFAULT_SYSTEM_PROMPT, "max_prompt_length": 256}
    from_jsonl, report_jsonl = load_prompts(jsonl, tokenizer, **kw)
    from_parquet, report_parquet = load_prompts(str(parquet), tokenizer, **kw)
    assert from_parquet == from_jsonl
    assert [p.ground_truth for p in from_parquet] == GOOD_TRUTHS
    assert report_parquet.bad == report_jsonl.bad == [(3, "answer has no final '#### <number>'")]


def test_json_extension_is_read_as_jsonl(tmp_path, tokenizer):
    path = write_jsonl(GOOD, tmp_path / "rows.json")
    prompts, _ = load_prompts(path, tokenizer, system_prompt="", max_prompt_length=256)
    assert [p.ground_truth for p in prompts] == GOOD_TRUTHS


def test_unsupported_extension(tmp_path, tokenizer):
    path = tmp_path / "rows.csv"
    path.write_text("question,answer\nq,#### 1\n")
    with pytest.raises(ValueError, match=r"rows\.csv.*\.jsonl or \.parquet"):
        load_prompts(path, tokenizer, system_prompt="", max_prompt_length=256)


def test_missing_file(tmp_path, tokenizer):
    with pytest.raises(FileNotFoundError, match="missing.jsonl"):
        load_prompts(tmp_path / "missing.jsonl", tokenizer, system_prompt="", max_prompt_length=256)


def test_chat_template_is_applied(tmp_path, tokenizer):
    path = write_jsonl(GOOD[:1], tmp_path / "one.jsonl")
    system = "You are a careful calculator."
    (with_system,), _ = load_prompts(path, tokenizer, system_prompt=system, max_prompt_length=512)
    (without,), _ = load_prompts(path, tokenizer, system_prompt="", max_prompt_length=512)

    text = tokenizer.decode(with_system.prompt_ids)
    question = GOOD[0]["question"]
    assert system in text and question in text
    assert text.index(system) < text.index(question)
    assert "<|im_start|>" in text and text.rstrip().endswith("assistant")  # generation prompt opens the reply

    bare = tokenizer.decode(without.prompt_ids)
    assert question in bare and system not in bare
    assert "<|im_start|>" in bare and bare.rstrip().endswith("assistant")
    assert len(tokenizer(question, add_special_tokens=False)["input_ids"]) < len(without.prompt_ids) < len(with_system.prompt_ids)


def test_answers_that_are_no_number_are_dropped_and_repeated_questions_counted(tmp_path, tokenizer):
    rows = [{"question": "q1", "answer": "#### 3"}, {"question": "q2", "answer": "#### abc"}, {"question": "q1", "answer": "#### 3"},
            {"question": "q3", "answer": "#### $1,200."}]
    path = tmp_path / "rows.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    prompts, report = load_prompts(path, tokenizer, system_prompt="", max_prompt_length=256)
    assert [p.ground_truth for p in prompts] == ["3", "3", "$1200."]
    assert report.bad == [(2, "answer's final '#### abc' is not a number (the verifier compares numbers)")]
    assert report.duplicates == 1 and "1 repeat an earlier question" in report.summary()


@pytest.fixture(scope="module")
def plain_model_dir(tiny_model_dir, tmp_path_factory):
    """The tiny model with a tokenizer that has no chat template (a base model's)."""
    import shutil

    from transformers import AutoTokenizer

    out = tmp_path_factory.mktemp("no-template")
    for f in tiny_model_dir.iterdir():
        shutil.copy(f, out / f.name)
    tok = AutoTokenizer.from_pretrained(tiny_model_dir)
    tok.chat_template = None
    (out / "chat_template.jinja").unlink(missing_ok=True)
    tok.save_pretrained(out)
    assert not AutoTokenizer.from_pretrained(out).chat_template
    return out


def test_a_tokenizer_without_chat_template_is_refused_naming_model_path(tmp_path, plain_model_dir):
    from dockrl.config import ConfigError, load_config
    from dockrl.engines.hf.load import load_tokenizer
    from dockrl.run.setup import load_run_prompts

    path = write_jsonl(GOOD[:2], tmp_path / "two.jsonl")
    cfg = load_config(None, [f"model.path={plain_model_dir}"])
    with pytest.raises(ConfigError) as info:
        load_run_prompts(cfg, load_tokenizer(plain_model_dir), path, path)
    message = str(info.value)
    assert message.startswith("model.path: the tokenizer of") and str(plain_model_dir) in message
    assert "data.chat_template=none" in message and "docs/data.md" in message


def test_plain_prompts_without_chat_template(tmp_path, plain_model_dir):
    from dockrl.config import load_config
    from dockrl.engines.hf.rollout import HFRolloutEngine
    from dockrl.run.data import PLAIN_PROMPT
    from dockrl.run.setup import load_run_prompts

    path = write_jsonl(GOOD[:2], tmp_path / "two.jsonl")
    cfg = load_config(None, [f"model.path={plain_model_dir}", "data.chat_template=none"])
    engine = HFRolloutEngine(plain_model_dir, dtype="float32")
    train, test = load_run_prompts(cfg, engine.tokenizer, path, path)
    want = PLAIN_PROMPT.format(system=f"{DEFAULT_SYSTEM_PROMPT}\n\n", question=GOOD[0]["question"])
    assert engine.tokenizer.decode(train[0].prompt_ids) == want
    assert want.endswith("Question: " + GOOD[0]["question"] + "\nAnswer:")
    samples = engine.generate([p.prompt_ids for p in test], max_new_tokens=3, temperature=1.0)
    assert [len(s.response_ids) for s in samples] and all(s.log_probs for s in samples)
    # without a system prompt: the question alone
    one = write_jsonl(GOOD[:1], tmp_path / "one.jsonl")
    (bare,), _ = load_prompts(one, engine.tokenizer, system_prompt="", max_prompt_length=512, chat_template="none")
    assert engine.tokenizer.decode(bare.prompt_ids) == "Question: " + GOOD[0]["question"] + "\nAnswer:"
