"""``calculator``: multiply two 3-4 digit numbers, with a calculator tool.

SmolLM2-135M cannot multiply 4-digit numbers in its head; calling the tool and
copying its result into ``\\boxed{}`` is how an episode gets the answer right,
so the reward rewards using the tool (the built-in multi-turn task).
The tool evaluates + - * / and parentheses on numbers, nothing else (an ``ast``
walk, never ``eval``).
"""

from __future__ import annotations

import ast
import json
import operator
import random

INSTRUCTION = (
    "Use the calculator tool to compute it, then put the final answer within \\boxed{}."
)
_OPS = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul, ast.Div: operator.truediv}


def calculator(expression: str) -> str:
    """Evaluate an arithmetic expression with + - * / and parentheses.

    Args:
        expression: The expression to evaluate, for example "1234 * 56".
    """
    if len(expression) > 200:
        raise ValueError("expression longer than 200 characters")
    value = _eval(ast.parse(expression, mode="eval").body)
    return str(int(value)) if float(value).is_integer() else f"{value:.6g}"


def _eval(node: ast.AST) -> float:
    if isinstance(node, ast.Constant) and isinstance(node.value, (int, float)) and not isinstance(node.value, bool):
        return node.value
    if isinstance(node, ast.BinOp) and type(node.op) in _OPS:
        return _OPS[type(node.op)](_eval(node.left), _eval(node.right))
    if isinstance(node, ast.UnaryOp) and isinstance(node.op, (ast.USub, ast.UAdd)):
        value = _eval(node.operand)
        return -value if isinstance(node.op, ast.USub) else value
    raise ValueError("only numbers, + - * / and parentheses are allowed")


def question(a: int, b: int) -> str:
    return f"What is {a} * {b}? {INSTRUCTION}"


def solved(a: int, b: int) -> list[dict]:
    """A solved episode: the call, the tool's answer, the boxed result."""
    call = {"name": "calculator", "arguments": {"expression": f"{a} * {b}"}}
    return [
        {"role": "user", "content": question(a, b)},
        {"role": "assistant", "content": f"<tool_call>\n{json.dumps(call)}\n</tool_call>"},
        {"role": "tool", "name": "calculator", "content": str(a * b)},
        {"role": "assistant", "content": f"{a} * {b} = \\boxed{{{a * b}}}"},
    ]


# Two solved episodes before every problem. With one, SmolLM2-135M copies the last assistant turn
# (a boxed guess) and calls the tool in 1 of 32 samples; with two, in 12 of 32 (4 prompts x 8).
EXAMPLE = [*solved(4821, 37), *solved(352, 14)]


def make_problem(rng: random.Random) -> dict:
    a, b = rng.randint(100, 9999), rng.randint(11, 99)
    return {"prompt": [*EXAMPLE, {"role": "user", "content": question(a, b)}], "answer": str(a * b)}


def calculator_rows(size: int, seed: int) -> list[dict]:
    rng = random.Random(seed)
    return [make_problem(rng) | {"environment": "calculator"} for _ in range(size)]
