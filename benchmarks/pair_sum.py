"""``pair_sum``: a benchmark task with many correct answers that SmolLM2-135M can learn on a CPU.

"Find two positive whole numbers that add up to n", n in [5, 12]: every
``a + b`` with ``a, b >= 1`` and ``a + b = n`` is correct, so a prompt has n - 1
correct answers (``3 + 4`` and ``4 + 3`` count as two). It stands in for
reasoning-gym's ``countdown`` in the method comparison: countdown also has many
correct answers, but SmolLM2-135M solves none of it (0 of 128 samples on 3 one-digit
numbers, with a solved example), so no method could learn from it here.

Entries have reasoning-gym's shape (``question``, ``answer``, ``metadata`` with
``source_dataset``), so the benchmark's rewards and evaluation read them the same
way; :data:`EXAMPLE` is a solved example shown as an earlier chat turn on every side.
"""

from __future__ import annotations

import random
import re

TASK = "pair_sum"
MIN_TARGET, MAX_TARGET = 5, 12
WELL_FORMED_SCORE = 0.1  # a sum of two positive numbers, but not to n (countdown gives 0.05 likewise)

_PAIR = re.compile(r"\s*(\d+)\s*\+\s*(\d+)\s*")


def question(n: int) -> str:
    return f"Find two positive whole numbers that add up to {n}."


# (question, completion) of the solved example; the instruction line is appended by the caller.
EXAMPLE = (question(7), "7 = 3 + 4, so the answer is \\boxed{3 + 4}")


def pair_sum_entries(size: int, seed: int) -> list[dict]:
    """``size`` entries with targets drawn uniformly from [MIN_TARGET, MAX_TARGET] by ``seed``."""
    if size < 1:
        raise ValueError(f"size must be >= 1, got {size}")
    rng = random.Random(seed)
    entries = []
    for index in range(size):
        n = rng.randint(MIN_TARGET, MAX_TARGET)
        entries.append({
            "question": question(n),
            "answer": f"1 + {n - 1}",  # one of the n - 1 correct answers
            "metadata": {"source_dataset": TASK, "source_index": index, "target": n},
        })
    return entries


def score_pair_sum(answer: str | None, entry: dict) -> float:
    """1.0 for ``a + b`` with positive integers summing to the target; 0.1 for such a sum to
    another number; 0.0 for anything else."""
    match = _PAIR.fullmatch(answer or "")
    if match is None:
        return 0.0
    a, b = int(match[1]), int(match[2])
    if a < 1 or b < 1:
        return 0.0
    return 1.0 if a + b == entry["metadata"]["target"] else WELL_FORMED_SCORE
