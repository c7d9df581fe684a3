"""The ``calculator`` environment: one tool that evaluates an arithmetic expression, for tests and
small tool tasks.

``evaluate`` walks the expression's syntax tree (``ast``) and computes only numbers, ``+ - * / // % **``,
unary signs, parentheses and a few functions (``abs``, ``round``, ``min``, ``max``, ``sqrt``); no
``eval``, no names, no attributes. Results are bounded (integers up to ``MAX_DIGITS`` digits), so
``9**9**9`` is refused instead of computed.
"""

from __future__ import annotations

import ast
import math
import operator
from typing import Any, Callable

from dockrl.config.env_sections import EnvConfig
from dockrl.envs.tool_calls import ToolCall, ToolParser
from dockrl.envs.tool_episode import ToolEpisode, tool_schema

MAX_DIGITS = 1000
"""Most decimal digits of an integer result (or operand of ``**``)."""
_MAX_LENGTH = 2000  # characters of an expression

_BINARY: dict[type, Callable[[Any, Any], Any]] = {
    ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul, ast.Div: operator.truediv,
    ast.FloorDiv: operator.floordiv, ast.Mod: operator.mod, ast.Pow: operator.pow,
}
_UNARY: dict[type, Callable[[Any], Any]] = {ast.UAdd: operator.pos, ast.USub: operator.neg}
_FUNCTIONS: dict[str, Callable[..., Any]] = {"abs": abs, "round": round, "min": min, "max": max, "sqrt": math.sqrt}


class CalculationError(ValueError):
    """The expression is not arithmetic this calculator computes, or its value is out of range."""


def _check(value: Any) -> int | float:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise CalculationError(f"not a number: {value!r}")
    if isinstance(value, int) and value.bit_length() > MAX_DIGITS * 3.33:
        raise CalculationError(f"a result of more than {MAX_DIGITS} digits")
    if isinstance(value, float) and not math.isfinite(value):
        raise CalculationError("the result is not finite")
    return value


def _power(base: int | float, exponent: int | float) -> int | float:
    if abs(exponent) * math.log2(max(abs(base), 2)) > MAX_DIGITS * 3.33:  # bound before computing: 9**9**9 would take hours
        raise CalculationError(f"a power of more than {MAX_DIGITS} digits")
    return base**exponent


def _eval(node: ast.AST) -> int | float:
    if isinstance(node, ast.Expression):
        return _eval(node.body)
    if isinstance(node, ast.Constant):
        return _check(node.value)
    if isinstance(node, ast.BinOp) and type(node.op) in _BINARY:
        left, right = _eval(node.left), _eval(node.right)
        if isinstance(node.op, ast.Pow):
            return _check(_power(left, right))
        return _check(_BINARY[type(node.op)](left, right))
    if isinstance(node, ast.UnaryOp) and type(node.op) in _UNARY:
        return _check(_UNARY[type(node.op)](_eval(node.operand)))
    if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id in _FUNCTIONS and not node.keywords:
        return _check(_FUNCTIONS[node.func.id](*[_eval(arg) for arg in node.args]))
    raise CalculationError(f"not allowed: {ast.unparse(node)}")


def evaluate(expression: str) -> int | float:
    """The value of the arithmetic ``expression`` (Python syntax: ``2**10 // 3``, ``sqrt(2) * 3``).

    Raises:
        CalculationError: not arithmetic, too long, a division by zero, or a value out of range.
    """
    if len(expression) > _MAX_LENGTH:
        raise CalculationError(f"an expression of more than {_MAX_LENGTH} characters")
    try:
        tree = ast.parse(expression.strip(), mode="eval")
    except SyntaxError as e:
        raise CalculationError(f"not an expression ({e.msg})") from None
    try:
        return _eval(tree)
    except (ZeroDivisionError, OverflowError, TypeError) as e:
        raise CalculationError(f"{type(e).__name__}: {e}") from None
    except ValueError as e:
        raise CalculationError(str(e)) from None


class CalculatorEnvironment:
    """``env.name=calculator``: the tool ``calculator(expression)``; its observation is the value, or the error.

    Args:
        tool_parser: ``env.tool_parser``; with ``fenced``, a fenced block's text is the expression.
        call_reward: ``env.tool_call_reward``: the step reward of a turn whose calls all ran.
        reward_once: ``env.tool_call_reward_once``: only the first such turn of a trajectory earns it.
    """

    @classmethod
    def from_config(cls, e: EnvConfig) -> CalculatorEnvironment:
        """``env.name=calculator`` (``BUILT_IN_ENVIRONMENTS``): the tool-call format and reward of ``env.*``."""
        return cls(e.tool_parser, e.tool_call_reward, e.tool_call_reward_once)

    def __init__(self, tool_parser: ToolParser = "hermes", call_reward: float = 0.0, reward_once: bool = True) -> None:
        self.tool_parser, self.call_reward, self.reward_once = tool_parser, call_reward, reward_once
        self.tools = [tool_schema("calculator", "Evaluate an arithmetic expression exactly (integers of any size, + - * / // % **, "
                                  "abs, round, min, max, sqrt) and return its value.", "expression", "The expression, e.g. 123456 * 789.")]

    def open(self, ground_truth: str) -> ToolEpisode:
        return ToolEpisode(self.tool_parser, ("calculator", "expression"), _run_calculator, self.call_reward,
                           reward_once=self.reward_once, ground_truth=ground_truth)

    def close(self) -> None:
        """Nothing to release."""


def _run_calculator(call: ToolCall) -> tuple[str, bool]:
    if call.name != "calculator":
        return f"Error: unknown tool {call.name!r}; the tool is 'calculator'.", True
    expression = call.arguments.get("expression")
    if not isinstance(expression, str):
        return "Error: calculator takes one string argument 'expression'.", True
    try:
        return str(evaluate(expression)), False
    except CalculationError as e:
        return f"Error: {e}", True
