"""Benchmark prompts: reasoning-gym tasks as conversational rows, generated offline.

The rows are laid out the way our trainer's ``reasoning_gym:<task>`` source
lays them out, so both trainers and the floor see the same text: the question
followed by our instruction line as one user message (no system message, so
the model's chat template supplies its own default on every side), plus the
columns the reward functions read: ``answer``, ``rg_entry`` (the task's entry
as JSON) and ``task``.

``task_kwargs`` (the task generator's options) and ``few_shot`` (solved
examples, each an earlier user/assistant turn, the way our trainer's
``data.few_shot`` places them) come from the :class:`BenchSetting`, where they
are pinned for every side.

``pair_sum`` is not a reasoning-gym task but the benchmark's own
(:mod:`benchmarks.pair_sum`, many correct answers per prompt); its rows carry
its solved example as an earlier turn the same way. Our trainer reads such
rows from a JSONL file (:func:`benchmarks.ours.ours_config`).
"""

from __future__ import annotations

import json

from benchmarks.pair_sum import EXAMPLE, TASK as PAIR_SUM, pair_sum_entries
from benchmarks.settings import BenchSetting
from maxent_grpo.data.datasets import DEFAULT_INSTRUCTION
from maxent_grpo.run_files import prompt_ids_hash


def task_rows(task: str, size: int, seed: int, *, task_kwargs: dict | None = None,
              few_shot: tuple[tuple[str, str], ...] = ()) -> list[dict]:
    """``size`` rows ``{"prompt": [messages], "answer", "rg_entry", "task"}``."""
    if size < 1:
        raise ValueError(f"size must be >= 1, got {size}")
    if task == PAIR_SUM:
        if task_kwargs or few_shot:
            raise ValueError(f"{PAIR_SUM} has its own options and example: task_kwargs and few_shot must be empty")
        entries = pair_sum_entries(size, seed)
        examples = [(EXAMPLE[0] + f"\n\n{DEFAULT_INSTRUCTION}", EXAMPLE[1])]
    else:
        import reasoning_gym

        entries = reasoning_gym.create_dataset(task, size=size, seed=seed, **(task_kwargs or {}))
        examples = list(few_shot)
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


def setting_rows(setting: BenchSetting) -> list[dict]:
    """The rows of a :class:`BenchSetting`: the prompts every side trains on, in dataset order."""
    return task_rows(setting.task, setting.dataset_size, setting.seed, task_kwargs=setting.task_kwargs,
                     few_shot=setting.few_shot)


def rows_for_step(rows: list[dict], step: int, prompts_per_step: int) -> list[dict]:
    """The prompts of optimizer step ``step`` (0-based) when rows are taken in order, cycling."""
    if prompts_per_step < 1:
        raise ValueError(f"prompts_per_step must be >= 1, got {prompts_per_step}")
    return [rows[(step * prompts_per_step + i) % len(rows)] for i in range(prompts_per_step)]


def step_prompt_hash(row_prompt_ids: list[list[int]], num_generations: int) -> int:
    """The step's ``prompt_ids_hash`` (our ``metrics.jsonl`` field) from one prompt-id list per
    completion, the ``num_generations`` completions of a prompt in consecutive rows.

    Each group's rows must hold the same ids; the hash takes each prompt once, whatever the
    order of the groups (:func:`maxent_grpo.run_files.prompt_ids_hash`).
    """
    rows = [[int(t) for t in ids] for ids in row_prompt_ids]
    if not rows or len(rows) % num_generations:
        raise ValueError(f"{len(rows)} prompt rows are not whole groups of {num_generations}")
    groups = [rows[i : i + num_generations] for i in range(0, len(rows), num_generations)]
    mixed = [i for i, group in enumerate(groups) if any(r != group[0] for r in group)]
    if mixed:
        raise ValueError(f"prompt groups {mixed} hold different prompts in one group")
    return prompt_ids_hash([group[0] for group in groups])
