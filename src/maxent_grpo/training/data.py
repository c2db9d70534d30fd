"""The run's data: which rows, how they are split and drawn, and each row's environment.

:class:`DataPlan` is what ``compile_run`` gives the data; :func:`load_rows` and
:func:`row_episodes` build from it, for ``maxent-grpo train`` and ``maxent-grpo eval`` alike.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from maxent_grpo.data.datasets import ColumnNames, given_table, load_prompt_dataset, split_train_eval
from maxent_grpo.envs import ENVIRONMENT_COLUMN
from maxent_grpo.envs.episodes import EpisodeLimits, EpisodePlay
from maxent_grpo.envs.settings import EnvironmentConfig, row_environments
from maxent_grpo.errors import ConfigError

if TYPE_CHECKING:  # datasets is imported by the loaders that need it (the GPU machine has none)
    from datasets import Dataset


@dataclass(frozen=True)
class DataPlan:
    """The ``data:`` section as the loaders take it, with the run's seed (the split and the draws)."""

    source: str
    split: str
    size: int | None
    seed: int
    task_kwargs: dict[str, Any]
    instruction: str | None
    prompt_column: str
    answer_column: str
    eval_size: int
    num_epochs: int | None
    shuffle: bool
    environment: EnvironmentConfig
    episodes: EpisodeLimits | None  # multi-turn episodes (environment:); None: one-shot prompts
    # environment.tools and environment.classes, each a module:function / file.py:Class reference (imported
    # when the run starts) or the object a Python caller gave (config/python_objects.py).
    tools: tuple[str | Callable, ...] = ()
    classes: Mapping[str, str | Callable] = field(default_factory=dict)
    # Given as Python objects: the training rows (source is then their python: reference) and the held-out rows.
    given: Any = None
    given_eval: Any = None


def load_table(d: DataPlan, limit: int | None = None):
    """All the configured rows, before the held-out split (of an iterable table given from Python, its
    first ``limit``)."""
    if d.given is not None:
        return given_table(d.given, "train_dataset", prompt_column=d.prompt_column, answer_column=d.answer_column,
                           environment_prompts=d.episodes is not None, limit=limit)
    return load_prompt_dataset(
        d.source, split=d.split, columns=ColumnNames(d.prompt_column, d.answer_column), size=d.size, seed=d.seed,
        instruction=d.instruction, task_kwargs=d.task_kwargs, environment_prompts=d.episodes is not None,
    )


def load_rows(d: DataPlan, prompts_per_step: int, processes: int,
              max_steps: int | None = None) -> tuple[Dataset, list[dict]]:
    """The training rows and the held-out rows (none when ``data.eval_size`` is 0 and no eval_dataset
    is given); each of the ``processes`` draws ``prompts_per_step`` prompts a step, for ``max_steps``
    steps (None: counted in passes over the data)."""
    per_step = prompts_per_step * processes
    dataset = load_table(d, limit=None if max_steps is None else max_steps * per_step)
    train_ds, eval_rows = dataset, []
    if d.eval_size > 0:
        train_ds, eval_ds = split_train_eval(dataset, d.eval_size, d.seed)
        eval_rows = list(eval_ds)
    if d.given_eval is not None:
        eval_rows = list(given_table(d.given_eval, "eval_dataset", prompt_column=d.prompt_column,
                                     answer_column=d.answer_column, environment_prompts=d.episodes is not None))
    if prompts_per_step * processes > len(train_ds):
        raise ConfigError(f"training.prompts_per_step: {prompts_per_step} prompts x {processes} process(es) per step "
                          f"is more than the {len(train_ds)} training rows of {d.source}")
    return train_ds, eval_rows


def row_episodes(d: DataPlan, column: list | None) -> EpisodePlay | None:
    """Each row's environment and the limits when the run plays episodes (``environment:``), else None.

    ``column``: the rows' ``environment`` column (None when they have none)."""
    if d.episodes is None:
        if column is not None:
            raise ConfigError(f"environment.name: the dataset {d.source} has an {ENVIRONMENT_COLUMN!r} column "
                              "(one environment per row); set environment.name, the environment of rows without one")
        return None
    return EpisodePlay(row_environments(d.environment, column, tools=d.tools, classes=d.classes), d.episodes)
