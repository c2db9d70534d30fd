"""The ModeBench rewards: the task verifiers of ``data.source: modebench:<task>`` (``modebench``) and
the modebench package's grade of ``data.source: modebench_pkg:<domain>`` (``modebench_pkg``)."""

from __future__ import annotations

import json

from maxent_grpo.rewards.catalog import RewardFunction, register_reward
from maxent_grpo.tasks.answers import completion_text, extract_final_answer
from maxent_grpo.tasks.modebench import TASKS
from maxent_grpo.tasks.modebench_package import PREFIX as PACKAGE_PREFIX
from maxent_grpo.tasks.modebench_package import Grades


@register_reward("modebench")
def make_modebench_reward() -> RewardFunction:
    """The ``modebench`` reward: 1.0 when the final answer (last ``\\boxed{}``) passes the row's task verifier,
    else 0.0; None on rows that are not ModeBench rows."""

    def modebench(prompts, completions, **columns) -> list[float | None]:
        tasks, problems = columns.get("mb_task"), columns.get("mb_problem")
        if tasks is None or problems is None:
            raise ValueError("reward 'modebench' needs the columns mb_task and mb_problem (data.source: modebench:<task>)")
        out: list[float | None] = []
        for task, problem, completion in zip(tasks, problems, completions):
            if task is None:
                out.append(None)
                continue
            answer = extract_final_answer(completion_text(completion))
            out.append(float(TASKS[task].verify(answer, json.loads(problem))))
        return out

    modebench.__name__ = modebench.__qualname__ = "modebench"
    return modebench


@register_reward("modebench_pkg")
def make_modebench_pkg_reward() -> RewardFunction:
    """The ``modebench_pkg`` reward: 1.0 iff the package grades the completion ``correct``, 0.0 for
    ``incorrect``/``malformed``; None on rows that are not package rows; an unscorable outcome raises.
    ``mode_grades``: the batch's :class:`Grades`, which the answer keys and replay admission then reuse."""

    def modebench_pkg(prompts, completions, mode_grades: Grades | None = None, **columns) -> list[float | None]:
        tasks = columns.get("mbp_task")
        if tasks is None:
            raise ValueError(f"reward 'modebench_pkg' needs the column mbp_task (data.source: {PACKAGE_PREFIX}<domain>)")
        grades = Grades() if mode_grades is None else mode_grades
        return [None if task is None else float(grades.grade({"mbp_task": task}, completion_text(c))["verified"])
                for task, c in zip(tasks, completions)]

    modebench_pkg.__name__ = modebench_pkg.__qualname__ = "modebench_pkg"
    return modebench_pkg
