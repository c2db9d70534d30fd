"""Listwise weighting hyperparameters: :class:`WeightingSettings` and its small settings records.

``WeightingSettings`` also carries the live controller state; the controller
steps that update it are in :mod:`maxent_grpo.rewards.maxent.controllers`.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Literal

from maxent_grpo.core.advantages import SCALE_REWARDS
from maxent_grpo.core.bounds import require
from maxent_grpo.core.controllers import (
    ControllerMetaSettings,
    ControllerSettings,
    ControllerState,
    KlControllerSettings,
    TauSchedule,
)


@dataclass(frozen=True)
class WeightNormalizationSettings:
    len_norm_ref: bool = True


@dataclass(frozen=True)
class QDistributionSettings:
    temperature: float = 1.0
    epsilon: float = 1e-6

    def __post_init__(self) -> None:
        require(math.isfinite(self.temperature) and self.temperature > 0, "q_distribution.temperature",
                f"must be a finite number > 0, got {self.temperature}")
        require(0 <= self.epsilon < 1, "q_distribution.epsilon",
                f"must be in [0, 1) (a floor on each q), got {self.epsilon}")


@dataclass
class WeightingSettings:
    """Listwise weighting hyperparameters and a controller state (the seed's record).

    ``tau`` and ``beta`` are the values the weighting reads; ``controller_state`` carries the rest
    (entropy EMA, ``log tau``, step, histories) and agrees with them. The seed's controllers
    (:mod:`.controllers`) update a record in place. A run holds its controllers' state as a value
    instead (``TrainState.controllers``) and hands the methods the plan's record with that state
    (``weighting_at``), so the plan's own copy never changes.

    Two fields are kept for the seed's signature and change nothing: ``train_grpo_objective`` (the
    method, ``method:``, chooses what is trained) and ``scale_rewards`` (validated only; the run's
    advantage scaling is ``loss.scale_rewards``, ``RewardStatsSettings.scale_rewards``). The
    properties below are the seed's accessors of the nested settings.
    """

    tau: float
    beta: float
    normalization: WeightNormalizationSettings = field(default_factory=WeightNormalizationSettings)
    q_distribution: QDistributionSettings = field(default_factory=QDistributionSettings)
    tau_schedule: TauSchedule = field(default_factory=TauSchedule)
    kl_controller: KlControllerSettings = field(default_factory=KlControllerSettings)
    controller_meta: ControllerMetaSettings = field(default_factory=ControllerMetaSettings)
    train_grpo_objective: bool = False
    scale_rewards: str = "group"
    controller_state: ControllerState | None = None

    def __post_init__(self) -> None:
        require(math.isfinite(self.tau) and self.tau >= 0, "tau", f"must be a finite number >= 0, got {self.tau}")
        require(math.isfinite(self.beta) and self.beta >= 0, "beta", f"must be a finite number >= 0, got {self.beta}")
        require(self.scale_rewards in SCALE_REWARDS, "scale_rewards",
                f"must be one of {list(SCALE_REWARDS)}, got {self.scale_rewards!r}")
        if self.controller_state is None:
            self.controller_state = ControllerState.initial(self.tau, self.beta)
        elif (self.controller_state.tau, self.controller_state.beta) != (self.tau, self.beta):
            raise ValueError(
                f"controller_state (tau={self.controller_state.tau}, beta={self.controller_state.beta}) "
                f"disagrees with tau={self.tau}, beta={self.beta}"
            )

    @property
    def denom(self) -> float:
        """``tau + beta``, the denominator of the listwise softmax."""
        return self.tau + self.beta

    @property
    def len_norm_ref(self) -> bool:
        return self.normalization.len_norm_ref

    @property
    def q_temperature(self) -> float:
        return self.q_distribution.temperature

    @property
    def q_epsilon(self) -> float:
        return self.q_distribution.epsilon

    @property
    def tau_target_entropy(self) -> float | None:
        return self.tau_schedule.target_entropy

    @property
    def tau_lr(self) -> float:
        return self.tau_schedule.lr

    @property
    def tau_min(self) -> float:
        return self.tau_schedule.min

    @property
    def tau_max(self) -> float:
        return self.tau_schedule.max

    @property
    def tau_warmup_steps(self) -> int:
        return self.tau_schedule.warmup_steps

    @property
    def kl_target(self) -> float:
        return self.kl_controller.target

    @property
    def controller_settings(self) -> ControllerSettings:
        return ControllerSettings(self.tau_schedule, self.kl_controller, self.controller_meta)


@dataclass
class MaxEntConfig:
    """The ``maxent:`` config section: listwise targets and the tau / beta / meta controllers
    (``config/compile.py`` maps it onto :class:`WeightingSettings`)."""

    tau: float = field(default=0.5, metadata={"help": "MaxEnt temperature of the listwise weights"})
    q_temperature: float = field(default=1.0, metadata={"help": "temperature of q = softmax(r / T_q)"})
    q_epsilon: float = field(default=1e-6, metadata={"help": "floor that keeps every candidate in q's support"})
    length_normalize_ref: bool = field(default=True, metadata={"help": (
        "divide reference sequence log-probs by length")})
    # Weighted MLE on the listwise targets pushes up each completion by its weight and
    # never down, short ones most per token (ALGORITHMS.md §4); on the built-in default run it
    # collapsed or stalled on 3 of 5 seeds. centered_mle pushes down every completion weighted
    # below uniform and learned on all 10 (BENCHMARKS.md §3), so it is the default.
    listwise_loss: Literal["cross_entropy", "weighted_mle", "centered_mle"] = field(default="centered_mle", metadata={
        "help": ("centered_mle (default: -sum (w_i - 1/G) s_i, completions weighted below uniform are pushed "
                 "down), weighted_mle (-sum w_i s_i, pushes each completion up by its weight) or cross_entropy "
                 "(-sum w_i log softmax(s)_i)")})
    listwise_score: Literal["token_mean", "sum"] = field(default="token_mean", metadata={"help": (
        "the sequence score s_i the listwise loss fits: the mean token log-prob (default) or their sum")})
    zero_weight_unrewarded: bool = field(default=False, metadata={"help": (
        "completions with reward <= 0 get target weight 0 (q restricted to rewarded completions); a group "
        "with none rewarded trains nothing")})
    keep_zero_variance_groups: bool = field(default=False, metadata={"help": (
        "train on groups whose rewards are all equal")})
    listwise_clip_coef: float = field(default=0.0, metadata={"help": (
        "weight of the optional sequence-level clip term (advantage w - 1/G)")})
    tau_target_entropy: float | None = field(default=None, metadata={"help": (
        "target weight entropy H* for the tau controller (null = off)")})
    tau_target_final: float | None = field(default=None, metadata={"help": "final H* of a linear schedule"})
    tau_target_horizon: int = field(default=0, metadata={"help": "steps of the H* schedule"})
    tau_lr: float = field(default=0.0, metadata={"help": "tau controller learning rate (on log tau)"})
    tau_min: float = field(default=0.0, metadata={"help": "lower bound on tau (<= 0 = none)"})
    tau_max: float = field(default=0.0, metadata={"help": "upper bound on tau (<= 0 = none)"})
    tau_warmup_steps: int = field(default=0, metadata={"help": "steps before the tau controller starts"})
    kl_target: float = field(default=0.0, metadata={"help": "target KL for the adaptive beta controller (0 = off)"})
    kl_horizon: int = field(default=0, metadata={"help": "horizon of the adaptive beta controller"})
    kl_step_size: float = field(default=0.0, metadata={"help": "clip on the relative KL error per update"})
    # The analytic meta controller (ALGORITHMS.md §8): on when either rate is > 0, and it
    # then replaces the tau and beta controllers above (their targets stay its targets).
    meta_lr_tau: float = field(default=0.0, metadata={"help": (
        "meta controller: tau <- tau - lr (H - H*) (> 0 turns it on, replacing the tau/beta controllers)")})
    meta_lr_beta: float = field(default=0.0, metadata={"help": (
        "meta controller: beta <- beta + lr clip(KL - KL*) (> 0 turns it on)")})
    meta_every: int = field(default=1, metadata={"help": "meta controller: update every this many steps"})
    meta_grad_clip: float = field(default=0.0, metadata={"help": "meta controller: clip on KL - KL* (0 = unclipped)"})
