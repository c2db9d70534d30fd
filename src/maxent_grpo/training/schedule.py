"""The loop's schedule: how many steps, when to save, validate and log, and how many failures in a row
it tolerates; and where the run writes (``logging:``)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Schedule:
    max_steps: int | None  # None: data.num_epochs passes, counted once the data is read (plan.with_run_length)
    max_consecutive_skips: int
    save_steps: int  # 0: by time only
    save_minutes: float  # 0: by steps only
    keep_last: int | None
    save_final: bool
    eval_every_steps: int  # 0: no in-loop validation
    num_epochs: int | None  # None: the data cycles

    def save_due(self, step: int, minutes_since_save: float) -> bool:
        by_steps = bool(self.save_steps) and step % self.save_steps == 0
        return by_steps or (self.save_minutes > 0 and minutes_since_save >= self.save_minutes)

    def eval_due(self, step: int) -> bool:
        return bool(self.eval_every_steps) and step % self.eval_every_steps == 0


@dataclass(frozen=True)
class LoggingPlan:
    output_dir: str
    report_to: tuple[str, ...]
    log_completions_every: int  # 0: never
    progress_bar: bool
    collapse_window: int  # steps per window of the collapse warning (training/collapse.py); 0: off
    # Given from Python: objects told each step's metrics as a tracker is (log, log_table, close),
    # on the main process: the GRPOTrainer's log history and transformers callbacks.
    observers: tuple = ()

    def completions_due(self, step: int) -> bool:
        return bool(self.log_completions_every) and step % self.log_completions_every == 0
