"""An agent of the bundled tool task written against the ``openai`` client, for ``benchmarks/gateway.py``: the same
loop the ``calculator`` environment runs, on the agent's side of the gateway.

It reads its task (``messages``) from stdin, takes ``OPENAI_BASE_URL`` and ``OPENAI_API_KEY`` from its environment,
and asks the model with the calculator tool until a turn calls none (or the gateway ends the session): each call's
result, as the calculator environment computes it, goes back as a ``tool`` message.
"""

from __future__ import annotations

import json
import sys

import openai

from dockrl.envs.calculator import CalculationError, CalculatorEnvironment, evaluate

TOOLS = CalculatorEnvironment().tools


def run_call(arguments: str) -> str:
    try:
        return str(evaluate(json.loads(arguments)["expression"]))
    except (CalculationError, json.JSONDecodeError, KeyError, TypeError) as e:
        return f"Error: {e}"


def main() -> None:
    messages = list(json.load(sys.stdin)["messages"])
    client = openai.OpenAI(max_retries=0, timeout=600)
    while True:
        try:
            response = client.chat.completions.create(model="policy", messages=messages, tools=TOOLS)
        except openai.BadRequestError:  # the session's budget is spent: the gateway ended it
            return
        message = response.choices[0].message
        if not message.tool_calls or response.choices[0].finish_reason == "length":
            return
        messages.append(message.model_dump(exclude_none=True))
        messages += [{"role": "tool", "tool_call_id": c.id, "content": run_call(c.function.arguments)} for c in message.tool_calls]


if __name__ == "__main__":
    main()
