"""ModeBench through the ``modebench`` package (0.4.0): its tasks, prompts, grading and mode keys.

``data.source: modebench_pkg:<domain>`` (ALGORITHMS.md §18). Rows are the package's
``Task`` (level, domain, problem, answer) with the package's registered prompt
(``modebench.api.make_prompt``: a system turn and the problem); ``modebench.api.grade``
decides the reward and gives the canonical mode key that SEED, mode-adaptive xDr,
verified replay and the ``mb/`` evaluation metrics count.

Where the tasks come from (``data.task_kwargs``):

* ``generated: true`` (the default): level-1 ``countdown``, ``graph_coloring`` and
  ``python_factors`` made here from ``seed``, offline. Their references are a few integers,
  so the package grades them like its own (it labels such runs ``custom``). A problem goes
  to ``split: eval`` by a hash of its reference (one in four), so no eval problem is a
  training problem whatever the seed; the eval split is one fixed list.
* ``example: true`` (generated tasks only; default false): one solved problem of the domain, a
  fixed training problem and its reference answer, shown as an earlier chat turn (user: its
  problem; assistant: ``\\boxed{answer}``) between the system turn and the problem, as the older
  ``modebench:`` source does. SmolLM2-135M-Instruct rarely writes a boxed answer to the bare
  package prompt (BENCHMARKS.md §12); the graded response and its key are unchanged.
* ``generated: false``: the package's frozen splits (every domain, ``level`` 1-5 but 4),
  downloaded once from GitHub into ``$XDG_CACHE_HOME/modebench`` and read with ``datasets``;
  ``mathir`` and ``pantry_plan`` exist only so.

How this differs from the library's older ``modebench:<task>`` source (``tasks/modebench.py``,
built from the paper before the package existed): those prompts carry one solved example,
colours are R/G/B, and its countdown key merges associativity (``(3+6)+9`` and
``3+(6+9)`` are one mode there, two here). Only this source's numbers compare with the
anchor's tables.

Grading runs in the package's verifier worker (``python -I``), so ``modebench`` must be
installed in the interpreter's site-packages (``pip install maxent-grpo[modebench]``).
An unscorable outcome (timeout, worker failure, resource limit, invalid reference) raises
:class:`Unscorable`: the batch is skipped with its reason, never scored 0.
"""

from __future__ import annotations

import hashlib
import itertools
import json
import math
import random
from collections.abc import Callable, Mapping
from dataclasses import asdict
from fractions import Fraction
from typing import Any

__all__ = ["DOMAINS", "GENERATED_DOMAINS", "PREFIX", "Grades", "Unscorable", "grade_row", "package_rows",
           "row_mode_key"]

PREFIX = "modebench_pkg:"
DOMAINS = ("countdown", "graph_coloring", "python_factors", "mathir", "pantry_plan")
GENERATED_DOMAINS = ("countdown", "graph_coloring", "python_factors")
UNSCORABLE = ("timeout", "worker_failure", "resource_limit", "invalid_reference")
EVAL_SEED = 20_261_126  # the generated eval split's fixed draw
EXAMPLE_SEED = 20_261_127  # the draw of the solved example (a training problem) that example: true shows
SOURCE = "maxent_grpo_generated_v1"


class Unscorable(RuntimeError):
    """The verifier could not score a response (never a wrong answer)."""


# ---- generators (level 1) ----------------------------------------------------------------------

_OPS = {"+": lambda a, b: a + b, "-": lambda a, b: a - b, "*": lambda a, b: a * b,
        "/": lambda a, b: a / b if b != 0 else None}


def _countdown_key(expr) -> str:
    """The package's key of an expression tree (``countdown:`` + add/mul with operands sorted as
    strings, sub/div in order; no associativity merge), for a tree of ``(op, left, right)``/ints."""
    if isinstance(expr, int):
        return str(expr)
    op, left, right = expr
    a, b = _countdown_key(left), _countdown_key(right)
    name = {"+": "add", "-": "sub", "*": "mul", "/": "div"}[op]
    if op in "+*":
        a, b = sorted([a, b])
    return f"{name}({a},{b})"


def _text(expr) -> str:
    return str(expr) if isinstance(expr, int) else f"({_text(expr[1])}{expr[0]}{_text(expr[2])})"


def _trees(numbers: tuple[int, ...]):
    """Every expression using each of ``numbers`` once: ``(tree, exact value)``."""
    if len(numbers) == 1:
        yield numbers[0], Fraction(numbers[0])
        return
    for cut in range(1, len(numbers)):
        for left_idx in itertools.combinations(range(len(numbers)), cut):
            left = tuple(numbers[i] for i in left_idx)
            right = tuple(numbers[i] for i in range(len(numbers)) if i not in left_idx)
            for lt, lv in _trees(left):
                for rt, rv in _trees(right):
                    for op, fn in _OPS.items():
                        value = fn(lv, rv)
                        if value is not None:
                            yield (op, lt, rt), value


def _make_countdown(rng: random.Random) -> tuple[dict, str, str]:
    numbers = tuple(sorted(rng.randint(1, 9) for _ in range(3)))
    modes: dict[int, dict[str, Any]] = {}
    for tree, value in _trees(numbers):
        if value.denominator == 1 and 1 <= value <= 100:
            modes.setdefault(int(value), {}).setdefault(_countdown_key(tree), tree)
    targets = sorted(t for t, m in modes.items() if len(m) >= 2)
    if not targets:
        return _make_countdown(rng)
    target = rng.choice(targets)
    problem = (f"Using the numbers {list(numbers)}, create an arithmetic expression that equals {target}. "
               "Use each given number exactly once. You may use +, -, *, /, and parentheses. Return exactly one "
               "final answer and no explanation: the expression inside \\boxed{}.")
    answer = {"verifier": "countdown", "numbers": list(numbers), "target": target,
              "num_modes": len(modes[target]), "source": SOURCE}
    return answer, problem, _text(min(modes[target].values(), key=_countdown_key))


def _colourings(n: int, edges: list[list[int]], partial: list[int | None]) -> list[tuple[int, ...]]:
    free = [i for i in range(n) if partial[i] is None]
    out = []
    for choice in itertools.product((1, 2, 3), repeat=len(free)):
        colours = list(partial)
        for i, c in zip(free, choice):
            colours[i] = c
        if all(colours[a - 1] != colours[b - 1] for a, b in edges):
            out.append(tuple(colours))
    return out


def _make_graph_coloring(rng: random.Random) -> tuple[dict, str, str]:
    n = 6
    colours = [rng.randint(1, 3) for _ in range(n)]
    edges = [[a, b] for a in range(1, n + 1) for b in range(a + 1, n + 1)
             if colours[a - 1] != colours[b - 1] and rng.random() < 0.45]
    free = set(rng.sample(range(n), 3))
    partial = [None if i in free else colours[i] for i in range(n)]
    solutions = _colourings(n, edges, partial)
    if len(solutions) < 2 or not edges:
        return _make_graph_coloring(rng)
    shown = "".join("?" if c is None else str(c) for c in partial)
    problem = (f"Color this graph with vertices 1 through {n}. The undirected edges are: "
               f"{', '.join(f'({a},{b})' for a, b in edges)}. Assign each vertex one color from {{1, 2, 3}} so that "
               f"no edge has the same color on both endpoints. A partial coloring is {shown}, where ? means uncolored. "
               f"Keep every shown digit fixed. There are exactly {len(free)} question marks. Return exactly one final "
               f"answer and no explanation: exactly {len(free)} digits, each one 1, 2, or 3, for the missing positions "
               "from left to right, inside \\boxed{}.")
    answer = {"verifier": "graph_coloring", "n": n, "edges": edges, "partial_colors": partial,
              "num_solutions": len(solutions), "source": SOURCE}
    first = solutions[0]
    return answer, problem, "".join(str(first[i]) for i in sorted(free))


def _proper_divisors(value: int) -> list[int]:
    return [d for d in range(2, value) if value % d == 0]


def _make_python_factors(rng: random.Random) -> tuple[dict, str, str]:
    composites = [v for v in range(4, 101) if _proper_divisors(v)]
    cases = sorted(rng.sample(composites, 4))
    num_modes = math.prod(len(_proper_divisors(v)) for v in cases)
    problem = ("Write one pure Python function with the exact form lambda n: EXPR. An external Python tool will call "
               f"it once for each n in {cases}. For every call, return an integer d satisfying 1 < d < n and "
               "n % d == 0. Different valid return vectors are different solution modes. You may use integer "
               "literals, n, +, -, *, //, %, comparisons, Boolean operators, and conditional expressions; calls, "
               "imports, attributes, containers, and other names are forbidden. Return exactly the one-line lambda "
               "inside \\boxed{} and no explanation.")
    answer = {"verifier": "python_factor_function", "python_version": "factor-v1", "cases": cases,
              "num_modes": num_modes, "source": SOURCE}
    picks = [_proper_divisors(v)[0] for v in cases]
    body = " else ".join(f"{d} if n=={v}" for d, v in zip(picks[:-1], cases[:-1])) + f" else {picks[-1]}"
    return answer, problem, f"lambda n: {body}"


_GENERATORS: dict[str, Callable[[random.Random], tuple[dict, str, str]]] = {
    "countdown": _make_countdown, "graph_coloring": _make_graph_coloring, "python_factors": _make_python_factors,
}


def _reference_id(domain: str, answer: Mapping) -> str:
    fields = {k: v for k, v in answer.items() if k not in ("num_modes", "num_solutions", "source")}
    return hashlib.sha256(json.dumps([domain, fields], sort_keys=True).encode()).hexdigest()


def _generated(domain: str, split: str, size: int, seed: int) -> list[tuple[Any, str]]:
    """``size`` distinct (Task, one valid answer) of ``split``: eval by a hash of the reference."""
    from modebench.api import Task

    rng = random.Random(EVAL_SEED if split == "eval" else seed)
    out, seen = [], set()
    for _ in range(200 * size):
        answer, problem, solution = _GENERATORS[domain](rng)
        rid = _reference_id(domain, answer)
        if (int(rid[:2], 16) % 4 == 0) != (split == "eval") or (split == "eval" and rid in seen):
            continue
        seen.add(rid)
        out.append((Task(id=f"{SOURCE}/{domain}/{rid[:16]}", level=1, domain=domain, problem=problem, answer=answer),
                    solution))
        if len(out) == size:
            break
    return out


def _frozen(domain: str, split: str, level: int, size: int) -> list[tuple[Any, None]]:
    from modebench.api import InputError, load_tasks

    try:
        tasks = list(itertools.islice(load_tasks(f"level{level}_{domain}", split), size))
    except (InputError, OSError) as exc:
        raise ValueError(f"{PREFIX}{domain}: the frozen split level{level}/{split} could not be read: {exc}") from exc
    return [(t, None) for t in tasks]


def _solved_turn(domain: str) -> list[dict]:
    """The example turn: a fixed training problem of ``domain`` (never an eval problem) and its answer."""
    task, solution = _generated(domain, "train", 1, EXAMPLE_SEED)[0]
    return [{"role": "user", "content": task.problem}, {"role": "assistant", "content": f"\\boxed{{{solution}}}"}]


def package_rows(domain: str, *, size: int, seed: int, split: str = "train", generated: bool = True,
                 level: int = 1, example: bool = False) -> list[dict]:
    """Rows ``prompt`` (the registered messages; with ``example``, a solved problem's turn after the
    system turn), ``answer`` (one valid answer, boxed; None for a frozen task) and ``mbp_task`` (the
    package Task as JSON)."""
    from modebench.api import make_prompt

    if domain not in DOMAINS:
        raise ValueError(f"unknown ModeBench domain {domain!r}; choose from {list(DOMAINS)}")
    if split not in ("train", "eval"):
        raise ValueError(f"split must be 'train' or 'eval', got {split!r}")
    if generated and (domain not in GENERATED_DOMAINS or level != 1):
        raise ValueError(f"{PREFIX}{domain} level {level} cannot be generated offline (only level 1 of "
                         f"{list(GENERATED_DOMAINS)}); set task_kwargs.generated: false for the frozen split")
    if example and not generated:
        raise ValueError(f"{PREFIX}{domain}: example: true needs generated tasks (the solved example is generated)")
    pairs = _generated(domain, split, size, seed) if generated else _frozen(domain, split, level, size)
    shown = _solved_turn(domain) if example else []

    def messages(task) -> list[dict]:
        system, *rest = make_prompt(task)
        return [system, *shown, *rest]

    return [{"prompt": messages(task), "answer": None if solution is None else f"\\boxed{{{solution}}}",
             "mbp_task": json.dumps(asdict(task), sort_keys=True)} for task, solution in pairs]


# ---- grading ---------------------------------------------------------------------------------

def grade_row(row: Mapping[str, Any], completion: str) -> Mapping[str, Any]:
    """``modebench.api.grade`` of a completion for a package row; raises :class:`Unscorable`."""
    from modebench.api import Task, grade

    task = Task(**json.loads(row["mbp_task"]))
    result = grade(task, completion)
    if result["status"] in UNSCORABLE:
        raise Unscorable(f"modebench could not score a response to {task.id}: {result['status']} ({result['detail']})")
    return result


class Grades:
    """One batch's grades, so each (row, completion) reaches the verifier once.

    A batch's completions are graded for the reward, for their answer key (SEED, mode-adaptive
    xDr) and for replay admission; the caller makes one :class:`Grades` per batch and passes it
    to each (the reward gets it as the keyword ``mode_grades``). An unscorable outcome is kept
    too and raised again on every later look-up. ``calls``: the verifier calls made so far."""

    def __init__(self) -> None:
        self._done: dict[tuple[str, str], Mapping[str, Any] | Unscorable] = {}
        self.calls = 0

    def grade(self, row: Mapping[str, Any], completion: str) -> Mapping[str, Any]:
        """:func:`grade_row`, once per (row's task, completion)."""
        key = (row["mbp_task"], completion)
        if key not in self._done:
            self.calls += 1
            try:
                self._done[key] = grade_row(row, completion)
            except Unscorable as err:
                self._done[key] = err
        result = self._done[key]
        if isinstance(result, Unscorable):
            raise result
        return result


def row_mode_key(row: Mapping[str, Any], completion: str, grades: Grades | None = None) -> str | None:
    """The canonical mode key of a verified completion; None when it is not correct. ``grades``:
    the batch's :class:`Grades` (None: grade now)."""
    return (grade_row(row, completion) if grades is None else grades.grade(row, completion))["canonical_key"]
