"""Bundled tasks of the environments, as package data in GSM8K format (``question``, ``answer``
ending in ``#### <number>``) that ``dockrl.run.data.load_prompts`` reads:

* ``TOOL_TRAIN`` / ``TOOL_TEST``: arithmetic on numbers of several digits (``generate_tool_problems``,
  seeds 1 and 2), which a 135M model cannot do in its head and the ``python`` or ``calculator``
  tool can; the rule verifier scores the final answer.
* ``CODE_PROBLEMS``: ten MBPP-style programming problems (after Austin et al. 2021, arXiv 2108.07732;
  written for dockrl), each with three ``assert`` tests in the row's ``tests`` field and a
  reference solution in its ``answer``. The loader needs a number after ``####``: it is the
  problem's ``task_id``, which ``dockrl.rewards.code.CodeScorer`` looks the tests up by.
"""

from __future__ import annotations

import json
import random
from pathlib import Path

DATA = Path(__file__).with_name("data")
TOOL_TRAIN = DATA / "tool_arithmetic_train.jsonl"
"""256 generated problems (seed 1)."""
TOOL_TEST = DATA / "tool_arithmetic_test.jsonl"
"""64 generated problems (seed 2)."""
CODE_PROBLEMS = DATA / "code_problems.jsonl"
"""The programming problems: ``question``, ``answer`` (a reference solution, ``#### <task_id>``), ``task_id``, ``tests``."""
TOOL_SEEDS = {TOOL_TRAIN: (256, 1), TOOL_TEST: (64, 2)}
"""Each bundled tool file's (count, seed) of ``generate_tool_problems``."""


def generate_tool_problems(count: int, *, seed: int, min_digits: int = 3, max_digits: int = 5) -> list[dict[str, str]]:
    """Seeded arithmetic problems on numbers of ``min_digits`` to ``max_digits`` digits, in GSM8K format:
    a product of two numbers, a sum of three, or a product minus a number.

    Returns:
        ``[{"question": str, "answer": "<the computation> #### <int>"}, ...]``; the same seed gives the same problems.

    Raises:
        ValueError: ``1 <= min_digits <= max_digits`` does not hold.
    """
    if not 1 <= min_digits <= max_digits:
        raise ValueError(f"digits: need 1 <= min_digits <= max_digits, got {min_digits}, {max_digits}")
    rng = random.Random(seed)

    def number() -> int:
        digits = rng.randint(min_digits, max_digits)
        return rng.randint(10 ** (digits - 1), 10**digits - 1)

    problems = []
    for _ in range(count):
        kind = rng.choice(["product", "sum", "product_minus"])
        a, b, c = number(), number(), number()
        if kind == "product":
            question, work, value = f"What is {a} multiplied by {b}?", f"{a} * {b}", a * b
        elif kind == "sum":
            question, work, value = f"What is the sum of {a}, {b} and {c}?", f"{a} + {b} + {c}", a + b + c
        else:
            question, work, value = f"What is {a} times {b}, minus {c}?", f"{a} * {b} - {c}", a * b - c
        problems.append({"question": question, "answer": f"{work} = {value}\n#### {value}"})
    return problems


def load_code_problems(path: str | Path = CODE_PROBLEMS) -> dict[str, list[str]]:
    """The tests of each programming problem, by ``task_id`` as text (the ground truth the loader reads after ``####``).

    Raises:
        ValueError: a line without an integer ``task_id`` or a non-empty list of ``tests`` strings (names the line).
    """
    tests: dict[str, list[str]] = {}
    for number, line in enumerate(Path(path).read_text(encoding="utf-8-sig").splitlines(), start=1):  # -sig: a BOM is no row
        if not line.strip():
            continue
        row = json.loads(line)
        if not isinstance(row.get("task_id"), int) or not row.get("tests") or not all(isinstance(t, str) for t in row["tests"]):
            raise ValueError(f"{path} line {number}: expected an integer 'task_id' and a non-empty list of 'tests' strings")
        tests[str(row["task_id"])] = list(row["tests"])
    return tests
