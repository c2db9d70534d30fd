"""The run's skipped batches: how many by stage, how many in a row, and the last one; resumed with the run.

A batch a stage could not make (a reward function that raised, an unscorable answer, non-finite
reference log-probs...) does not train (the :class:`~maxent_grpo.rollout.data_plane.Skipped` of a stage in ``training/stages.py``).
The run counts it under its stage (the ``skipped/<stage>`` metrics), with the groups the producer
dropped from batches that did train (``incomplete_groups``, ``failed_episodes``) and the batches whose
groups all got equal rewards (``no_signal``). ``training.max_consecutive_skips`` batches skipped in a
row stop the run, naming the last. All of it is saved in every checkpoint, so a resumed run goes on
counting where the uninterrupted one would be.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field

from maxent_grpo.rollout.data_plane import Skipped


@dataclass
class SkipCounts:
    by_stage: Counter = field(default_factory=Counter)  # batches and groups, by stage
    in_a_row: int = 0  # batches skipped since the last one that trained
    last: Skipped | None = None  # the last batch skipped

    def count(self, dropped: dict[str, int], skipped: Skipped | None) -> None:
        """A batch taken: the groups its producer dropped, and the batch itself when it was ``skipped``."""
        self.by_stage.update(dropped)
        if skipped is None:
            self.in_a_row = 0
            return
        self.by_stage[skipped.stage] += 1
        self.in_a_row += 1
        self.last = skipped

    def metrics(self) -> dict[str, float]:
        return {f"skipped/{stage}": float(n) for stage, n in self.by_stage.items()}

    def state_dict(self) -> dict:
        return {"skips": dict(self.by_stage), "skips_in_a_row": self.in_a_row,
                "last_skip": None if self.last is None else [self.last.stage, self.last.reason]}

    def load_state_dict(self, saved: dict) -> None:
        """From a checkpoint's ``trainer_state.json``; one written before the run of skips was saved has
        ``skips`` alone (its run of skips starts again at 0)."""
        self.by_stage = Counter(saved["skips"])
        self.in_a_row = int(saved.get("skips_in_a_row", 0))
        last = saved.get("last_skip")
        self.last = None if last is None else Skipped(*last)
