"""Easy Countdown: make a target from 3 small numbers with + - * /, each number used exactly once.

Verifier (the ModeBench paper's): the expression parses as arithmetic on
integer literals, uses exactly the multiset of given numbers, and equals the
target in exact ``Fraction`` arithmetic (a division by zero is invalid).

Mode key (stated rule): two expressions are one mode when they are equal up to
commutativity and associativity of ``+`` and ``*``, with ``-`` and ``/`` read as
adding a negated term and multiplying by an inverted factor. So ``3 + 4 - 1``,
``4 - 1 + 3`` and ``4 - (1 - 3)`` are one mode; ``(3 + 4) * 1`` and ``(3 + 4) / 1``
are two (a factor 1 in the numerator and one in the denominator); ``2 * 3`` and
``2 + 4`` are two modes although both are 6.
"""

from __future__ import annotations

import ast
import itertools
import random
from collections import Counter
from fractions import Fraction

__all__ = ["canonical_key", "enumerate_modes", "evaluate_expression", "make_problem", "mode_key", "verify"]

_OPS = {ast.Add: "+", ast.Sub: "-", ast.Mult: "*", ast.Div: "/"}
_MAX_CHARS = 64


def _parse(expression: str) -> ast.expr | None:
    """The expression's AST, or None unless it is integer literals joined by + - * / and parentheses."""
    text = expression.strip().replace("×", "*").replace("÷", "/").replace("\\times", "*").replace("\\div", "/")
    if not text or len(text) > _MAX_CHARS:
        return None
    try:
        tree = ast.parse(text, mode="eval").body
    except SyntaxError:
        return None
    for node in ast.walk(tree):
        if isinstance(node, ast.BinOp):
            if type(node.op) not in _OPS:
                return None
        elif isinstance(node, ast.Constant):
            if type(node.value) is not int or node.value < 0:
                return None
        elif not isinstance(node, (ast.operator,)):
            return None
    return tree


def _value(node: ast.expr) -> Fraction:
    if isinstance(node, ast.Constant):
        return Fraction(node.value)
    left, right = _value(node.left), _value(node.right)
    if isinstance(node.op, ast.Add):
        return left + right
    if isinstance(node.op, ast.Sub):
        return left - right
    if isinstance(node.op, ast.Mult):
        return left * right
    if right == 0:
        raise ZeroDivisionError("division by zero")
    return left / right


def _literals(node: ast.expr) -> list[int]:
    return [n.value for n in ast.walk(node) if isinstance(n, ast.Constant)]


def evaluate_expression(expression: str) -> tuple[Fraction, list[int]] | None:
    """``(value, numbers used)`` of an arithmetic expression, or None if it does not parse or divides by zero."""
    tree = _parse(expression)
    if tree is None:
        return None
    try:
        return _value(tree), _literals(tree)
    except ZeroDivisionError:
        return None


def verify(expression: str | None, numbers: list[int], target: int) -> bool:
    """True when ``expression`` uses exactly the multiset ``numbers`` and equals ``target`` exactly."""
    if expression is None:
        return False
    result = evaluate_expression(expression)
    if result is None:
        return False
    value, used = result
    return Counter(used) == Counter(numbers) and value == Fraction(target)


def _terms(node: ast.expr, positive: bool, out: list[tuple[bool, str]]) -> None:
    """Signed additive terms of ``node`` (``a - (b - c)`` gives +a, -b, +c)."""
    if isinstance(node, ast.BinOp) and isinstance(node.op, (ast.Add, ast.Sub)):
        _terms(node.left, positive, out)
        _terms(node.right, positive if isinstance(node.op, ast.Add) else not positive, out)
    else:
        out.append((positive, _key(node)))


def _factors(node: ast.expr, upper: bool, out: list[tuple[bool, str]]) -> None:
    """Multiplicative factors of ``node``, each in the numerator (True) or the denominator."""
    if isinstance(node, ast.BinOp) and isinstance(node.op, (ast.Mult, ast.Div)):
        _factors(node.left, upper, out)
        _factors(node.right, upper if isinstance(node.op, ast.Mult) else not upper, out)
    else:
        out.append((upper, _key(node)))


def _key(node: ast.expr) -> str:
    if isinstance(node, ast.Constant):
        return str(node.value)
    parts: list[tuple[bool, str]] = []
    if isinstance(node.op, (ast.Add, ast.Sub)):
        _terms(node, True, parts)
        signs = ("+", "-")
    else:
        _factors(node, True, parts)
        signs = ("*", "/")
    inside = " ".join(f"{signs[0] if keep else signs[1]}{key}" for keep, key in sorted(parts, key=lambda p: (not p[0], p[1])))
    return f"({inside})"


def canonical_key(expression: str) -> str | None:
    """The expression's canonical form (the module docstring's rule), or None if it does not parse."""
    tree = _parse(expression)
    return None if tree is None else _key(tree)


def mode_key(expression: str | None, numbers: list[int], target: int) -> str | None:
    """The canonical key of a valid expression; None for an invalid one."""
    if not verify(expression, numbers, target):
        return None
    return canonical_key(expression)


def _expressions(numbers: tuple[int, ...]) -> list[str]:
    """Every fully parenthesised expression using each of ``numbers`` once, in every order."""
    if len(numbers) == 1:
        return [str(numbers[0])]
    out = []
    for split in range(1, len(numbers)):
        for left in _expressions(numbers[:split]):
            for right in _expressions(numbers[split:]):
                out += [f"({left} {op} {right})" for op in "+-*/"]
    return out


def enumerate_modes(numbers: list[int], target: int) -> dict[str, str]:
    """Every mode of ``numbers`` and ``target`` (exhaustive search): canonical key -> one expression of it."""
    modes: dict[str, str] = {}
    for order in sorted(set(itertools.permutations(numbers))):
        for expression in _expressions(order):
            key = mode_key(expression, numbers, target)
            if key is not None and key not in modes:
                modes[key] = expression[1:-1] if expression.startswith("(") else expression
    return modes


def make_problem(rng: random.Random, *, max_number: int = 6, min_modes: int = 2, max_modes: int = 8) -> dict:
    """Three numbers in [1, max_number] and a target in [1, 20] with ``min_modes``..``max_modes`` modes.

    The target is drawn with probability proportional to the number of expression trees
    that reach it, so targets reachable many ways (the easier ones) are more frequent.
    """
    while True:
        numbers = sorted(rng.randint(1, max_number) for _ in range(3))
        values: Counter = Counter()
        for order in set(itertools.permutations(numbers)):
            for expression in _expressions(order):
                result = evaluate_expression(expression)
                if result is not None and result[0].denominator == 1 and 1 <= result[0] <= 20:
                    values[int(result[0])] += 1
        targets = sorted(values)
        # Targets weighted by how many expressions reach them: the easy targets (sums, one-step products) come first.
        target = rng.choices(targets, weights=[values[t] for t in targets])[0]
        modes = enumerate_modes(numbers, target)
        if min_modes <= len(modes) <= max_modes:
            return {"numbers": numbers, "target": target, "num_valid": len(modes), "example": modes[min(modes)]}
