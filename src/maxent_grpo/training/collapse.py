"""The collapse warning: token entropy rising while the mean length and the reward fall.

That is how a run collapses onto short answers (BENCHMARKS.md §3, docs/ALGORITHMS.md §4): the
policy is pushed toward short completions, their few tokens are uncertain ones, and the reward
goes with the length. :func:`collapse_signature` compares the mean of the last ``window`` logged
steps with the ``window`` steps before them; :class:`CollapseWatch` says so once when the
signature appears (again only after it has cleared).

The margins are fixed, so that step-to-step noise does not look like a collapse: entropy up by
at least 5%, the mean length down by at least 20%, and the reward down by at least a quarter of
the earlier window's within-batch reward spread (``reward_std``).
"""

from __future__ import annotations

import statistics
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

# The logged metrics the signature reads (what a checkpoint keeps of each step).
WATCHED = ("step", "entropy", "completions/mean_length", "reward", "reward_std")
ENTROPY_RISE = 1.05
LENGTH_FALL = 0.8
REWARD_FALL_STDS = 0.25


@dataclass(frozen=True)
class Collapse:
    """The two windows compared (first and last step of each) and each watched mean, earlier -> later."""

    earlier: tuple[int, int]
    later: tuple[int, int]
    entropy: tuple[float, float]
    length: tuple[float, float]
    reward: tuple[float, float]

    def line(self, advice: str) -> str:
        (a, b), (c, d) = self.earlier, self.later
        return (f"collapse signature, steps {c}-{d} against {a}-{b}: token entropy {self.entropy[0]:.3f} -> "
                f"{self.entropy[1]:.3f} up, mean length {self.length[0]:.1f} -> {self.length[1]:.1f} and reward "
                f"{self.reward[0]:.3f} -> {self.reward[1]:.3f} down (short answers are being reinforced); try {advice}")


def collapse_signature(history: Sequence[Mapping[str, float | None]], window: int) -> Collapse | None:
    """The signature over the last ``2 * window`` steps of ``history`` (logged metrics, oldest first:
    ``step``, ``reward``, ``reward_std``, ``completions/mean_length``, ``entropy``), or None when it
    does not hold, there are fewer steps, or a step lacks one of them."""
    if window < 1 or len(history) < 2 * window:
        return None
    earlier, later = history[-2 * window:-window], history[-window:]
    keys = WATCHED[1:]
    if any(row.get(k) is None for row in (*earlier, *later) for k in keys):
        return None

    def mean(rows, key: str) -> float:
        return statistics.fmean(float(r[key]) for r in rows)

    entropy = mean(earlier, "entropy"), mean(later, "entropy")
    length = mean(earlier, "completions/mean_length"), mean(later, "completions/mean_length")
    reward = mean(earlier, "reward"), mean(later, "reward")
    spread = mean(earlier, "reward_std")
    holds = (entropy[1] >= ENTROPY_RISE * entropy[0] and length[1] <= LENGTH_FALL * length[0]
             and spread > 0 and reward[0] - reward[1] >= REWARD_FALL_STDS * spread)
    if not holds:
        return None
    return Collapse((int(earlier[0]["step"]), int(earlier[-1]["step"])), (int(later[0]["step"]), int(later[-1]["step"])),
                    entropy, length, reward)


class CollapseWatch:
    """Feeds each step's metrics to :func:`collapse_signature`; :meth:`observe` returns the warning's
    line at the first step of each stretch where the signature holds, else None. ``window`` 0: off."""

    def __init__(self, window: int, advice: str):
        self.window, self.advice = window, advice
        self.history: list[Mapping[str, float | None]] = []
        self.holding = False

    def observe(self, metrics: Mapping[str, float | None]) -> str | None:
        if self.window < 1:
            return None
        watched = {k: metrics.get(k) for k in WATCHED}
        self.history = [*self.history[-(2 * self.window - 1):], watched]
        found = collapse_signature(self.history, self.window)
        fresh = found is not None and not self.holding
        self.holding = found is not None
        return found.line(self.advice) if fresh else None

    def state_dict(self) -> dict:
        """What a checkpoint keeps: the steps the next windows compare, and whether the signature holds."""
        return {"history": [dict(row) for row in self.history], "holding": self.holding}

    def load_state_dict(self, saved: dict) -> None:
        self.history, self.holding = [dict(row) for row in saved["history"]], bool(saved["holding"])
