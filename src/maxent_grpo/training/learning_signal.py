"""Why a run is not learning: the causes of a batch without learning signal, and reward functions
that never vary.

A batch has no learning signal when every group's completions got the same reward: every
advantage is 0. :func:`no_signal_cause` names what the batch shows of the known causes:
completions cut at ``generation.max_new_tokens`` (they score as unfinished), and reward functions
that gave every completion the same value. :class:`ConstantRewardWatch` says once per function
when one has given every completion of a batch the same value, the same in ``patience`` batches in
a row: it adds nothing to the advantages. The line says which case the run shows: the function's
highest value after lower ones (saturated: the model has learned what it rewards), its lowest after
higher ones (the model no longer earns it), or no other value since the run began (a constant
function, a task the model never solves, or one it solved from the start).
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch

TRUNCATED_SHARE = 0.5  # from this share of cut completions on, truncation is named as a cause


def constant_value(column: torch.Tensor) -> float | None:
    """The value every entry of ``column`` ``[N]`` holds (NaN, no reward, counts as one value), else None."""
    values = column.tolist()
    first = values[0]
    same = all((math.isnan(v) and math.isnan(first)) or v == first for v in values)
    return first if same else None


def no_signal_cause(per_function: torch.Tensor, names: Sequence[str], truncated: torch.Tensor,
                    max_new_tokens: int) -> str:
    """What a batch without learning signal shows (``per_function`` ``[N, F]`` raw rewards, ``truncated``
    ``[N]`` bool: cut at the length limit): one clause per known cause, or that the rewards differ
    only between prompts."""
    causes = []
    share = float(truncated.float().mean())
    if share >= TRUNCATED_SHARE:
        causes.append(f"{share:.0%} of the completions were cut at generation.max_new_tokens={max_new_tokens} "
                      "(raise it, or shorten the answers the prompt asks for)")
    for i, name in enumerate(names):
        value = constant_value(per_function[:, i])
        if value is not None:
            causes.append(f"reward {name!r} gave every completion {value:g}")
    if not causes:
        causes.append("each prompt's completions got equal rewards, different between prompts")
    return "; ".join(causes)


class ConstantRewardWatch:
    """:meth:`observe` each batch's raw rewards; it returns one line per function that has just given
    every completion the same value in ``patience`` batches in a row (each function is named once).
    Each function's lowest and highest value over the run tell a saturated reward from a constant one."""

    def __init__(self, patience: int = 3):
        self.patience = patience
        self.runs: dict[str, tuple[float, int]] = {}  # name -> (value, batches in a row)
        self.bounds: dict[str, tuple[float, float]] = {}  # name -> (lowest, highest) value over the run
        self.said: set[str] = set()

    def observe(self, per_function: torch.Tensor, names: Sequence[str]) -> list[str]:
        """``per_function`` ``[N, F]``: one batch's raw rewards, a column per function of ``names``."""
        lines = []
        for i, name in enumerate(names):
            self._widen(name, per_function[:, i])
            value = constant_value(per_function[:, i])
            if value is None or math.isnan(value):
                self.runs.pop(name, None)
                continue
            before, count = self.runs.get(name, (value, 0))
            count = count + 1 if before == value else 1
            self.runs[name] = (value, count)
            if count >= self.patience and name not in self.said:
                self.said.add(name)
                lines.append(f"reward {name!r} gave every completion {value:g} in each of the last {count} batches"
                             f"{self._why(name, value)}")
        return lines

    def _widen(self, name: str, column: torch.Tensor) -> None:
        values = [v for v in column.tolist() if not math.isnan(v)]
        if values:
            low, high = self.bounds.get(name, (min(values), max(values)))
            self.bounds[name] = (min(low, *values), max(high, *values))

    def _why(self, name: str, value: float) -> str:
        low, high = self.bounds[name]
        if low == high:
            return (", and no other value since the run began: it adds nothing to the advantages (a constant "
                    "function, a task the model never solves, or one it solved from the start)")
        if value >= high:
            return (f", its highest this run (it gave as low as {low:g} before): saturated, the model has learned "
                    "what it rewards; it adds nothing more to the advantages")
        if value <= low:
            return (f", its lowest this run (it gave up to {high:g} before): the model no longer earns it; it adds "
                    "nothing to the advantages")
        return f" (it gave {low:g} to {high:g} before): it adds nothing to the advantages"

    def state_dict(self) -> dict:
        """What a checkpoint keeps: each function's run of constant batches, its lowest and highest value,
        and the functions named."""
        return {"runs": {name: [value, count] for name, (value, count) in self.runs.items()},
                "bounds": {name: [low, high] for name, (low, high) in self.bounds.items()},
                "said": sorted(self.said)}

    def load_state_dict(self, saved: dict) -> None:
        self.runs = {name: (float(value), int(count)) for name, (value, count) in saved["runs"].items()}
        # A checkpoint written before the bounds were kept has none: they restart from the resumed batches.
        self.bounds = {name: (float(low), float(high)) for name, (low, high) in saved.get("bounds", {}).items()}
        self.said = set(saved["said"])
