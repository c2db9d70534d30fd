"""On-policy distillation's term (ALGORITHMS.md §19): the student's per-token
reverse KL to a frozen teacher, ``KL(pi_theta || pi_T)``, on the student's own completions.

Thinking Machines' on-policy distillation (Lu et al. 2025, Tinker cookbook) and slime (``--use-opd``)
give each sampled token ``y_t`` the advantage ``-c * k(t)`` with the sampled-token estimate
``k(t) = log pi_old(y_t) - log pi_T(y_t)`` (``k1``, detached) and train it by policy gradient. The loss term here is the same gradient beside any method's loss::

    l_t = c * sg(k(t)) * exp(log pi_theta(y_t) - sg(log pi_old(y_t)))

so ``grad l_t = c * k(t) * rho_t * grad log pi_theta(y_t)`` (``rho_t = 1`` on the first pass).
With ``k1`` its expectation over ``y_t ~ pi_theta`` is exactly ``c * grad KL(pi_theta(.|s_t) ||
pi_T(.|s_t))`` at each prefix (the discount-0 convention: no credit to later tokens). ``k2`` and
``k3`` (the KL estimators of ``core/losses.py`` with ``d = log pi_T - log pi_old``) are offered as
lower-variance values; their expected gradient is not the reverse KL's (tests show it).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from maxent_grpo.core.bounds import require
from maxent_grpo.core.losses import KL_ESTIMATORS, check_kl_estimator

__all__ = ["DistillTerm", "teacher_kl", "distill_token_loss"]


@dataclass(frozen=True)
class DistillTerm:
    """The teacher term's coefficient ``c`` (> 0) and the per-token KL estimator (``k1``: the peers')."""

    coef: float = 1.0
    kl_estimator: str = "k1"

    def __post_init__(self) -> None:
        require(math.isfinite(self.coef) and self.coef > 0, "coef", f"must be finite and > 0, got {self.coef!r}")
        check_kl_estimator(self.kl_estimator)


def teacher_kl(old_logp: torch.Tensor, teacher_logp: torch.Tensor, estimator: str) -> torch.Tensor:
    """Per-token estimate ``[B, T]`` of ``KL(pi_old || pi_T)`` at the sampled tokens, detached:
    ``KL_ESTIMATORS[estimator](d)`` with ``d = teacher_logp - old_logp`` (``k1 = old - teacher``)."""
    check_kl_estimator(estimator)
    if teacher_logp.shape != old_logp.shape:
        raise ValueError(f"teacher_logp shape {tuple(teacher_logp.shape)} does not match {tuple(old_logp.shape)}")
    old = old_logp.detach()
    return KL_ESTIMATORS[estimator](teacher_logp.to(old.dtype) - old)


def distill_token_loss(logp: torch.Tensor, old_logp: torch.Tensor, teacher_logp: torch.Tensor,
                       term: DistillTerm) -> torch.Tensor:
    """Per-token loss ``[B, T]``: ``c * sg(k) * exp(logp - sg(old_logp))`` (module notes); the caller
    masks and aggregates it like the policy term."""
    k = teacher_kl(old_logp, teacher_logp, term.kl_estimator)
    return term.coef * k * torch.exp(logp - old_logp.detach())
