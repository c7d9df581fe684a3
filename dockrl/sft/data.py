"""SFT examples: chat-format rows as token ids with a mask that is 1 on the assistant's tokens only.

A row of ``data.train_path`` (JSONL or Parquet) is one of (``sft.format``; ``auto``: by the fields it has):

* ``messages``: ``[{"role": "system"|"user"|"assistant", "content": str}, ...]``, at least one
  assistant turn, not first. The conversation is rendered by the tokenizer's chat template, and the
  assistant's tokens are found by rendering it turn by turn (``conversation_tokens``), as verl's
  multi-turn SFT dataset does.
* ``prompt``/``completion``: two strings (text as it is, TRL's "standard" format: the completion
  followed by the EOS token), or two lists of turns (TRL's "conversational" format: rendered as one
  conversation, loss on the completion's assistant turns).
* ``question``/``answer`` (GSM8K, the demo's data): the prompt the RL run gives the model for the
  question (``dockrl.run.data.prompt_token_ids``, ``data.system_prompt`` and ``data.chat_template``)
  and the worked answer as the assistant's turn.

An ``Example`` is ``prompt_ids`` (what comes before the first assistant token), ``response_ids``
(the rest) and ``loss_mask`` over ``response_ids``: the shape of a multi-turn rollout's row, which the
actor's engine trains on (``HFTrainEngine.forward_backward``).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Sequence

from dockrl.config import ConfigError, DataConfig, SFTConfig
from dockrl.run.data import LoadReport, check_chat_template, check_data_file, object_rows, prompt_token_ids

logger = logging.getLogger(__name__)

ROLES = ("system", "user", "assistant")


@dataclass(frozen=True)
class Example:
    """One training example: ``prompt_ids`` (``(P,)``), ``response_ids`` (``(R,)``) and ``loss_mask``
    (``(R,)``, 1 on the assistant's tokens)."""

    prompt_ids: list[int]
    response_ids: list[int]
    loss_mask: list[int]


class BadRow(ValueError):
    """A row that is not a usable example; the message says why (reported with its line number)."""


def render(tokenizer, messages: Sequence[dict], *, generation_prompt: bool) -> list[int]:
    """The token ids of ``messages`` rendered by the tokenizer's chat template."""
    ids = tokenizer.apply_chat_template(list(messages), add_generation_prompt=generation_prompt, tokenize=True, return_dict=False)
    return ids.tolist() if hasattr(ids, "tolist") else list(ids)


def conversation_tokens(tokenizer, messages: Sequence[dict], *, model: str, completion_from: int = 0) -> tuple[list[int], list[int]]:
    """``(ids, mask)`` of a conversation: ``ids`` the chat template's rendering of all of it, ``mask``
    1 on each assistant turn's tokens (from ``completion_from`` on): those that rendering the turns
    before it with the generation prompt (``<|im_start|>assistant\\n`` in ChatML) does not give and
    rendering it too does — its content and its end-of-turn tokens, what the model generates.

    Every prefix rendered must be a prefix of the whole conversation's ids, else the template renders
    a turn differently depending on what follows (Qwen3's drops earlier turns' reasoning, for one),
    and the assistant's tokens cannot be told apart.

    Raises:
        ConfigError: the template does not render prefixes consistently (names ``model.path``).
    """
    full = render(tokenizer, messages, generation_prompt=False)
    mask = [0] * len(full)
    for i, message in enumerate(messages):
        if message["role"] != "assistant" or i < completion_from:
            continue
        start = render(tokenizer, messages[:i], generation_prompt=True)
        end = full if i == len(messages) - 1 else render(tokenizer, messages[: i + 1], generation_prompt=False)
        for upto, prefix in ((f"the {i} turn(s) before assistant turn {i + 1}, with the generation prompt", start),
                             (f"the first {i + 1} turns", end)):
            if full[: len(prefix)] != prefix:
                raise ConfigError(
                    f"model.path: the chat template of {model!r} does not render conversations turn by turn: rendering {upto} "
                    "gives ids that do not begin the whole conversation's, so the assistant's tokens cannot be found; "
                    f"use a model whose template renders each prefix of a conversation as its beginning, or the "
                    f"prompt/completion format with text (sft.format=prompt_completion)")
        mask[len(start):len(end)] = [1] * (len(end) - len(start))
    return full, mask


def check_turns(messages: Any, what: str) -> list[dict]:
    """``messages`` as a list of ``{"role", "content"}`` turns (other keys dropped).

    Raises:
        BadRow: not a list of turns, an unknown role, or content that is not a string.
    """
    if not isinstance(messages, list) or not messages:
        raise BadRow(f"{what} is not a non-empty list of turns")
    turns = []
    for k, m in enumerate(messages, start=1):
        if not isinstance(m, dict) or m.get("role") not in ROLES or not isinstance(m.get("content"), str):
            raise BadRow(f"{what}: turn {k} is not {{'role': one of {', '.join(ROLES)}, 'content': a string}}")
        turns.append({"role": m["role"], "content": m["content"]})
    return turns


def split(ids: list[int], mask: list[int]) -> Example:
    """An example of a conversation's ``ids``: the prompt up to the first masked token, the rest the response.

    Raises:
        BadRow: no token to train on.
    """
    if 1 not in mask:
        raise BadRow("no assistant token to train on")
    first = mask.index(1)
    return Example(ids[:first], ids[first:], mask[first:])


def messages_example(tokenizer, messages: Any, *, model: str, what: str, completion_from: int = 0) -> Example:
    """The example of a conversation (``conversation_tokens``), its loss on the assistant's turns from ``completion_from`` on.

    Raises:
        BadRow: not a conversation with an assistant turn after a first turn of another role.
        ConfigError: the tokenizer has no chat template, or as ``conversation_tokens`` (both name ``model.path``).
    """
    check_chat_template(tokenizer, "auto", model)
    turns = check_turns(messages, what)
    if turns[0]["role"] == "assistant":
        raise BadRow(f"{what} starts with an assistant turn: nothing to condition it on")
    if not any(t["role"] == "assistant" for t in turns[completion_from:]):
        raise BadRow(f"{what} has no assistant turn to train on")
    return split(*conversation_tokens(tokenizer, turns, model=model, completion_from=completion_from))


def text_example(tokenizer, prompt_ids: list[int], completion: str) -> Example:
    """A completion tokenized as text after ``prompt_ids``, followed by the EOS token; loss on the completion.

    Raises:
        BadRow: an empty completion.
    """
    if not completion:
        raise BadRow("the completion is empty")
    response = list(tokenizer(completion, add_special_tokens=False)["input_ids"]) + [tokenizer.eos_token_id]
    return Example(prompt_ids, response, [1] * len(response))


def row_example(row: dict, tokenizer, s: SFTConfig, d: DataConfig, model: str) -> Example:
    """The example of one row (the module docstring's formats).

    Raises:
        BadRow: the row has none of the format's fields, or they do not hold what it needs.
        ConfigError: as ``conversation_tokens``.
    """
    fmt: str = s.format
    if fmt == "auto":
        fmt = ("messages" if s.messages_field in row else "prompt_completion" if s.prompt_field in row and s.completion_field in row
               else "gsm8k" if "question" in row and "answer" in row else "")
        if not fmt:
            raise BadRow(f"none of the fields {s.messages_field!r}, {s.prompt_field!r}/{s.completion_field!r}, "
                         "'question'/'answer' (sft.format=auto)")
    if fmt == "messages":
        return messages_example(tokenizer, row.get(s.messages_field), model=model, what=f"field {s.messages_field!r}")
    if fmt == "prompt_completion":
        prompt, completion = row.get(s.prompt_field), row.get(s.completion_field)
        if isinstance(prompt, str) and isinstance(completion, str):
            return text_example(tokenizer, list(tokenizer(prompt)["input_ids"]), completion)  # special tokens as it adds them
        if isinstance(prompt, list) and isinstance(completion, list):
            head = check_turns(prompt, f"field {s.prompt_field!r}")
            return messages_example(tokenizer, head + check_turns(completion, f"field {s.completion_field!r}"), model=model,
                                    what=f"fields {s.prompt_field!r} + {s.completion_field!r}", completion_from=len(head))
        raise BadRow(f"fields {s.prompt_field!r} and {s.completion_field!r}: expected two strings or two lists of turns")
    question, answer = row.get("question"), row.get("answer")
    if not (isinstance(question, str) and question.strip() and isinstance(answer, str) and answer.strip()):
        raise BadRow("missing or empty 'question' or 'answer' string field")
    if d.chat_template == "none":  # the plain-text prompt of a base model ("...Answer:"), the answer after it, then EOS
        return text_example(tokenizer, prompt_token_ids(tokenizer, question, system_prompt=d.system_prompt, chat_template="none"),
                            " " + answer)
    messages = ([{"role": "system", "content": d.system_prompt}] if d.system_prompt else []) + [
        {"role": "user", "content": question}, {"role": "assistant", "content": answer}]
    return messages_example(tokenizer, messages, model=model, what="the question and answer")


def load_examples(path: str | Path, tokenizer, s: SFTConfig, d: DataConfig, *, model: str) -> tuple[list[Example], LoadReport]:
    """Read ``path`` (``.jsonl`` or ``.parquet``) into examples; every unusable row is counted and
    reported with its line (row) number and why, as ``dockrl.run.data.load_prompts`` does.

    Raises:
        FileNotFoundError: no such file.
        ConfigError: a row with chat turns and a tokenizer without a chat template, or a template
            that does not render conversations turn by turn (both name ``model.path``).
        ValueError: unsupported extension, or no usable row at all (the report is in the message).
    """
    path = check_data_file(path)
    report, examples = LoadReport(str(path)), list[Example]()
    for line_no, row in object_rows(path, report, text_columns=()):
        try:
            example = row_example(row, tokenizer, s, d, model)
        except BadRow as e:
            report.bad.append((line_no, str(e)))
            continue
        length = len(example.prompt_ids) + len(example.response_ids)
        if length > s.max_length:
            report.bad.append((line_no, f"{length} tokens > sft.max_length={s.max_length}"))
            continue
        examples.append(example)
    report.kept = len(examples)
    if report.bad:
        logger.warning(report.summary())
    if not examples:
        raise ValueError(f"no usable row in {report.summary()}")
    return examples, report
