"""Tool calls read from a model turn's text, in the two formats of ``env.tool_parser``.

* ``hermes``: the Hermes / Qwen2.5 chat templates' format, one JSON object per call between tags:
  ``<tool_call>\\n{"name": "python", "arguments": {"code": "print(1)"}}\\n</tool_call>``
  (the object is read with ``json``; ``arguments`` may also be a JSON string of an object, as some
  models write it).
* ``fenced``: a Markdown fenced code block (```` ```python ... ``` ````, or ``py``, or no language)
  calls the environment's one tool with the block's text as its one argument.

A call that cannot be read (bad JSON, no name, an unclosed tag or fence) is a ``ToolCallError``
in the result, never an exception: the environment counts it as a tool error and tells the model.

A model turn ends where its tool calls end (``calls_end``): the rollout cuts what the model wrote
after them, as a stop sequence would, and the tool answers.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from typing import Literal

ToolParser = Literal["hermes", "fenced"]

_HERMES = re.compile(r"<tool_call>(.*?)</tool_call>", re.S)
_FENCE = re.compile(r"```[ \t]*([A-Za-z0-9_+-]*)[ \t]*\n(.*?)```", re.S)
_FENCED_LANGUAGES = ("", "python", "py", "python3")


@dataclass(frozen=True)
class ToolCall:
    """One call: the tool's name and its arguments (a JSON object)."""

    name: str
    arguments: dict = field(default_factory=dict)


@dataclass(frozen=True)
class ToolCallError:
    """A call that could not be read: why, and the text it was read from (cut to 200 characters)."""

    reason: str
    text: str = ""


def parse_tool_calls(text: str, parser: ToolParser, *, fenced_tool: tuple[str, str] = ("python", "code")) -> list[ToolCall | ToolCallError]:
    """The tool calls of one model turn, in order; empty when the turn calls no tool.

    Args:
        text: the turn's decoded text.
        parser: ``hermes`` or ``fenced`` (``env.tool_parser``).
        fenced_tool: ``(tool name, argument name)`` a fenced block calls (``fenced`` only).

    Raises:
        ValueError: an unknown ``parser`` (a config error caught at load; never for the text).
    """
    if parser == "hermes":
        return _hermes(text)
    if parser == "fenced":
        return _fenced(text, fenced_tool)
    raise ValueError(f"env.tool_parser: got {parser!r}; expected one of 'hermes', 'fenced'")


def calls_end(text: str, parser: ToolParser) -> int | None:
    """The offset in ``text`` just after the turn's tool calls, where the rollout ends the turn; None without a
    complete call.

    ``fenced``: the end of the first closed block in a language the parser reads (one call per turn, as
    code-interpreter rollouts run a block as soon as it closes: ToRA, arXiv 2309.17452). ``hermes``: the end
    of the closed ``<tool_call>`` blocks that follow the first with only whitespace between them (the
    parallel calls of one turn).

    Raises:
        ValueError: an unknown ``parser``.
    """
    if parser == "fenced":
        return next((m.end() for m in _FENCE.finditer(text) if m.group(1).lower() in _FENCED_LANGUAGES), None)
    if parser == "hermes":
        end = None
        for m in _HERMES.finditer(text):
            if end is not None and text[end:m.start()].strip():
                break
            end = m.end()
        return end
    raise ValueError(f"env.tool_parser: got {parser!r}; expected one of 'hermes', 'fenced'")


def _hermes(text: str) -> list[ToolCall | ToolCallError]:
    calls: list[ToolCall | ToolCallError] = [_hermes_call(m.group(1)) for m in _HERMES.finditer(text)]
    rest = _HERMES.sub("", text)
    if "<tool_call>" in rest:  # an opening tag left without its closing one (the turn was cut, or the model forgot it)
        calls.append(ToolCallError("<tool_call> without </tool_call>", rest[rest.index("<tool_call>"):][:200]))
    return calls


def _hermes_call(body: str) -> ToolCall | ToolCallError:
    try:
        obj = json.loads(body)
    except json.JSONDecodeError as e:
        return ToolCallError(f"not JSON ({e.msg} at line {e.lineno} column {e.colno})", body.strip()[:200])
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str) or not obj["name"]:
        return ToolCallError('expected a JSON object {"name": <tool>, "arguments": {...}}', body.strip()[:200])
    arguments = obj.get("arguments", {})
    if isinstance(arguments, str):  # some models write the arguments as a JSON string
        try:
            arguments = json.loads(arguments)
        except json.JSONDecodeError:
            pass
    if not isinstance(arguments, dict):
        return ToolCallError(f"'arguments' of {obj['name']!r} is not a JSON object", body.strip()[:200])
    return ToolCall(obj["name"], arguments)


def _fenced(text: str, tool: tuple[str, str]) -> list[ToolCall | ToolCallError]:
    name, argument = tool
    calls: list[ToolCall | ToolCallError] = [ToolCall(name, {argument: m.group(2)}) for m in _FENCE.finditer(text)
                                              if m.group(1).lower() in _FENCED_LANGUAGES]
    rest = _FENCE.sub("", text)
    if "```" in rest:
        calls.append(ToolCallError("a code block opened with ``` is not closed", rest[rest.index("```"):][:200]))
    return calls


def describe_error(error: ToolCallError) -> str:
    """The observation that tells the model its call could not be read."""
    return f"Error: the tool call could not be read: {error.reason}." + (f"\n{error.text}" if error.text else "")
