"""An entropy coefficient steered to a target entropy (Skywork-OR1, arXiv 2505.22312; TRL
``use_adaptive_entropy``).

After each optimizer step the measured mean token entropy ``H`` (over the step's loss tokens,
all processes) moves the coefficient by ``delta``: up when ``H <= target``, down otherwise,
within ``[coef_min, coef_max]``. The next step applies the coefficient only while the last
measured entropy is at or below the target (0 before the first measurement): the bonus
holds entropy up from below and never pushes it past the target. Pure and JSON-able: the
loop keeps the state and saves it in the checkpoint's trainer state.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

__all__ = ["AdaptiveEntropy", "EntropyCoefState", "update_entropy_coef"]


@dataclass(frozen=True)
class AdaptiveEntropy:
    target: float = 0.2
    delta: float = 0.005
    coef_min: float = 0.0
    coef_max: float = 1.0

    def __post_init__(self) -> None:
        for name in ("target", "delta", "coef_min", "coef_max"):
            value = getattr(self, name)
            if not math.isfinite(value) or value < 0:
                raise ValueError(f"adaptive entropy {name} must be finite and >= 0, got {value!r}")
        if self.coef_min > self.coef_max:
            raise ValueError(f"adaptive entropy coef_min {self.coef_min} > coef_max {self.coef_max}")


@dataclass(frozen=True)
class EntropyCoefState:
    """``coef``: the controlled coefficient; ``last_entropy``: the last step's measured entropy."""

    coef: float
    last_entropy: float = math.inf

    def applied(self, settings: AdaptiveEntropy) -> float:
        """The coefficient the next step's loss uses."""
        return self.coef if self.last_entropy <= settings.target else 0.0

    def to_dict(self) -> dict:
        return {"coef": self.coef, "last_entropy": None if math.isinf(self.last_entropy) else self.last_entropy}

    @classmethod
    def from_dict(cls, d: dict) -> "EntropyCoefState":
        return cls(float(d["coef"]), math.inf if d["last_entropy"] is None else float(d["last_entropy"]))


def update_entropy_coef(state: EntropyCoefState, measured: float, settings: AdaptiveEntropy) -> EntropyCoefState:
    """The state after a step whose measured mean token entropy was ``measured``."""
    if not math.isfinite(measured) or measured < 0:
        raise ValueError(f"measured entropy must be finite and >= 0, got {measured!r}")
    if measured <= settings.target:
        coef = min(state.coef + settings.delta, settings.coef_max)
    else:
        coef = max(state.coef - settings.delta, settings.coef_min)
    return EntropyCoefState(coef, measured)
