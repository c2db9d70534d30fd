"""Benchmark prompts: reasoning-gym tasks as conversational rows, generated offline.

The rows are laid out the way our trainer's ``reasoning_gym:<task>`` source
lays them out, so both trainers and the floor see the same text: the question
followed by our instruction line as one user message (no system message, so
the model's chat template supplies its own default on every side), plus the
columns the reward functions read: ``answer``, ``rg_entry`` (the task's entry
as JSON) and ``task``.
"""

from __future__ import annotations

import json

from maxent_grpo.training.data import DEFAULT_INSTRUCTION


def task_rows(task: str, size: int, seed: int) -> list[dict]:
    """``size`` rows ``{"prompt": [user message], "answer", "rg_entry", "task"}``."""
    if size < 1:
        raise ValueError(f"size must be >= 1, got {size}")
    import reasoning_gym

    rows = []
    for entry in reasoning_gym.create_dataset(task, size=size, seed=seed):
        rows.append(
            {
                "prompt": [{"role": "user", "content": f"{entry['question']}\n\n{DEFAULT_INSTRUCTION}"}],
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
