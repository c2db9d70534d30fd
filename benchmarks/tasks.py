"""Benchmark prompts: reasoning-gym tasks as conversational rows, generated offline.

The rows are laid out the way our trainer's ``reasoning_gym:<task>`` source
lays them out, so both trainers and the floor see the same text: the question
followed by our instruction line as one user message (no system message, so
the model's chat template supplies its own default on every side), plus the
columns the reward functions read: ``answer``, ``rg_entry`` (the task's entry
as JSON) and ``task``.

``default_task=True`` takes the built-in default recipe's task instead: its
generator options, and its solved example as an earlier user/assistant turn
(the way our trainer's ``data.few_shot`` places it).

``pair_sum`` is not a reasoning-gym task but the benchmark's own
(:mod:`benchmarks.pair_sum`, many correct answers per prompt); its rows carry
its solved example as an earlier turn the same way. Our trainer reads such
rows from a JSONL file (:func:`benchmarks.ours.ours_config`).
"""

from __future__ import annotations

import json

from benchmarks.pair_sum import EXAMPLE, TASK as PAIR_SUM, pair_sum_entries
from maxent_grpo.data.datasets import DEFAULT_INSTRUCTION


def default_task_options(task: str) -> tuple[dict, list]:
    """The default recipe's (generator options, few-shot examples); it must be a recipe for ``task``."""
    from maxent_grpo.training.config import load_config

    data = load_config().data
    if data.source != f"reasoning_gym:{task}":
        raise ValueError(f"default_task: the default recipe's task is {data.source!r}, not reasoning_gym:{task}")
    return dict(data.task_kwargs), list(data.few_shot)


def task_rows(task: str, size: int, seed: int, *, default_task: bool = False) -> list[dict]:
    """``size`` rows ``{"prompt": [messages], "answer", "rg_entry", "task"}``."""
    if size < 1:
        raise ValueError(f"size must be >= 1, got {size}")
    if task == PAIR_SUM:
        if default_task:
            raise ValueError(f"default_task: the default recipe's task is not {PAIR_SUM}")
        entries = pair_sum_entries(size, seed)
        examples = [(EXAMPLE[0] + f"\n\n{DEFAULT_INSTRUCTION}", EXAMPLE[1])]
    else:
        import reasoning_gym

        options, recipe_examples = default_task_options(task) if default_task else ({}, [])
        entries = reasoning_gym.create_dataset(task, size=size, seed=seed, **options)
        examples = [(ex.prompt, ex.completion) for ex in recipe_examples]
    turns = [
        turn for prompt, completion in examples
        for turn in ({"role": "user", "content": prompt}, {"role": "assistant", "content": completion})
    ]
    rows = []
    for entry in entries:
        rows.append(
            {
                "prompt": [*turns, {"role": "user", "content": f"{entry['question']}\n\n{DEFAULT_INSTRUCTION}"}],
                "answer": str(entry["answer"]),
                "rg_entry": json.dumps(entry),
                "task": task,
            }
        )
    return rows


def rows_for_step(rows: list[dict], step: int, prompts_per_step: int) -> list[dict]:
    """The prompts of optimizer step ``step`` (0-based) when rows are taken in order, cycling."""
    if prompts_per_step < 1:
        raise ValueError(f"prompts_per_step must be >= 1, got {prompts_per_step}")
    return [rows[(step * prompts_per_step + i) % len(rows)] for i in range(prompts_per_step)]
