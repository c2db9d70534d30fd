"""``transformers`` callbacks and TRL's ``trainer.state.log_history``, fed by the run's metrics.

The run tells its trackers each step's metrics (``Trackers.log``); an observer here is told the same.
:class:`TrainerState` is the part of transformers' ``TrainerState`` a GRPO script reads
(``global_step``, ``max_steps``, ``epoch``, ``log_history``); :class:`CallbackObserver` appends each
step's metrics to ``log_history`` as TRL does (its names: ``loss``, ``reward``, ``rewards/NAME/mean``,
``kl``, ``learning_rate``, ... plus ``epoch`` and ``step``) and calls each callback's ``on_step_end``
and ``on_log``. ``control.should_training_stop`` set by a callback is not read: stop a run with
``max_steps``, or Ctrl-C (which checkpoints).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

__all__ = ["CallbackObserver", "TrainerState", "observers"]


@dataclass
class TrainerState:
    global_step: int = 0
    max_steps: int = 0
    epoch: float = 0.0
    steps_per_epoch: float | None = None  # prompt batches per pass over the training rows
    log_history: list[dict[str, float]] = field(default_factory=list)
    is_world_process_zero: bool = True
    is_local_process_zero: bool = True


class CallbackObserver:
    """A tracker-like observer (``log``, ``log_table``, ``close``) over transformers callbacks."""

    def __init__(self, callbacks: Sequence[Any], state: TrainerState, args: Any = None):
        from transformers import TrainerControl

        self.callbacks, self.state, self.args, self.control = list(callbacks), state, args, TrainerControl()

    def event(self, name: str, **kwargs: Any) -> None:
        for callback in self.callbacks:
            getattr(callback, name)(self.args, self.state, self.control, **kwargs)

    def log(self, metrics: dict[str, float], step: int) -> None:
        if "loss" not in metrics:  # a warning's marker (warnings/...), not a step's metrics
            return
        self.state.global_step = step
        if self.state.steps_per_epoch:
            self.state.epoch = step / self.state.steps_per_epoch
        logs = {k: v for k, v in metrics.items() if k != "step" and math.isfinite(v)}
        self.state.log_history.append({**logs, "epoch": self.state.epoch, "step": step})
        self.event("on_step_end")
        self.event("on_log", logs=logs)

    def log_table(self, name: str, columns: list[str], rows: list[list], step: int) -> None:
        return None

    def close(self) -> None:
        return None


def observers(callbacks: Sequence[Any], state: TrainerState | None, args: Any = None) -> tuple:
    """The run's observers for ``callbacks``: transformers ``TrainerCallback`` objects share one
    :class:`CallbackObserver` (with ``state``, a fresh one when None); any other object is taken as an
    observer itself (it must have ``log``, ``log_table`` and ``close``)."""
    trainer_callbacks, others = [], []
    for i, callback in enumerate(callbacks or ()):
        if hasattr(callback, "on_log") and hasattr(callback, "on_step_end"):
            trainer_callbacks.append(callback)
        elif all(hasattr(callback, m) for m in ("log", "log_table", "close")):
            others.append(callback)
        else:
            from maxent_grpo.errors import ConfigError

            raise ConfigError(f"callbacks[{i}]: a {type(callback).__name__} is neither a transformers TrainerCallback "
                              "nor an observer with log(metrics, step), log_table and close")
    if state is None and not trainer_callbacks:
        return tuple(others)
    return (CallbackObserver(trainer_callbacks, state or TrainerState(), args), *others)
