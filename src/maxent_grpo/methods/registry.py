"""What a training method is, and the registry of them (verl's ``core_algos`` registry, for methods).

A :class:`Method` holds everything in which methods differ: the config values it
brings (its preset), its own settings section (``section``: the YAML key,
``settings``: the record, with help text on each field), the cross-key checks it
needs, and :meth:`Method.plan`, which turns plain values into the
:class:`MethodPlan` the run trains with: the core :class:`LossSpec`, whether a
reference is scored, and the targets it computes from a batch's reward
statistics (listwise weights, xDr row multipliers, SEED-GRPO scaling).
Each family's file builds its methods and calls :func:`register`; the trainer
calls the method's plan and never looks at its name or at the app config.
"""

from __future__ import annotations

import dataclasses
import difflib
import typing
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

import torch

from maxent_grpo.core.step import LossSpec
from maxent_grpo.rewards.maxent import MaxEntConfig, RewardComputation, SeedGrpoInputs, WeightingSettings, WeightStats


@dataclass(frozen=True)
class PlanInputs:
    """The plain values a method plans from (``config.compile.compile_run`` builds them).

    ``loss`` is the spec the ``loss:`` section describes, before the method changes it;
    ``settings`` is the method's own section (None without one); ``maxent`` the MaxEnt
    weighting section every method shares.
    """

    loss: LossSpec
    settings: Any
    maxent: MaxEntConfig
    num_generations: int
    micro_batch_size: int
    max_new_tokens: int


@dataclass(frozen=True)
class TargetInputs:
    """What a method's targets are computed from, for one batch (prompt-major ``[P*G]`` rows, CPU)."""

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


@dataclass(frozen=True)
class RewardScalingInputs:
    """What an advantage-scaling hook sees (SEED-GRPO): ``[N]`` rows, prompt-major."""

    answer_keys: list[str | None]
    behaviour_logps: torch.Tensor | None  # [N, T] the sampler's log-probs (None: it returned none)
    completion_mask: torch.Tensor  # [N, T]
    num_generations: int


# What the collapse warning (training/collapse.py) suggests, unless the method says otherwise.
COLLAPSE_ADVICE = "a lower training.learning_rate, or loss.loss_type=dr_grpo (no per-sequence length normalisation)"


@dataclass(frozen=True)
class MethodPlan:
    """What the run trains with, from the method: plain values and the method's hooks.

    ``kl_in_token_loss``: the KL controller's beta enters the token loss (False: beta acts
    inside the targets, listwise). ``reward_scaling`` builds SEED-GRPO's inputs to the
    reward statistics (None: plain advantages); it returns None or raises ``ValueError``
    naming what the batch lacks.
    """

    name: str
    family: str
    loss: LossSpec
    needs_reference: bool
    kl_in_token_loss: bool
    weighting: str
    targets: Callable[[TargetInputs], MethodTargets]
    reward_scaling: Callable[[RewardScalingInputs], SeedGrpoInputs] | None = None
    collapse_advice: str = COLLAPSE_ADVICE  # the settings the collapse warning names

    @property
    def logs_controllers(self) -> bool:
        """Whether the run's metrics carry the live tau and beta: the MaxEnt family's weighting uses
        them, and any method's KL term uses beta."""
        return self.family == "maxent" or self.loss.beta > 0

    def identity(self) -> dict:
        """What the run trains with, as written to ``run_info.json``."""
        return {
            "name": self.name, "family": self.family, "policy_loss": self.loss.policy_loss,
            "weighting": self.weighting, "seed_scaling": self.reward_scaling is not None,
            "needs_reference": self.needs_reference,
        }


def no_targets(inputs: TargetInputs) -> MethodTargets:
    return MethodTargets()


def no_checks(inputs: PlanInputs) -> list[tuple[str, str]]:
    return []


def same_loss(inputs: PlanInputs) -> LossSpec:
    return inputs.loss


def kl_needs_reference(inputs: PlanInputs) -> bool:
    return inputs.loss.beta > 0


@dataclass(frozen=True)
class Method:
    """One training method. ``preset`` maps dotted config keys to the values the method brings
    (a recipe's own values win); ``check`` returns ``(dotted key, problem)`` pairs;
    ``loss`` turns the ``loss:`` section's spec into the method's (its policy loss and params)."""

    name: str
    family: str  # "grpo" (advantage surrogate) or "maxent" (maximum-entropy variants)
    summary: str
    preset: Mapping[str, Any] = field(default_factory=dict)
    section: str | None = None  # the YAML key of the method's own settings
    settings: type | None = None  # their record (a dataclass with defaults, help in field metadata)
    loss: Callable[[PlanInputs], LossSpec] = same_loss
    weighting: str = "none"  # "none" | "listwise" | "xdr" (run_info.json)
    kl_in_token_loss: bool = True  # False: beta acts inside the targets (listwise)
    needs_reference: Callable[[PlanInputs], bool] = kl_needs_reference
    check: Callable[[PlanInputs], list[tuple[str, str]]] = no_checks
    targets: Callable[[PlanInputs], Callable[[TargetInputs], MethodTargets]] = lambda inputs: no_targets
    reward_scaling: Callable[[PlanInputs], Callable[[RewardScalingInputs], SeedGrpoInputs]] | None = None
    collapse_advice: str = COLLAPSE_ADVICE  # the settings the collapse warning (training/collapse.py) names

    def __post_init__(self) -> None:
        if (self.section is None) != (self.settings is None):
            raise ValueError(f"method {self.name!r}: section and settings go together")
        if self.settings is not None and not dataclasses.is_dataclass(self.settings):
            raise ValueError(f"method {self.name!r}: settings must be a dataclass")

    @property
    def trains_on_advantages(self) -> bool:
        """Whether the policy term is on the group advantages (False: on listwise target weights, which
        zeroed advantages would not switch off)."""
        return self.weighting != "listwise"

    def plan(self, inputs: PlanInputs) -> MethodPlan:
        loss = self.loss(inputs)
        if not self.kl_in_token_loss:
            loss = dataclasses.replace(loss, beta=0.0)
        return MethodPlan(
            name=self.name, family=self.family, loss=loss, needs_reference=self.needs_reference(inputs),
            kl_in_token_loss=self.kl_in_token_loss, weighting=self.weighting, targets=self.targets(inputs),
            reward_scaling=None if self.reward_scaling is None else self.reward_scaling(inputs),
            collapse_advice=self.collapse_advice,
        )


METHODS: dict[str, Method] = {}


def register(method: Method) -> Method:
    if method.name in METHODS:
        raise ValueError(f"method {method.name!r} is registered twice")
    clash = [m.name for m in METHODS.values() if m.section is not None and m.section == method.section
             and m.settings is not method.settings]
    if clash:
        raise ValueError(f"method {method.name!r}: section {method.section!r} is {clash[0]!r}'s, with other settings")
    METHODS[method.name] = method
    return method


def section_of(params: type, name: str, help: Mapping[str, str], module: str) -> type:
    """A method's settings section made from its loss's params record: the same fields, types and
    defaults (written once, on the record in ``core/``, beside the bounds it checks), each with its
    help text for ``--help`` (written once, here). ``params(**dataclasses.asdict(section))`` is the
    record the loss takes."""
    names = [f.name for f in dataclasses.fields(params)]
    if set(help) != set(names):
        raise ValueError(f"{name}: help must cover exactly the fields of {params.__name__}: {names}")
    hints = typing.get_type_hints(params)
    section = dataclasses.make_dataclass(name, [
        (f.name, hints[f.name], field(default=f.default, metadata={"help": help[f.name]}))
        for f in dataclasses.fields(params)
    ])
    section.__module__ = module
    section.__doc__ = f"The method's settings section: :class:`{params.__name__}`'s fields, with help."
    return section


def register_policy_loss_method(name: str, params: type, help: Mapping[str, str], summary: str,
                                loss_type: str, module: str,
                                check: Callable[[PlanInputs], list[tuple[str, str]]] = no_checks) -> type:
    """Register the ``grpo``-family method that is the registered policy loss ``name`` with its own
    params record: its ``name:`` section is :func:`section_of` ``params`` (help on each field), its
    loss is ``name`` with the section's values, its preset sets ``loss.loss_type``, ``check`` its
    cross-key checks. Returns the section record (SAPO, GMPO, DPPO, OPSM, VESPO are each one call)."""
    section = section_of(params, f"{name.capitalize()}Config", help, module)

    def loss(inputs: PlanInputs) -> LossSpec:
        return dataclasses.replace(inputs.loss, policy_loss=name,
                                   policy_params=params(**dataclasses.asdict(inputs.settings)))

    register(Method(name, "grpo", summary, preset={"loss.loss_type": loss_type}, section=name,
                    settings=section, loss=loss, check=check))
    return section


def method_sections() -> dict[str, type]:
    """The settings sections the registered methods declare: YAML key -> record type."""
    return {m.section: m.settings for m in METHODS.values() if m.section is not None}


def get_method(name: str) -> Method:
    """The registered method ``name``; ``KeyError`` naming the closest registered one."""
    if name not in METHODS:
        close = difflib.get_close_matches(name, list(METHODS), n=1)
        hint = f" (did you mean {close[0]!r}?)" if close else ""
        raise KeyError(f"unknown method {name!r}{hint}; methods: {', '.join(sorted(METHODS))}")
    return METHODS[name]
