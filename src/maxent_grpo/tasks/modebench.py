"""ModeBench: tasks with several valid answers ("modes") per prompt, their data and reward.

Three tasks, each with a verifier, a canonical mode key and the number of valid
modes per prompt (see each module's docstring for its rule):

* ``pair_sum``  two positive numbers adding up to n (n // 2 modes, 2-8);
* ``coloring``  complete a 3-colouring of a 4-6 node graph (2-8 modes);
* ``countdown`` make a target from 3 numbers in [1, 6] with + - * / (2-8 modes).

``data.source: modebench:<task>`` (or ``modebench:all``, the three interleaved)
loads them with ``data.task_kwargs: {split: train | eval}``. The split is
leak-free: a problem is in the eval split by a fixed rule on the problem
itself (pair_sum: n divisible by 3; the others: a hash of the problem), so no
eval problem is ever a training problem, whatever the seed or size. The eval
split is the same list in the same order for every seed; the train split is
drawn from ``seed``.

Each row's prompt is a chat: one solved example of its task (user turn,
assistant turn), then the problem. Columns: ``prompt``, ``answer`` (one valid
answer, boxed), ``mb_task`` and ``mb_problem`` (the problem as JSON), which the
``modebench`` reward and evaluation's mode keys read.
"""

from __future__ import annotations

import hashlib
import json
import random
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from maxent_grpo.tasks.answers import canonical_answer, extract_final_answer
from maxent_grpo.tasks import coloring, countdown, pair_sum
from maxent_grpo.tasks.modebench_package import Grades, row_mode_key as row_mode_key_package

__all__ = ["EVAL_SEED", "PREFIX", "TASKS", "Task", "mode_info", "modebench_rows", "row_mode_key",
           "row_task"]

PREFIX = "modebench:"
EVAL_SEED = 20_251_123  # the eval split's fixed draw
INSTRUCTION = "Put your final answer within \\boxed{}."


@dataclass(frozen=True)
class Task:
    """One ModeBench task: how to draw, ask, check and key a problem (a JSON-able dict)."""

    name: str
    make: Callable[[random.Random], dict]
    question: Callable[[dict], str]
    verify: Callable[[str | None, dict], bool]
    mode_key: Callable[[str | None, dict], str | None]
    is_eval: Callable[[dict], bool]
    example: dict  # a solved problem (its "solution" the assistant turn), shown as an earlier chat turn


def _hashed_eval(problem: dict) -> bool:
    """One problem in four goes to eval, by a hash of the problem (never by seed or position)."""
    fields = {k: v for k, v in problem.items() if k not in ("num_valid", "example")}
    digest = hashlib.sha256(json.dumps(fields, sort_keys=True).encode()).digest()
    return digest[0] % 4 == 0


def _pair_sum_question(p: dict) -> str:
    return f"Find two positive whole numbers that add up to {p['target']}."


def _countdown_question(p: dict) -> str:
    numbers = ", ".join(str(n) for n in p["numbers"])
    return (f"Using the numbers {numbers}, each exactly once, and the operations + - * /, "
            f"write an expression that equals {p['target']}.")


def _coloring_question(p: dict) -> str:
    free = [n for n in p["nodes"] if n not in p["fixed"]]
    edges = ", ".join(f"{a}-{b}" for a, b in p["edges"])
    fixed = ", ".join(f"{n}={c}" for n, c in sorted(p["fixed"].items()))
    return (f"Colour nodes {p['nodes'][0]}-{p['nodes'][-1]} with R, G, B; the two ends of an edge must differ. "
            f"Edges: {edges}. Given: {fixed}. Colour {' and '.join(free)}.")


TASKS: dict[str, Task] = {
    "pair_sum": Task(
        "pair_sum", pair_sum.make_problem, _pair_sum_question,
        lambda a, p: pair_sum.verify(a, p["target"]), lambda a, p: pair_sum.mode_key(a, p["target"]),
        lambda p: p["target"] % 3 == 0,
        {"target": 7, "num_valid": 3, "example": "3 + 4", "solution": "7 = 3 + 4, so the answer is \\boxed{3 + 4}"},
    ),
    "coloring": Task(
        "coloring", coloring.make_problem, _coloring_question,
        lambda a, p: coloring.verify(a, p["nodes"], p["edges"], p["fixed"]),
        lambda a, p: coloring.mode_key(a, p["nodes"], p["edges"], p["fixed"]),
        _hashed_eval,
        {"nodes": ["1", "2", "3", "4"], "edges": [["1", "2"], ["2", "3"], ["3", "4"], ["1", "4"]],
         "fixed": {"1": "R", "3": "G"}, "num_valid": 1, "example": "2=B, 4=B",
         "solution": "2 and 4 both touch 1=R and 3=G, so both are B: \\boxed{2=B, 4=B}"},
    ),
    "countdown": Task(
        "countdown", countdown.make_problem, _countdown_question,
        lambda a, p: countdown.verify(a, p["numbers"], p["target"]),
        lambda a, p: countdown.mode_key(a, p["numbers"], p["target"]),
        _hashed_eval,
        {"numbers": [2, 3, 4], "target": 10, "num_valid": 2, "example": "2 * 3 + 4",
         "solution": "2 * 3 + 4 = 6 + 4 = 10, so the answer is \\boxed{2 * 3 + 4}"},
    ),
}


def _problem_id(task: str, problem: dict) -> str:
    return task + json.dumps({k: v for k, v in problem.items() if k != "example"}, sort_keys=True)


def _draw(task: Task, split: str, size: int, seed: int) -> list[dict]:
    """``size`` problems of the split: eval distinct in a fixed order (fewer if the pool is smaller), train by ``seed``."""
    rng = random.Random(EVAL_SEED if split == "eval" else seed)
    want_eval = split == "eval"
    out, seen = [], set()
    for _ in range(200 * size):
        problem = task.make(rng)
        if task.is_eval(problem) != want_eval:
            continue
        key = _problem_id(task.name, problem)
        if want_eval and key in seen:
            continue
        seen.add(key)
        out.append(problem)
        if len(out) == size:
            break
    return out


def _row(task: Task, problem: dict, instruction: str | None) -> dict:
    def ask(p: dict) -> str:
        return f"{task.question(p)}\n\n{instruction}" if instruction else task.question(p)

    shown = task.example
    return {
        "prompt": [
            {"role": "user", "content": ask(shown)},
            {"role": "assistant", "content": shown["solution"]},
            {"role": "user", "content": ask(problem)},
        ],
        "answer": f"\\boxed{{{problem['example']}}}",
        "mb_task": task.name,
        "mb_problem": json.dumps(problem, sort_keys=True),
    }


def modebench_rows(name: str, *, size: int, seed: int, split: str = "train",
                   instruction: str | None = INSTRUCTION) -> list[dict]:
    """Rows of task ``name`` (or ``all``: the tasks interleaved, ``size`` rows each) for ``split``."""
    if split not in ("train", "eval"):
        raise ValueError(f"split must be 'train' or 'eval', got {split!r}")
    if not isinstance(size, int) or size < 1:
        raise ValueError(f"size must be a positive int, got {size!r}")
    names = list(TASKS) if name == "all" else [name]
    for n in names:
        if n not in TASKS:
            raise ValueError(f"unknown ModeBench task {n!r}; choose from {sorted(TASKS)} or 'all'")
    per_task = [[_row(TASKS[n], p, instruction) for p in _draw(TASKS[n], split, size, seed)] for n in names]
    rows = []
    for i in range(max(len(t) for t in per_task)):
        rows += [t[i] for t in per_task if i < len(t)]
    return rows


def row_mode_key(row: Mapping[str, Any], answer: str | None) -> str | None:
    """The mode key of a final answer (extracted already) for a ModeBench row; None when invalid."""
    return TASKS[row["mb_task"]].mode_key(answer, json.loads(row["mb_problem"]))


def mode_info(row: Mapping[str, Any], completion: str,
              grades: Grades | None = None) -> tuple[str | None, int | None] | None:
    """``(mode key or None, number of valid modes or None)`` of a completion for a ModeBench row (this
    module's or the modebench package's, ``tasks/modebench_package.py``); None for other rows.
    ``grades``: the batch's package grades (:class:`Grades`; None: grade now)."""
    if row.get("mbp_task") is not None:
        answer = json.loads(row["mbp_task"])["answer"]
        return row_mode_key_package(row, completion, grades), answer.get("num_modes", answer.get("num_solutions"))
    if "mb_task" not in row or row["mb_task"] is None:
        return None
    problem = json.loads(row["mb_problem"])
    return TASKS[row["mb_task"]].mode_key(extract_final_answer(completion), problem), int(problem["num_valid"])


def row_task(row: Mapping[str, Any]) -> str | None:
    """The ModeBench task (or package domain) of a row; None for other rows."""
    if row.get("mbp_task") is not None:
        return json.loads(row["mbp_task"])["domain"]
    return row.get("mb_task")


def answer_key(row: Mapping[str, Any], completion: str, grades: Grades | None = None) -> str | None:
    """What makes two completions one answer: on a ModeBench row its task's mode key (``3 + 4``
    and ``4+3`` are one mode of pair_sum), else the canonical final answer; None without one.
    SEED's clusters and mode-adaptive xDr's kappa count answers by it. ``grades``: as :func:`mode_info`."""
    modes = mode_info(row, completion, grades)
    if modes is not None:
        return modes[0]
    answer = extract_final_answer(completion)
    return None if answer is None else canonical_answer(answer)
