"""``pair_sum``: two positive whole numbers that add up to n, n in [5, 16].

Verifier: the answer is ``a + b`` with integers ``a, b >= 1`` and ``a + b = n``.
Mode key (stated rule): the unordered pair, ``min+max``, so ``3 + 4`` and
``4 + 3`` are one mode; a prompt has ``n // 2`` valid modes (2 to 8).
(``benchmarks/pair_sum.py``, the earlier benchmark, counted ordered pairs.)
"""

from __future__ import annotations

import random
import re

__all__ = ["MAX_TARGET", "MIN_TARGET", "make_problem", "mode_key", "num_valid", "parse_pair", "verify"]

MIN_TARGET, MAX_TARGET = 5, 16
_PAIR = re.compile(r"\s*(\d+)\s*\+\s*(\d+)\s*")


def parse_pair(answer: str | None) -> tuple[int, int] | None:
    """``(a, b)`` from ``a + b`` (whitespace free), or None."""
    match = _PAIR.fullmatch(answer or "")
    return None if match is None else (int(match[1]), int(match[2]))


def verify(answer: str | None, target: int) -> bool:
    """True for ``a + b`` with positive integers summing to ``target``."""
    pair = parse_pair(answer)
    return pair is not None and min(pair) >= 1 and sum(pair) == target


def mode_key(answer: str | None, target: int) -> str | None:
    """``"min+max"`` of a valid answer; None for an invalid one."""
    if not verify(answer, target):
        return None
    a, b = sorted(parse_pair(answer))
    return f"{a}+{b}"


def num_valid(target: int) -> int:
    """Number of unordered pairs of positive integers summing to ``target``: ``target // 2``."""
    return target // 2


def make_problem(rng: random.Random) -> dict:
    """A target drawn uniformly from [MIN_TARGET, MAX_TARGET]."""
    n = rng.randint(MIN_TARGET, MAX_TARGET)
    return {"target": n, "num_valid": num_valid(n), "example": f"1 + {n - 1}"}
