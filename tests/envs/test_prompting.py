"""The prompts of a run with an environment show its tools: through the chat template where it
renders ``tools=`` in the format the run parses, else in the system prompt (``dockrl.envs.prompting``)."""

from __future__ import annotations

import pytest
from transformers import AutoTokenizer

from dockrl.config import load_config
from dockrl.config.env_sections import SandboxConfig
from dockrl.envs.calculator import CalculatorEnvironment
from dockrl.envs.prompting import describe_tools, template_renders_tools, tool_prompt
from dockrl.envs.python_tool import PythonEnvironment
from dockrl.envs.registry import environment_tools
from dockrl.envs.tool_calls import ToolCall, parse_tool_calls
from dockrl.run.data import generate_problems, prompt_token_ids, write_jsonl
from dockrl.run.setup import load_run_prompts

TOOLS = PythonEnvironment(SandboxConfig()).tools
TOOLS_TEMPLATE = (  # a ChatML template that renders tools, as Qwen2.5's does (shortened)
    "{% if tools %}<|im_start|>system\n<tools>{% for t in tools %}{{ t | tojson }}{% endfor %}</tools><|im_end|>\n{% endif %}"
    "{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>\n' }}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)


@pytest.fixture()
def tokenizer(tiny_model_dir):
    return AutoTokenizer.from_pretrained(tiny_model_dir)


@pytest.fixture()
def tools_tokenizer(tiny_model_dir):
    tok = AutoTokenizer.from_pretrained(tiny_model_dir)
    tok.chat_template = TOOLS_TEMPLATE
    return tok


@pytest.mark.parametrize("parser", ["hermes", "fenced"])
def test_the_described_call_format_is_the_format_the_parser_reads(parser):
    text = describe_tools(TOOLS, parser)
    assert "python(code: string): Run a Python program" in text
    example = text[text.index("<tool_call>"):text.index("</tool_call>") + 12] if parser == "hermes" else text[text.index("```"):]
    example = example[:example.index("```", 3) + 3] if parser == "fenced" else example
    assert parse_tool_calls(example, parser) == [ToolCall("python", {"code": "..." if parser == "hermes" else "...\n"})]


def test_a_schema_without_a_name_is_refused():
    with pytest.raises(ValueError, match=r"env tools\[0\]: expected an OpenAI function schema"):
        describe_tools([{"type": "function", "function": {"description": "no name"}}], "hermes")


def test_a_template_that_ignores_tools_gets_them_in_the_system_prompt(tokenizer):
    assert not template_renders_tools(tokenizer, TOOLS)  # the tiny model's ChatML template, as SmolLM2's, ignores tools=
    shown = tool_prompt(tokenizer, TOOLS, "hermes", system_prompt="Answer.", chat_template="auto")
    assert shown.tools is None and shown.system_prompt == "Answer.\n\n" + describe_tools(TOOLS, "hermes")
    text = tokenizer.decode(prompt_token_ids(tokenizer, "1 + 1?", system_prompt=shown.system_prompt))
    assert "<tool_call>" in text and "python(code: string)" in text


def test_a_template_that_renders_tools_gets_them_with_hermes_calls(tools_tokenizer):
    assert template_renders_tools(tools_tokenizer, TOOLS)
    shown = tool_prompt(tools_tokenizer, TOOLS, "hermes", system_prompt="Answer.", chat_template="auto")
    assert shown.tools == TOOLS and shown.system_prompt == "Answer."
    text = tools_tokenizer.decode(prompt_token_ids(tools_tokenizer, "1 + 1?", system_prompt="Answer.", tools=shown.tools))
    assert text.startswith('<|im_start|>system\n<tools>{"type": "function"') and '"name": "python"' in text
    # fenced calls and plain-text prompts: no template describes them, the system prompt does
    for parser, chat_template in (("fenced", "auto"), ("hermes", "none")):
        shown = tool_prompt(tools_tokenizer, TOOLS, parser, system_prompt="", chat_template=chat_template)  # type: ignore[arg-type]
        assert shown.tools is None and shown.system_prompt == describe_tools(TOOLS, parser)  # type: ignore[arg-type]


def test_no_tools_leave_the_prompt_as_it_was(tools_tokenizer):
    shown = tool_prompt(tools_tokenizer, [], "hermes", system_prompt="Answer.", chat_template="auto")
    assert shown.tools is None and shown.system_prompt == "Answer."


def test_run_prompts_show_the_environments_tool(tiny_model_dir, tokenizer, tmp_path):
    data = write_jsonl(generate_problems(3, seed=0), tmp_path / "data.jsonl")
    cfg = load_config(None, [f"model.path={tiny_model_dir}", "env.name=calculator", "rollout.max_turns=3",
                             "data.max_prompt_length=512"])
    tools = environment_tools(cfg)
    assert tools == CalculatorEnvironment("hermes").tools
    train, test = load_run_prompts(cfg, tokenizer, data, data, tools=tools)
    text = tokenizer.decode(train[0].prompt_ids)
    assert "calculator(expression: string)" in text and "<tool_call>" in text and train[0].prompt_ids == test[0].prompt_ids
    plain, _ = load_run_prompts(load_config(None, [f"model.path={tiny_model_dir}"]), tokenizer, data, data, tools=[])
    assert "calculator" not in tokenizer.decode(plain[0].prompt_ids)
    assert environment_tools(load_config(None, [f"model.path={tiny_model_dir}"])) == []
