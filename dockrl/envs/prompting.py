"""How a run's prompts tell the model about its environment's tools (``Environment.tools``).

With ``env.tool_parser=hermes`` and a chat template that renders ``tools=`` (Qwen2.5's, Hermes'),
the template gets the tools: it describes them and the ``<tool_call>`` format in its own words,
which the model was trained on. Otherwise (a template that ignores ``tools=``, as SmolLM2's does;
the ``fenced`` format, which no template describes; ``data.chat_template=none``) the system
prompt gets a paragraph that lists the tools and shows the call format (``describe_tools``).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any, Sequence

from dockrl.envs.tool_calls import ToolParser

_PROBE = [{"role": "user", "content": "1"}]


@dataclass(frozen=True)
class ToolPrompt:
    """What the prompts of a run with tools are built from (``dockrl.run.data.prompt_token_ids``)."""

    tools: list[dict] | None
    """The schemas given to the chat template (``tools=``); None when the system prompt describes them."""
    system_prompt: str
    """``data.system_prompt``, followed by ``describe_tools`` when the template does not render the tools."""


def template_renders_tools(tokenizer: Any, tools: Sequence[dict]) -> bool:
    """Whether the tokenizer's chat template puts ``tools`` into a prompt (its rendering changes with them)."""
    if not getattr(tokenizer, "chat_template", None):
        return False
    plain = tokenizer.apply_chat_template(_PROBE, add_generation_prompt=True, tokenize=False)
    return plain != tokenizer.apply_chat_template(_PROBE, tools=list(tools), add_generation_prompt=True, tokenize=False)


def describe_tools(tools: Sequence[dict], parser: ToolParser) -> str:
    """A system-prompt paragraph: each tool (name, description, arguments) and how to call it in ``parser``'s format.

    Raises:
        ValueError: a schema without ``function.name`` (OpenAI function format expected), or an unknown ``parser``.
    """
    lines, first = [], None
    for i, tool in enumerate(tools):
        fn = tool.get("function", tool)
        if not isinstance(fn, dict) or not isinstance(fn.get("name"), str):
            raise ValueError(f"env tools[{i}]: expected an OpenAI function schema {{'type': 'function', 'function': "
                             f"{{'name': ..., 'parameters': ...}}}}; got {tool!r}")
        properties = fn.get("parameters", {}).get("properties", {})
        arguments = ", ".join(f"{name}: {spec.get('type', 'any')}" for name, spec in properties.items())
        lines.append(f"- {fn['name']}({arguments}): {fn.get('description', '')}".rstrip())
        first = first or (fn["name"], next(iter(properties), "input"))
    if first is None:
        return ""
    name, argument = first
    if parser == "hermes":
        call = ("To call a tool, write the call as JSON between tags, e.g.\n<tool_call>\n"
                + json.dumps({"name": name, "arguments": {argument: "..."}}) + "\n</tool_call>")
    elif parser == "fenced":
        call = f"To call {name}, write its {argument} in a fenced code block:\n```python\n...\n```"
    else:
        raise ValueError(f"env.tool_parser: got {parser!r}; expected one of 'hermes', 'fenced'")
    return ("You can use tools. Available tools:\n" + "\n".join(lines) + "\n" + call
            + "\nThe tool's output comes back in the next message. Once you know the answer, reply without a tool call.")


def tool_prompt(tokenizer: Any, tools: Sequence[dict], parser: ToolParser, *, system_prompt: str, chat_template: str) -> ToolPrompt:
    """The tools for the chat template, or the system prompt that describes them (module docstring).

    Args:
        tokenizer: the policy's HF tokenizer.
        tools: ``Environment.tools`` (empty: no tools, the system prompt unchanged).
        parser: ``env.tool_parser``.
        system_prompt: ``data.system_prompt``.
        chat_template: ``data.chat_template`` (``auto`` or ``none``).
    """
    if not tools:
        return ToolPrompt(None, system_prompt)
    if parser == "hermes" and chat_template == "auto" and template_renders_tools(tokenizer, tools):
        return ToolPrompt(list(tools), system_prompt)
    described = describe_tools(tools, parser)
    return ToolPrompt(None, f"{system_prompt}\n\n{described}" if system_prompt else described)
