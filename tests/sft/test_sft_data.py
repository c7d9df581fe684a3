"""SFT examples: the assistant's tokens found by rendering the chat template turn by turn, each row format, bad rows."""

from __future__ import annotations

import json

import pytest

from dockrl.config import ConfigError, DataConfig, SFTConfig
from dockrl.engines.hf.load import load_tokenizer
from dockrl.run.data import prompt_token_ids
from dockrl.sft.data import conversation_tokens, load_examples, row_example

CONVERSATION = [
    {"role": "system", "content": "Be brief."},
    {"role": "user", "content": "Tom has 3 apples. He buys 4 more."},
    {"role": "assistant", "content": "3 + 4 = 7.\n#### 7"},
    {"role": "user", "content": "And twice that?"},
    {"role": "assistant", "content": "7 * 2 = 14.\n#### 14"},
]


@pytest.fixture(scope="module")
def tokenizer(tiny_model_dir):
    return load_tokenizer(tiny_model_dir, False)


def pieces(tokenizer, *texts: str) -> list[list[int]]:
    return [tokenizer(t, add_special_tokens=False)["input_ids"] for t in texts]


def test_the_loss_mask_is_1_exactly_on_the_assistant_turns(tokenizer):
    # ChatML by hand: each turn is '<|im_start|>ROLE\nCONTENT<|im_end|>\n'; the assistant's tokens are its content
    # and its end of turn, what the model generates after the generation prompt '<|im_start|>assistant\n'
    prompt, answer1, between, answer2 = pieces(
        tokenizer,
        "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nTom has 3 apples. He buys 4 more.<|im_end|>\n"
        "<|im_start|>assistant\n",
        "3 + 4 = 7.\n#### 7<|im_end|>\n",
        "<|im_start|>user\nAnd twice that?<|im_end|>\n<|im_start|>assistant\n",
        "7 * 2 = 14.\n#### 14<|im_end|>\n",
    )
    ids, mask = conversation_tokens(tokenizer, CONVERSATION, model="tiny")
    assert ids == prompt + answer1 + between + answer2
    assert ids == tokenizer.apply_chat_template(CONVERSATION, tokenize=True, return_dict=False)  # the whole conversation's ids
    assert mask == [0] * len(prompt) + [1] * len(answer1) + [0] * len(between) + [1] * len(answer2)
    assert tokenizer.decode([i for i, m in zip(ids, mask) if m]) == "3 + 4 = 7.\n#### 7<|im_end|>\n7 * 2 = 14.\n#### 14<|im_end|>\n"
    example = row_example({"messages": CONVERSATION}, tokenizer, SFTConfig(), DataConfig(), "tiny")
    assert example.prompt_ids == prompt and example.response_ids == ids[len(prompt):] and example.loss_mask == mask[len(prompt):]


def test_a_template_that_renders_an_earlier_turn_otherwise_is_refused_naming_the_model(tiny_model_dir):
    tokenizer = load_tokenizer(tiny_model_dir, False)
    # as Qwen3's drops the reasoning of earlier assistant turns: an earlier turn renders shorter than as the last one
    tokenizer.chat_template = (
        "{% for m in messages %}{% if m['role'] == 'assistant' and not loop.last %}"
        "{{ '<|im_start|>assistant\n<|im_end|>\n' }}"
        "{% else %}{{ '<|im_start|>' + m['role'] + '\n' + m['content'] + '<|im_end|>\n' }}{% endif %}{% endfor %}"
        "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}")
    with pytest.raises(ConfigError, match=r"model.path: the chat template of 'my/model' does not render conversations turn by turn"):
        conversation_tokens(tokenizer, CONVERSATION, model="my/model")
    ids, mask = conversation_tokens(tokenizer, CONVERSATION[:3], model="my/model")  # one assistant turn, the last: consistent
    assert sum(mask) > 0


def test_text_prompt_and_completion_train_on_the_completion_and_its_eos(tokenizer):
    example = row_example({"prompt": "2 + 2 =", "completion": " 4"}, tokenizer, SFTConfig(), DataConfig(), "tiny")
    assert example.prompt_ids == tokenizer("2 + 2 =")["input_ids"]
    assert example.response_ids == tokenizer(" 4", add_special_tokens=False)["input_ids"] + [tokenizer.eos_token_id]
    assert example.loss_mask == [1] * len(example.response_ids)


def test_conversational_prompt_and_completion_train_on_the_completion_turns_only(tokenizer):
    row = {"prompt": CONVERSATION[:4], "completion": CONVERSATION[4:]}
    example = row_example(row, tokenizer, SFTConfig(), DataConfig(), "tiny")
    ids, mask = conversation_tokens(tokenizer, CONVERSATION, model="tiny")
    assert example.prompt_ids + example.response_ids == ids
    assert tokenizer.decode([i for i, m in zip(example.response_ids, example.loss_mask) if m]) == "7 * 2 = 14.\n#### 14<|im_end|>\n"


@pytest.mark.parametrize("chat_template", ["auto", "none"])
def test_a_gsm8k_row_is_the_rl_prompt_and_the_worked_answer(tokenizer, chat_template):
    d = DataConfig(chat_template=chat_template)
    row = {"question": "Tom has 3 apples. He buys 4 more. How many apples does Tom have now?", "answer": "3 + 4 = 7.\n#### 7"}
    example = row_example(row, tokenizer, SFTConfig(), d, "tiny")
    assert example.prompt_ids == prompt_token_ids(tokenizer, row["question"], system_prompt=d.system_prompt, chat_template=chat_template)
    end = "<|im_end|>\n" if chat_template == "auto" else "<|im_end|>"  # the template's end of turn, or EOS after plain text
    assert tokenizer.decode(example.response_ids).strip(" ") == "3 + 4 = 7.\n#### 7" + end
    assert example.loss_mask == [1] * len(example.response_ids)


def test_bad_rows_are_counted_and_skipped_with_their_line_numbers(tokenizer, tmp_path, caplog):
    good = {"messages": CONVERSATION[1:3]}
    lines = [
        json.dumps(good),                                                                       # 1
        "{not json",                                                                            # 2
        json.dumps({"text": "no known field"}),                                                 # 3
        json.dumps({"messages": [{"role": "assistant", "content": "hi"}]}),                     # 4
        json.dumps({"messages": [{"role": "user", "content": "hi"}]}),                          # 5
        json.dumps({"messages": [{"role": "robot", "content": "hi"}]}),                         # 6
        "",                                                                                     # 7: blank, not a row
        json.dumps({"prompt": "a", "completion": ""}),                                          # 8
        json.dumps({"question": "long " * 200, "answer": "#### 1"}),                            # 9
        json.dumps([1, 2]),                                                                     # 10
        json.dumps({"prompt": "2 + 2 =", "completion": " 4"}),                                  # 11
    ]
    path = tmp_path / "chats.jsonl"
    path.write_text("\n".join(lines) + "\n")
    examples, report = load_examples(path, tokenizer, SFTConfig(max_length=128), DataConfig(), model="tiny")
    assert len(examples) == report.kept == 2
    assert [n for n, _ in report.bad] == [2, 3, 4, 5, 6, 8, 9, 10]
    why = dict(report.bad)
    assert why[2].startswith("invalid JSON") and "none of the fields 'messages'" in why[3]
    assert "starts with an assistant turn" in why[4] and "no assistant turn" in why[5] and "turn 1 is not" in why[6]
    assert why[8] == "the completion is empty" and "> sft.max_length=128" in why[9] and why[10] == "not a JSON object"
    assert "line 9:" in caplog.text  # the report is logged


def test_a_file_without_a_usable_row_names_the_file(tokenizer, tmp_path):
    path = tmp_path / "empty.jsonl"
    path.write_text(json.dumps({"prompt": 1, "completion": 2}) + "\n")
    with pytest.raises(ValueError, match=r"no usable row in .*empty.jsonl: kept 0 rows, dropped 1\n  line 1: fields 'prompt' and"):
        load_examples(path, tokenizer, SFTConfig(), DataConfig(), model="tiny")


def test_a_parquet_file_of_conversations_reads_as_jsonl_does(tokenizer, tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq

    path = tmp_path / "chats.parquet"
    pq.write_table(pa.table({"messages": [CONVERSATION, CONVERSATION[:1]]}), path)
    examples, report = load_examples(path, tokenizer, SFTConfig(), DataConfig(), model="tiny")
    assert len(examples) == 1 and report.bad == [(2, "field 'messages' has no assistant turn to train on")]
    ids, mask = conversation_tokens(tokenizer, CONVERSATION, model="tiny")
    assert examples[0].prompt_ids + examples[0].response_ids == ids
