"""A two-turn tool agent written against the ``openai`` client, as a user's agent is: the gateway tests run it as the
agent's command (``python tests/tool_agent.py``).

It reads its task (``messages``, ``tools``) from stdin and takes ``OPENAI_BASE_URL`` and ``OPENAI_API_KEY`` from its
environment, as the client does. Turn 1 asks the model with the calculator tool; it runs each tool call the model
made and answers with the results, or, without a call, says so in a user turn; turn 2 is the answer. Words in the
question make it misbehave, for the tests of what the gateway does then: ``FOREVER``, it never stops asking;
``CRASH``, it raises after its first turn; ``SLEEP``, it sleeps for ten minutes before it asks; ``EDIT``, it changes the
model's first answer before it sends it back. ``REWARD`` makes it post a reward of 0.75 before it exits. With
``AGENT_TRANSCRIPTS`` set it writes its conversation to ``<AGENT_TRANSCRIPTS>/<its first turn's id>.json``.
"""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path

import httpx
from openai import OpenAI

from dockrl.envs.calculator import CalculationError, evaluate

CALCULATOR = {"type": "function", "function": {
    "name": "calculator", "description": "Evaluate an arithmetic expression.",
    "parameters": {"type": "object", "properties": {"expression": {"type": "string"}}, "required": ["expression"]}}}
NO_CALL = "Use the calculator, then give the answer as #### <number>."


def run_tool(arguments: str) -> str:
    try:
        return str(evaluate(json.loads(arguments)["expression"]))
    except (CalculationError, json.JSONDecodeError, KeyError, TypeError) as e:
        return f"Error: {e}"


def main() -> None:
    task = json.load(sys.stdin)
    client = OpenAI(max_retries=0, timeout=120)
    messages = list(task["messages"])
    question = messages[-1]["content"]
    ids = []
    turns = 0
    if "SLEEP" in question:
        time.sleep(600)
    while True:
        response = client.chat.completions.create(model="policy", messages=messages, tools=[CALCULATOR], logprobs=True)
        ids.append(response.id)
        message = response.choices[0].message
        messages.append(message.model_dump(exclude_none=True))
        turns += 1
        if "CRASH" in question:
            raise RuntimeError("the agent broke after its first turn")
        if turns == 2 and "FOREVER" not in question:
            break
        if "EDIT" in question:
            messages[-1]["content"] = "something the model did not write"
        if message.tool_calls:
            messages += [{"role": "tool", "tool_call_id": call.id, "content": run_tool(call.function.arguments)}
                         for call in message.tool_calls]
        else:
            messages.append({"role": "user", "content": NO_CALL})
    if "REWARD" in question:
        client.post("/session/end", body={"reward": 0.75}, cast_to=httpx.Response)
    if os.environ.get("AGENT_TRANSCRIPTS"):
        Path(os.environ["AGENT_TRANSCRIPTS"], f"{ids[0]}.json").write_text(json.dumps({"messages": messages, "ids": ids}))


if __name__ == "__main__":
    main()
