"""Prompt datasets in GSM8K format: a seeded problem generator and a validating loader.

A row has ``question`` (str) and ``answer`` (str ending in ``#### <number>``), as in GSM8K
(Cobbe et al., 2021). ``load_prompts`` reads JSONL or Parquet, applies the chat template,
tokenizes, and reports every unusable line with its number and reason.
"""

from __future__ import annotations

import codecs
import functools
import importlib.util
import itertools
import json
import logging
import os
import random
import re
import stat
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, BinaryIO, Iterable, Iterator, Sequence

from dockrl.config import ConfigError

logger = logging.getLogger(__name__)

NAMES = ["Tom", "Sara", "Ali", "Mia", "Ken", "Lea", "Raj", "Ana", "Ben", "Zoe"]
ITEMS = ["apples", "pencils", "stickers", "marbles", "books", "cookies", "coins", "cards"]


def _one_step(rng: random.Random, name: str, item: str, start: int, max_number: int) -> tuple[str, str, int]:
    """One sentence that changes the running total; returns (sentence, worked step, new total)."""
    kind = rng.choice(["add", "sub", "mul"] if start <= max_number // 3 else ["add", "sub"])
    if kind == "add":
        k = rng.randint(2, max_number)
        return rng.choice([f"{name} buys {k} more {item}.", f"{name} gets {k} more {item}."]), f"{start} + {k} = {start + k}", start + k
    if kind == "sub" and start > 2:
        k = rng.randint(1, start - 1)
        return rng.choice([f"{name} gives away {k} {item}.", f"{name} loses {k} {item}."]), f"{start} - {k} = {start - k}", start - k
    k = rng.randint(2, 4)
    return f"Then the number of {item} {name} has becomes {k} times as large.", f"{start} * {k} = {start * k}", start * k


def generate_problems(count: int, *, seed: int, min_steps: int = 1, max_steps: int = 2, max_number: int = 20) -> list[dict[str, str]]:
    """Seeded multi-step arithmetic word problems in GSM8K format.

    Args:
        count: number of problems.
        seed: RNG seed; the same seed gives the same problems.
        min_steps, max_steps: number of operations after the starting quantity.
        max_number: largest operand.

    Returns:
        ``[{"question": str, "answer": "<worked steps> #### <int>"}, ...]``.
    """
    if not 1 <= min_steps <= max_steps:
        raise ValueError(f"steps: need 1 <= min_steps <= max_steps, got {min_steps}, {max_steps}")
    rng = random.Random(seed)
    problems = []
    for _ in range(count):
        name, item = rng.choice(NAMES), rng.choice(ITEMS)
        total = rng.randint(2, max_number)
        sentences, steps = [f"{name} has {total} {item}."], []
        for _ in range(rng.randint(min_steps, max_steps)):
            sentence, step, new_total = _one_step(rng, name, item, total, max_number)
            sentences.append(sentence)
            steps.append(step)
            total = new_total
        question = " ".join(sentences) + f" How many {item} does {name} have now?"
        problems.append({"question": question, "answer": ". ".join(steps) + f".\n#### {total}"})
    return problems


def write_jsonl(rows: Iterable[dict[str, Any]], path: str | Path) -> Path:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("w") as f:
        for row in rows:
            f.write(json.dumps(row) + "\n")
    return path


def final_answer_of(answer: str) -> str | None:
    """The reference final answer: the text after the last ``####``, or None."""
    if "####" not in answer:
        return None
    text = answer.rsplit("####", 1)[1].strip().replace(",", "")
    return text or None


@dataclass(frozen=True)
class Prompt:
    """One usable prompt: chat-formatted token ids and the reference final answer."""

    index: int
    question: str
    ground_truth: str
    prompt_ids: list[int]


@dataclass
class LoadReport:
    """What ``load_prompts`` kept and dropped: ``bad`` holds (line number, reason)."""

    path: str
    kept: int = 0
    bad: list[tuple[int, str]] = field(default_factory=list)
    duplicates: int = 0
    """Kept rows whose question an earlier row already asked (kept: a data set may weigh a problem so)."""

    def summary(self, *, one_line: bool = False, shown: int = 20) -> str:
        """The counts and the first ``shown`` dropped lines with their reasons: one per line, or ``one_line``
        (for an error message) in parentheses after the counts."""
        head = f"{self.path}: kept {self.kept} rows, dropped {len(self.bad)}"
        if self.duplicates:
            head += f", {self.duplicates} repeat an earlier question"
        lines = [f"line {n}: {why}" for n, why in self.bad[:shown]] + ([f"... and {len(self.bad) - shown} more"] if len(self.bad) > shown else [])
        if one_line:
            return head + (f" ({'; '.join(lines)})" if lines else "")
        return head + "".join(f"\n  {line}" for line in lines)


def check_data_file(path: str | Path) -> Path:
    """``path`` as a ``Path`` when it is a file ``load_prompts`` reads (``.jsonl``, ``.json`` or ``.parquet``).

    Raises:
        FileNotFoundError: no such file.
        ValueError: a directory, a file this user may not read, or another extension.
    """
    path = Path(path)
    if path.is_dir():
        raise ValueError(f"data file {path} is a directory; expected a .jsonl or .parquet file")
    if not path.is_file():
        raise FileNotFoundError(f"data file {path} does not exist")
    if not os.access(path, os.R_OK):
        raise ValueError(f"data file {path} is not readable by this user (its permissions: {stat.filemode(path.stat().st_mode)})")
    if path.suffix not in (".jsonl", ".json", ".parquet"):
        raise ValueError(f"data file {path}: a {path.suffix or 'extension-less'} file; expected a .jsonl or .parquet file with "
                         "'question' and 'answer' (a CSV converts with pandas: read_csv(...).to_json(lines=True, orient='records'))")
    return path


MAX_ROW_BYTES = 1 << 20
"""The longest data row (a JSONL line, or a Parquet row's question and answer), in bytes: a longer one is
dropped unread, before anything parses or tokenizes it (1 MiB: far above any prompt a model takes)."""


class RowTooLong(ValueError):
    """A data row over ``MAX_ROW_BYTES``, skipped without being read whole."""


def _jsonl_lines(f: BinaryIO) -> Iterator[tuple[int, bytes | RowTooLong]]:
    """(line number, line) of a binary file, a line over ``MAX_ROW_BYTES`` as a ``RowTooLong`` (read in
    1 MiB pieces and dropped: memory stays bounded whatever the line's length)."""
    for i in itertools.count(1):
        line = f.readline(MAX_ROW_BYTES + 1)
        if not line:
            return
        if len(line) <= MAX_ROW_BYTES or line.endswith(b"\n"):
            yield i, line
            continue
        size = len(line)
        while line and not line.endswith(b"\n"):
            line = f.readline(MAX_ROW_BYTES)
            size += len(line)
        yield i, RowTooLong(f"a line of {size} bytes > {MAX_ROW_BYTES} (dropped unread)")


def read_rows(path: Path, text_columns: Sequence[str] = ("question", "answer")) -> Iterable[tuple[int, Any]]:
    """(line or row number, row) of a JSONL or Parquet data file: a dict, or for a bad line the
    exception saying why (invalid JSON, ``RowTooLong``).

    ``text_columns``: the string columns a Parquet file must have (GSM8K's by default), whose
    lengths bound a row's size; with none, each row's size is that of its JSON text.

    Raises:
        ValueError: not a readable Parquet file, or one without ``text_columns`` as strings; a JSON array.
    """
    if path.suffix == ".parquet":
        import pyarrow as pa  # lazy: pyarrow.parquet loads in ~0.15 s, only for a Parquet file; this module stays light
        import pyarrow.compute as pc  # lazy: as pyarrow
        import pyarrow.parquet as pq  # lazy: as pyarrow above

        try:
            table = pq.read_table(path)
        except (pa.ArrowException, OSError) as e:
            raise ValueError(f"data file {path}: not a readable Parquet file ({e})") from None
        for name in text_columns:
            if name not in table.schema.names:
                raise ValueError(f"data file {path}: no column {name!r} (columns: {table.schema.names}); "
                                 f"expected string columns {', '.join(repr(c) for c in text_columns)}")
            if not (pa.types.is_string(table.schema.field(name).type) or pa.types.is_large_string(table.schema.field(name).type)):
                raise ValueError(f"data file {path}: column {name!r} is {table.schema.field(name).type}; expected strings")
        rows = table.to_pylist()
        if text_columns:
            lengths = [pc.fill_null(pc.binary_length(table[name]), 0) for name in text_columns]
            sizes = functools.reduce(pc.add, lengths).to_pylist()
        else:
            sizes = [len(json.dumps(row, default=str).encode()) for row in rows]
        for i, (row, size) in enumerate(zip(rows, sizes), start=1):
            yield i, RowTooLong(f"a row of {size} bytes > {MAX_ROW_BYTES}") if size > MAX_ROW_BYTES else row
        return
    with path.open("rb") as f:
        head = f.read(4096).removeprefix(codecs.BOM_UTF8).lstrip()
        if head.startswith(b"["):
            raise ValueError(f"data file {path}: a JSON array; expected JSON Lines, one object per line "
                             "(convert it: jq -c '.[]' FILE > FILE.jsonl)")
        f.seek(0)  # decoded line by line: a line that is not UTF-8 is one bad line, not a failed file
        for i, raw in _jsonl_lines(f):
            if isinstance(raw, RowTooLong):
                yield i, raw
                continue
            if not raw.strip():
                continue
            try:
                yield i, json.loads(raw.decode("utf-8-sig"))  # -sig: a file saved with a BOM keeps its first row
            except (UnicodeDecodeError, json.JSONDecodeError) as e:
                yield i, e


PLAIN_PROMPT = "{system}Question: {question}\nAnswer:"
"""The prompt text with ``data.chat_template=none``; ``{system}`` is the system prompt and a blank
line, or nothing when ``data.system_prompt`` is empty."""


def check_chat_template(tokenizer, chat_template: str, model: str) -> None:
    """Refuse ``data.chat_template=auto`` with a tokenizer that has no chat template.

    Raises:
        ConfigError: names ``model.path`` (``model``) and the two ways out.
    """
    if chat_template == "auto" and not getattr(tokenizer, "chat_template", None):
        raise ConfigError(
            f"model.path: the tokenizer of {model!r} has no chat template, and data.chat_template='auto' formats prompts "
            "with it: use a chat model's folder, or set data.chat_template=none to give the model plain-text prompts "
            f"({PLAIN_PROMPT!r}; docs/data.md)"
        )


def prompt_token_ids(tokenizer, question: str, *, system_prompt: str, chat_template: str = "auto",
                     tools: Sequence[dict] | None = None) -> list[int]:
    """Token ids of one prompt: the tokenizer's chat template with a generation prompt (``auto``),
    or ``PLAIN_PROMPT`` tokenized as text, special tokens (a BOS) as the tokenizer adds them (``none``).

    ``tools`` (OpenAI function schemas) go to the chat template (``tools=``), which renders them as it
    was trained to; ``dockrl.envs.prompting.tool_prompt`` decides whether a run's tools go there.

    Raises:
        ValueError: unknown ``chat_template``.
    """
    if chat_template == "none":
        text = PLAIN_PROMPT.format(system=f"{system_prompt}\n\n" if system_prompt else "", question=question)
        return list(tokenizer(text)["input_ids"])
    if chat_template != "auto":
        raise ValueError(f"data.chat_template: got {chat_template!r}; expected one of 'auto', 'none'")
    messages = ([{"role": "system", "content": system_prompt}] if system_prompt else []) + [{"role": "user", "content": question}]
    ids = tokenizer.apply_chat_template(messages, tools=list(tools) if tools else None, add_generation_prompt=True, tokenize=True,
                                        return_dict=False)
    return ids.tolist() if hasattr(ids, "tolist") else list(ids)


def object_rows(path: Path, report: LoadReport, text_columns: Sequence[str] = ("question", "answer"), *,
                not_object: str = "not a JSON object") -> Iterable[tuple[int, dict]]:
    """(line or row number, row) of each JSON object ``read_rows`` reads from ``path``; a line too long, of invalid JSON
    or not an object is counted in ``report.bad`` with its number and why (``not_object`` for the last), and skipped.

    Raises:
        ValueError: as ``read_rows``.
    """
    for line_no, row in read_rows(path, text_columns):
        if isinstance(row, RowTooLong):
            report.bad.append((line_no, str(row)))
        elif isinstance(row, Exception):
            report.bad.append((line_no, f"invalid JSON: {row}"))
        elif not isinstance(row, dict):
            report.bad.append((line_no, not_object))
        else:
            yield line_no, row


def load_prompts(
    path: str | Path, tokenizer, *, system_prompt: str, max_prompt_length: int, chat_template: str = "auto", model: str = "",
    tools: Sequence[dict] | None = None,
) -> tuple[list[Prompt], LoadReport]:
    """Read a GSM8K-format file, format each question as a prompt (``prompt_token_ids``) and tokenize.

    Args:
        path: ``.jsonl`` or ``.parquet`` with ``question`` and ``answer`` fields.
        tokenizer: an HF tokenizer (with a chat template unless ``chat_template='none'``).
        system_prompt: system message put before each question ("" for none).
        max_prompt_length: longest prompt in tokens; longer rows are dropped and reported.
        chat_template: ``data.chat_template``: ``auto`` (the tokenizer's) or ``none`` (plain text).
        model: ``model.path``, for the error when the tokenizer has no chat template.
        tools: tool schemas for the chat template (``prompt_token_ids``), or None.

    Returns:
        The usable prompts and a report of the dropped lines.

    Raises:
        FileNotFoundError: no such file.
        ConfigError: ``chat_template='auto'`` and the tokenizer has none (names ``model.path``).
        ValueError: unsupported extension, or no usable row at all (the report is in the message).
    """
    from dockrl.rewards.math_verifier import extract_final_answer  # lazy: math_verify loads sympy (seconds); generating problems does not need it

    check_chat_template(tokenizer, chat_template, model)
    path = check_data_file(path)
    report, prompts, seen = LoadReport(str(path)), list[Prompt](), set[str]()
    missing = "missing 'question' or 'answer' string field"
    for line_no, row in object_rows(path, report, not_object=missing):
        if not isinstance(row.get("question"), str) or not isinstance(row.get("answer"), str):
            report.bad.append((line_no, missing))
            continue
        if not row["question"].strip():
            report.bad.append((line_no, "the question is empty"))
            continue
        truth = final_answer_of(row["answer"])
        if truth is None:
            report.bad.append((line_no, "answer has no final '#### <number>'"))
            continue
        if extract_final_answer(row["answer"]) is None:  # the verifier's own reading of a number
            report.bad.append((line_no, f"answer's final '#### {truth[:30]}' is not a number (the verifier compares numbers)"))
            continue
        ids = prompt_token_ids(tokenizer, row["question"], system_prompt=system_prompt, chat_template=chat_template, tools=tools)
        if len(ids) > max_prompt_length:
            report.bad.append((line_no, f"prompt has {len(ids)} tokens > data.max_prompt_length={max_prompt_length}"))
            continue
        report.duplicates += row["question"] in seen
        seen.add(row["question"])
        prompts.append(Prompt(len(prompts), row["question"], truth, list(ids)))
    report.kept = len(prompts)
    if not prompts:  # the reasons once, in the error's one line
        raise ValueError(f"no usable row in {report.summary(one_line=True, shown=5)}")
    if report.bad or report.duplicates:
        logger.warning(report.summary())
    return prompts, report


_NUMBER = re.compile(r"-?[\d,]*\.?\d+(/\d+)?")


def export_champ(path: str | Path) -> Path:
    """Write the CHAMP competition-math problems with a numeric final answer as GSM8K JSONL.

    CHAMP (Mao et al., 2024, arXiv 2401.06961; PyPI ``champ-dataset``, MIT) has 270
    problems; those whose answer is an expression or a word (about two thirds) cannot be
    scored by a numeric verifier and are skipped with a count in the log.

    Raises:
        FileNotFoundError: ``champ-dataset`` is not installed (``pip install 'dockrl[champ]'``).
    """
    spec = importlib.util.find_spec("champ_dataset")
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError("data.test_path=champ needs the PyPI package 'champ-dataset' (pip install 'dockrl[champ]')")
    source = Path(list(spec.submodule_search_locations)[0]) / "dataset_files" / "v0.json"
    problems = json.loads(source.read_text())["problems"]
    rows = [
        {"question": p["_text"], "answer": f"#### {p['_answer'].strip()}"}
        for p in problems.values()
        if _NUMBER.fullmatch(p["_answer"].strip())
    ]
    logger.info("CHAMP: %d problems with a numeric answer, %d skipped", len(rows), len(problems) - len(rows))
    return write_jsonl(rows, path)
