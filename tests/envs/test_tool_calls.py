"""Tool-call parsers (dockrl.envs.tool_calls): Hermes/Qwen2.5 tags and fenced blocks; bad calls are errors in the result."""

from __future__ import annotations

import pytest

from dockrl.envs.tool_calls import ToolCall, ToolCallError, calls_end, describe_error, parse_tool_calls


def test_hermes_reads_each_call_in_order():
    text = ('Let me compute.\n<tool_call>\n{"name": "python", "arguments": {"code": "print(2 ** 10)"}}\n</tool_call>\n'
            '<tool_call>{"name": "calculator", "arguments": "{\\"expression\\": \\"1+1\\"}"}</tool_call>')
    assert parse_tool_calls(text, "hermes") == [ToolCall("python", {"code": "print(2 ** 10)"}), ToolCall("calculator", {"expression": "1+1"})]


def test_hermes_without_a_call_is_empty():
    assert parse_tool_calls("The answer is #### 42", "hermes") == []


@pytest.mark.parametrize("body, reason", [
    ("{name: python}", "not JSON"),
    ('["python"]', "expected a JSON object"),
    ('{"arguments": {}}', "expected a JSON object"),
    ('{"name": "python", "arguments": [1]}', "is not a JSON object"),
])
def test_hermes_bad_calls_are_errors_not_exceptions(body, reason):
    (call,) = parse_tool_calls(f"<tool_call>{body}</tool_call>", "hermes")
    assert isinstance(call, ToolCallError) and reason in call.reason
    assert reason in describe_error(call)


def test_hermes_unclosed_tag_is_an_error_after_the_good_calls():
    calls = parse_tool_calls('<tool_call>{"name": "a", "arguments": {}}</tool_call> then <tool_call>{"name": "b"', "hermes")
    assert calls[0] == ToolCall("a", {}) and isinstance(calls[1], ToolCallError) and "without </tool_call>" in calls[1].reason


def test_fenced_reads_python_blocks_and_skips_other_languages():
    text = "Here:\n```python\nprint(1)\n```\nand output\n```output\n1\n```\nthen\n```\nx = 2\n```"
    assert parse_tool_calls(text, "fenced") == [ToolCall("python", {"code": "print(1)\n"}), ToolCall("python", {"code": "x = 2\n"})]
    calls = parse_tool_calls("```py\n1+1\n```", "fenced", fenced_tool=("calculator", "expression"))
    assert calls == [ToolCall("calculator", {"expression": "1+1\n"})]


def test_fenced_unclosed_block_is_an_error():
    (call,) = parse_tool_calls("```python\nprint(1)\n", "fenced")
    assert isinstance(call, ToolCallError) and "not closed" in call.reason


def test_unknown_parser_names_the_field():
    with pytest.raises(ValueError, match="env.tool_parser"):
        parse_tool_calls("x", "xml")  # type: ignore[arg-type]


def test_calls_end_after_the_first_fenced_block_or_the_first_run_of_hermes_calls():
    text = "Let me compute.\n```\n12 * 34\n```\nThen more\n```\nbad"
    assert text[:calls_end(text, "fenced")] == "Let me compute.\n```\n12 * 34\n```"
    assert calls_end("```output\n1\n```\n```py\n2\n```", "fenced") == len("```output\n1\n```\n```py\n2\n```")  # output is not a call
    calls = '<tool_call>{"name": "a"}</tool_call>\n <tool_call>{"name": "b"}</tool_call>'
    assert calls_end(calls + " and then <tool_call>{}</tool_call>", "hermes") == len(calls)  # text between: the run ended
    assert calls_end("no call ``` here", "fenced") is None and calls_end("<tool_call>{", "hermes") is None
    with pytest.raises(ValueError, match="env.tool_parser"):
        calls_end("x", "json")  # type: ignore[arg-type]
