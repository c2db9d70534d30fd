"""The keywords TRL's GRPOTrainer passes every reward function beside the columns.

TRL 1.16 calls ``reward_func(prompts=..., completions=..., completion_ids=..., **columns,
trainer_state=..., log_extra=..., log_metric=..., environments=...)``. A reward function written
for TRL reads them; one that names none of them and takes no ``**kwargs`` gets none (so an older
function with a fixed signature keeps working).

* ``trainer_state``: the step the batch trains (``global_step``, 0-based as TRL's state before the
  update), ``max_steps`` and ``epoch`` (passes over the training rows, a float).
* ``environments``: one environment instance per completion (the user's own object for a TRL
  ``environment_factory`` class), None for one-shot prompts.
* ``log_extra(column, values)``: a column of the completion table (``completions/step-N.jsonl``
  and the trackers' table), one value per completion.
* ``log_metric(name, value)``: a scalar logged with the step's metrics (the mean when logged
  several times in a step).
"""

from __future__ import annotations

import inspect
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

__all__ = ["LIBRARY_KEYWORDS", "TRL_KEYWORDS", "RewardContext", "TrainerState", "accepted_keywords"]

TRL_KEYWORDS = ("trainer_state", "environments", "log_extra", "log_metric")
# This library's own keywords, passed only to a function that names them: ``mode_grades``, the
# batch's modebench grades (``tasks.modebench_package.Grades``), so each completion is graded once.
LIBRARY_KEYWORDS = ("mode_grades",)


@dataclass(frozen=True)
class TrainerState:
    global_step: int
    max_steps: int
    epoch: float


@dataclass
class RewardContext:
    """One batch's reward keywords, and what the functions logged through them."""

    num_completions: int
    trainer_state: TrainerState | None = None
    environments: list | None = None
    extra_columns: dict[str, list] = field(default_factory=dict)
    extra_metrics: dict[str, list[float]] = field(default_factory=dict)
    mode_grades: Any = None  # the batch's tasks.modebench_package.Grades (None: none kept)

    def log_extra(self, column: str, values: Sequence) -> None:
        if not isinstance(column, str) or not column:
            raise ValueError(f"log_extra: the column name must be a non-empty str, got {column!r}")
        values = list(values)
        if len(values) != self.num_completions:
            raise ValueError(f"log_extra({column!r}): {len(values)} values for {self.num_completions} completions")
        self.extra_columns[column] = values

    def log_metric(self, name: str, value: float) -> None:
        if not isinstance(name, str) or not name:
            raise ValueError(f"log_metric: the name must be a non-empty str, got {name!r}")
        value = float(value)
        if not math.isfinite(value):
            raise ValueError(f"log_metric({name!r}): the value must be finite, got {value}")
        self.extra_metrics.setdefault(name, []).append(value)

    def keywords(self) -> dict[str, Any]:
        return {"trainer_state": self.trainer_state, "environments": self.environments,
                "log_extra": self.log_extra, "log_metric": self.log_metric, "mode_grades": self.mode_grades}

    def metric_means(self) -> dict[str, float]:
        return {name: sum(v) / len(v) for name, v in self.extra_metrics.items()}


def accepted_keywords(fn: Callable) -> tuple[str, ...]:
    """The TRL keywords ``fn`` takes: all of them with ``**kwargs``, else the ones it names; and the
    library's own (:data:`LIBRARY_KEYWORDS`) that it names."""
    try:
        params = inspect.signature(fn).parameters
    except (TypeError, ValueError):  # a builtin or C callable without a signature: pass none
        return ()
    own = tuple(k for k in LIBRARY_KEYWORDS if k in params)
    if any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values()):
        return TRL_KEYWORDS + own
    return tuple(k for k in TRL_KEYWORDS if k in params) + own
