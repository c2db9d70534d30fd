"""The terms one optimizer step's loss is the sum of (ALGORITHMS.md §3, §6, §15).

``grpo_step`` scores each micro-batch once into a :class:`TokenView` (the policy's
token log-probs and entropies, the proximal anchor, the sampler -> trainer
correction) and hands it to every term of :func:`step_terms`. A term returns its
contribution to the micro-batch's loss (already aggregated with the step's global
counts, ``None`` when it only measures) and its logged totals
(:class:`~maxent_grpo.core.losses.LossMetric`: summed over micro-batches and ranks,
then divided per token, per sequence, or not at all).

The terms, in the order their contributions are added (the order is part of the
update's exact value):

* ``policy``: the registered policy loss (``POLICY_LOSSES``), with the top-entropy
  token mask, the rollout correction and the sequence-error weights;
* ``kl``: ``beta * KL(pi || pi_ref)`` per token (or ``beta * rho * KL``, §19); measured whenever a
  reference is scored;
* ``distill``: on-policy distillation's reverse-KL term (``core/distill.py``);
* ``entropy_bonus``: ``- alpha * H`` (§6).

A term is registered with :func:`register_step_term` by a builder that reads the
:class:`LossSpec` and returns the term, or ``None`` when the spec leaves it out.
A term's ``needs`` names the micro-batch fields it cannot run without, and why;
the step checks them before any forward.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Protocol

import torch

from maxent_grpo.core.distill import distill_token_loss, teacher_kl
from maxent_grpo.core.entropy_terms import entropy_bonus, top_entropy_mask
from maxent_grpo.core.losses import (
    POLICY_LOSSES, LossMetric, PolicyInputs, StepNormalizer, aggregate, kl_importance_weight, kl_penalty,
)
from maxent_grpo.core.rollout_correction import CorrectionPlan
from maxent_grpo.core.step_inputs import LossSpec, MicroBatch


@dataclass(frozen=True)
class TokenView:
    """One micro-batch as every term sees it; tensors are ``[B, T]`` over the completion positions.

    ``logp`` carries the gradient; ``entropy`` is the policy's token entropy; ``mask`` the completion
    mask in ``logp``'s dtype; ``old`` the proximal anchor (``mb.old_logps``, or ``logp`` detached);
    ``correction`` the sampler -> trainer importance weight of ``rollout_correction`` (None when off
    or without behaviour log-probs).
    """

    mb: MicroBatch
    logp: torch.Tensor
    entropy: torch.Tensor
    mask: torch.Tensor
    old: torch.Tensor
    correction: torch.Tensor | None


@dataclass(frozen=True)
class StepFacts:
    """What the step knows before its first micro-batch: the global counts, the top-entropy
    threshold of the whole step (None: every token), and the vocabulary size."""

    norm: StepNormalizer
    entropy_threshold: torch.Tensor | None
    vocab_size: int
    correction: CorrectionPlan = CorrectionPlan()  # the sampler -> trainer correction (the view holds its weight)


@dataclass(frozen=True)
class TermOut:
    """A term's share of one micro-batch: ``loss`` (a scalar, or None for a term that only measures)
    and its logged ``totals``."""

    loss: torch.Tensor | None
    totals: dict[str, LossMetric]


class StepTerm(Protocol):
    needs: dict[str, str]  # micro-batch field -> the setting that requires it

    def __call__(self, view: TokenView, facts: StepFacts) -> TermOut: ...


TermBuilder = Callable[[LossSpec, bool], "StepTerm | None"]
STEP_TERMS: dict[str, TermBuilder] = {}


def register_step_term(name: str) -> Callable[[TermBuilder], TermBuilder]:
    """Register ``builder(spec, has_reference) -> StepTerm | None``; terms are added in registration order."""
    def wrap(builder: TermBuilder) -> TermBuilder:
        if name in STEP_TERMS:
            raise ValueError(f"step term {name!r} is already registered")
        STEP_TERMS[name] = builder
        return builder
    return wrap


def step_terms(spec: LossSpec, has_reference: bool) -> list[StepTerm]:
    """The terms ``spec`` trains with, in the order their contributions are added."""
    built = (builder(spec, has_reference) for builder in STEP_TERMS.values())
    return [term for term in built if term is not None]


@dataclass(frozen=True)
class PolicyStepTerm:
    """The registered policy loss per token (times the top-entropy mask, the rollout correction
    and the sequence-error weights), aggregated by ``loss_type``, plus its sequence-level part."""

    spec: LossSpec

    @property
    def needs(self) -> dict[str, str]:
        out = {}
        if self.spec.rollout_correction != "none":
            out["behaviour_logps"] = f"rollout_correction={self.spec.rollout_correction!r}"
        if self.spec.seq_logprob_error_threshold is not None:
            out.setdefault("behaviour_logps", "seq_logprob_error_threshold")
        return out

    def __call__(self, v: TokenView, facts: StepFacts) -> TermOut:
        spec, mb = self.spec, v.mb
        loss = POLICY_LOSSES[spec.policy_loss]
        policy_mask = (v.mask if facts.entropy_threshold is None
                       else top_entropy_mask(v.entropy, v.mask, spec.top_entropy_quantile, facts.entropy_threshold))
        term = loss(
            PolicyInputs(
                logp=v.logp, old_logp=v.old, mask=v.mask, policy_mask=policy_mask,
                advantages=mb.advantages, num_generations=mb.num_generations, clip=spec.clip,
                row_weights=mb.row_weights, listwise_weights=mb.listwise_weights,
                listwise_active=mb.listwise_active, behaviour_logp=mb.behaviour_logps, params=spec.policy_params,
                correction_weights=v.correction if facts.correction.in_policy_loss else None,
                correction_level=facts.correction.level,
            ),
            facts.norm,
        )
        per_token = term.per_token_loss
        if v.correction is not None and not facts.correction.in_policy_loss:
            per_token = per_token * v.correction.to(per_token.dtype)
        sequence_filter = facts.correction.sequence_filter(v.old, mb.behaviour_logps, v.mask)
        if sequence_filter is not None:
            per_token = per_token * sequence_filter.to(per_token.dtype)
        part = aggregate(per_token, v.mask, spec.loss_type, facts.norm) + term.sequence_loss
        return TermOut(part, {"policy_loss": LossMetric(part, "step"), **term.metrics})


@dataclass(frozen=True)
class KLStepTerm:
    """``beta * KL(pi || pi_ref)`` per token (the ``kl_estimator``), aggregated like the policy term;
    with ``kl_importance_weighted``, ``beta * rho * KL`` (§19: rho the ratio to the proximal anchor at
    the clip's ``importance_sampling_level``, carrying gradient). Measured (``kl``, the plain per-token
    KL) whenever the micro-batch has reference log-probs; added only with ``beta > 0``."""

    spec: LossSpec

    @property
    def needs(self) -> dict[str, str]:
        return {"ref_logps": "beta > 0"} if self.spec.beta > 0 else {}

    def __call__(self, v: TokenView, facts: StepFacts) -> TermOut:
        if v.mb.ref_logps is None:
            return TermOut(None, {"kl": LossMetric(v.logp.new_zeros(()), "token")})
        spec = self.spec
        kl = kl_penalty(v.logp, v.mb.ref_logps, spec.kl_estimator)
        loss = None
        if spec.beta > 0:
            penalty = kl
            if spec.kl_importance_weighted:
                penalty = kl * kl_importance_weight(v.logp, v.old, v.mask, spec.clip.importance_sampling_level)
            loss = aggregate(spec.beta * penalty, v.mask, spec.loss_type, facts.norm)
        return TermOut(loss, {"kl": LossMetric((kl.detach() * v.mask).sum(), "token")})


@dataclass(frozen=True)
class DistillStepTerm:
    """On-policy distillation (``core/distill.py``): the teacher's term per token, aggregated like the
    policy term. It is a policy-gradient term on the same samples, so the sampler -> trainer
    correction applies to it too. Logs ``distill/kl``, the mean per-token KL(pi_old || pi_teacher)."""

    spec: LossSpec
    needs = {"teacher_logps": "the distillation term"}

    def __call__(self, v: TokenView, facts: StepFacts) -> TermOut:
        distill = self.spec.distill
        tok = distill_token_loss(v.logp, v.old, v.mb.teacher_logps, distill)
        if v.correction is not None:
            tok = tok * v.correction.to(tok.dtype)
        measured = (teacher_kl(v.old, v.mb.teacher_logps, distill.kl_estimator) * v.mask).sum()
        return TermOut(aggregate(tok, v.mask, self.spec.loss_type, facts.norm),
                       {"distill/kl": LossMetric(measured, "token")})


@dataclass(frozen=True)
class EntropyBonusStepTerm:
    """``- alpha * B``: the normalised entropy bonus of §6 (``entropy_coef``, the adaptive one included)."""

    spec: LossSpec
    needs = {}

    def __call__(self, v: TokenView, facts: StepFacts) -> TermOut:
        bonus = entropy_bonus(v.entropy, v.mask, facts.vocab_size, self.spec.loss_type, facts.norm)
        return TermOut(-(self.spec.entropy_coef * bonus), {"entropy_bonus": LossMetric(bonus, "step")})


register_step_term("policy")(lambda spec, has_reference: PolicyStepTerm(spec))
register_step_term("kl")(lambda spec, has_reference: KLStepTerm(spec) if spec.beta > 0 or has_reference else None)
register_step_term("distill")(lambda spec, has_reference: DistillStepTerm(spec) if spec.distill is not None else None)
register_step_term("entropy_bonus")(
    lambda spec, has_reference: EntropyBonusStepTerm(spec) if spec.entropy_coef > 0 else None)
