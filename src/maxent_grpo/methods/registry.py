"""What a training method is, and the registry of them (verl's ``core_algos`` registry, for methods).

A :class:`Method` holds everything in which methods differ: the config values it
brings (its preset), the cross-key checks it needs, whether it scores a
reference model, which policy loss of ``core.losses.POLICY_LOSSES`` it trains
with, whether the KL term enters the token loss, and the targets it computes
from a batch's reward statistics (listwise weights, xDr row multipliers).
Each family's file builds its methods and calls :func:`register`; the trainer
calls the method's functions and never looks at its name.
"""

from __future__ import annotations

import difflib
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch

from maxent_grpo.rewards.maxent import RewardComputation, WeightingSettings, WeightStats

if TYPE_CHECKING:  # the config schema is read, never imported at run time (it sits in training/)
    from maxent_grpo.training.config_schema import TrainConfig


@dataclass(frozen=True)
class TargetInputs:
    """What a method's targets are computed from, for one batch (prompt-major ``[P*G]`` rows, CPU)."""

    cfg: TrainConfig
    weighting: WeightingSettings
    reward_comp: RewardComputation
    completion_texts: list[str]
    answer_keys: list[str | None]  # [N] tasks.modebench.answer_key of each completion
    num_generations: int
    lengths: torch.Tensor  # [N] completion tokens
    ref_logp_sum: torch.Tensor | None  # [N] reference log-probs summed over completion tokens


@dataclass(frozen=True)
class MethodTargets:
    """A method's per-batch targets beyond the group advantages (all None: advantages only)."""

    weight_stats: WeightStats | None = None  # listwise weights
    listwise_active: torch.Tensor | None = None  # [P] groups that enter the listwise loss
    row_weights: torch.Tensor | None = None  # [N] per-row multipliers of the token policy term


def no_targets(inputs: TargetInputs) -> MethodTargets:
    return MethodTargets()


def no_checks(cfg: TrainConfig) -> list[tuple[str, str]]:
    return []


def kl_needs_reference(cfg: TrainConfig) -> bool:
    return cfg.loss.beta > 0


@dataclass(frozen=True)
class Method:
    """One training method. ``preset`` maps dotted config keys to the values the method brings
    (a recipe's own values win); ``check`` returns ``(dotted key, problem)`` pairs."""

    name: str
    family: str  # "grpo" (advantage surrogate) or "maxent" (maximum-entropy variants)
    summary: str
    preset: Mapping[str, Any] = field(default_factory=dict)
    policy_loss: Callable[[TrainConfig], str] = lambda cfg: "clipped_surrogate"
    weighting: str = "none"  # "none" | "listwise" | "xdr" (run_info.json)
    seed_scaling: bool = False  # SEED-GRPO semantic-entropy advantage scaling
    kl_in_token_loss: bool = True  # False: beta acts inside the targets (listwise)
    needs_reference: Callable[[TrainConfig], bool] = kl_needs_reference
    check: Callable[[TrainConfig], list[tuple[str, str]]] = no_checks
    targets: Callable[[TargetInputs], MethodTargets] = no_targets

    def identity(self, cfg: TrainConfig) -> dict:
        """What the run trains with, as written to ``run_info.json``."""
        return {
            "name": self.name, "family": self.family, "policy_loss": self.policy_loss(cfg),
            "weighting": self.weighting, "seed_scaling": self.seed_scaling,
            "needs_reference": self.needs_reference(cfg),
        }


METHODS: dict[str, Method] = {}


def register(method: Method) -> Method:
    if method.name in METHODS:
        raise ValueError(f"method {method.name!r} is registered twice")
    METHODS[method.name] = method
    return method


def get_method(name: str) -> Method:
    """The registered method ``name``; ``KeyError`` naming the closest registered one."""
    if name not in METHODS:
        close = difflib.get_close_matches(name, list(METHODS), n=1)
        hint = f" (did you mean {close[0]!r}?)" if close else ""
        raise KeyError(f"unknown method {name!r}{hint}; methods: {', '.join(sorted(METHODS))}")
    return METHODS[name]
