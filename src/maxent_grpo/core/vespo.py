"""VESPO, Variational Sequence-Level Soft Policy Optimization (arXiv 2602.10693; ALGORITHMS.md §22): a
gamma weight of the sequence's summed log-ratio on a REINFORCE term, registered in
``core.losses.POLICY_LOSSES`` with its settings record; the method is ``methods/vespo.py``.
``core.step_inputs`` imports this module, so the loss is registered wherever a step can run.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from maxent_grpo.core.bounds import require
from maxent_grpo.core.losses import (
    LossMetric, PolicyInputs, PolicyTerm, StepNormalizer, check_advantages, clip_metrics, policy_token_term,
    register_policy_loss,
)
from maxent_grpo.core.peer_losses import _clamped_log_ratio, _loss_params

# TRL's (and the paper code's) bounds on log w: below at log(1e-8), above at 20.
VESPO_LOG_W_MIN = math.log(1e-8)
VESPO_LOG_W_MAX = 20.0
VESPO_LAMBDA_MIN = 1e-4


@dataclass(frozen=True)
class VespoParams:
    """VESPO's gamma weight ``phi(w) = exp(lam + k log w - lam w)`` (§22): ``k, lam`` by the sign of the
    sequence's advantage (``A >= 0``: ``k_pos, lambda_pos``; else ``k_neg, lambda_neg``). Defaults 2, 3, 3, 2
    as TRL 1.16 and the paper; a lambda below 1e-4 acts as 1e-4."""

    k_pos: float = 2.0
    lambda_pos: float = 3.0
    k_neg: float = 3.0
    lambda_neg: float = 2.0

    def __post_init__(self) -> None:
        for name in ("k_pos", "lambda_pos", "k_neg", "lambda_neg"):
            value = getattr(self, name)
            require(math.isfinite(value) and value >= 0, name, f"must be finite and >= 0, got {value}")


def vespo_weights(logp: torch.Tensor, old_logp: torch.Tensor, mask: torch.Tensor, advantages: torch.Tensor,
                  params: VespoParams, correction: torch.Tensor | None = None,
                  correction_level: str = "token") -> torch.Tensor:
    """``phi_i`` ``[B]``, detached (§22; arXiv 2602.10693, TRL's ``get_gamma_weights``).

    ``log w_i = clamp(sum_t m_t clamp(logp_t - old_t, -20, 20) + sum_t m_t log c_t, log 1e-8, 20)``: the
    **sum** over the sequence's tokens, with ``c_t`` the token-level rollout-correction weight when one is
    in use (``log c_t`` clamped to ``[log 1e-8, 20]``); a sequence-level correction (``correction_level``,
    one weight on all the row's tokens) enters once, ``+ log c_i``. ``phi_i = exp(lam + k log w_i - lam w_i)``
    (so ``phi(1) = 1``), ``k, lam`` by the sign of ``A_i``; a non-finite ``phi`` is 0.
    """
    with torch.no_grad():
        m = mask.to(logp.dtype)
        seq = (_clamped_log_ratio(logp, old_logp) * m).sum(-1)
        if correction is not None:
            log_c = torch.clamp(torch.log(correction.to(logp.dtype)), VESPO_LOG_W_MIN, VESPO_LOG_W_MAX)
            log_c = torch.where(m > 0, log_c, torch.zeros_like(log_c))
            if correction_level == "token":
                seq = seq + log_c.sum(-1)
            else:  # the row's one weight, once (an empty row: 0)
                seq = seq + torch.where(m > 0, log_c, torch.full_like(log_c, math.inf)).amin(-1).nan_to_num(
                    posinf=0.0)
        log_w = torch.clamp(seq, VESPO_LOG_W_MIN, VESPO_LOG_W_MAX)
        nonneg = advantages.to(logp.dtype) >= 0
        k = torch.where(nonneg, torch.full_like(log_w, params.k_pos), torch.full_like(log_w, params.k_neg))
        lam = torch.where(nonneg, torch.full_like(log_w, params.lambda_pos),
                          torch.full_like(log_w, params.lambda_neg)).clamp(min=VESPO_LAMBDA_MIN)
        phi = torch.exp(lam + k * log_w - lam * torch.exp(log_w))
        return torch.nan_to_num(phi, nan=0.0, posinf=0.0, neginf=0.0)


@register_policy_loss("vespo", params=VespoParams, loss_types=("dapo",), applies_correction=True)
def vespo_objective(inputs: PolicyInputs, norm: StepNormalizer) -> PolicyTerm:
    """VESPO, Variational Sequence-Level Soft Policy Optimization (arXiv 2602.10693; ALGORITHMS.md §22).

    No clip: per token ``l_t = -phi_i * A_i * logp_t`` with the detached gamma weight ``phi_i`` of the
    sequence's importance ratio (:func:`vespo_weights`), so the gradient is ``-phi_i A_i`` per token;
    aggregated like DAPO (``loss_type: dapo``, the step's active tokens), as TRL does. The rollout
    correction is inside ``w`` (token by token, or once per sequence at sequence level), so the loss is
    registered ``applies_correction`` and the step does not multiply it in again. Shapes: ``[B, T]`` log-probs and
    masks, ``[B]`` advantages. Metrics: ``vespo/phi_seq_mean`` (the mean of ``phi`` over the step's
    sequences), and the ``clip_ratio/*`` keys at 0 (nothing is clipped).
    """
    p: VespoParams = _loss_params(inputs, VespoParams)
    check_advantages(inputs.advantages, inputs.logp)
    phi = vespo_weights(inputs.logp, inputs.old_logp, inputs.mask, inputs.advantages, p, inputs.correction_weights,
                        inputs.correction_level)
    adv = inputs.advantages.to(inputs.logp.dtype)
    per_token = policy_token_term(-(phi * adv)[:, None] * inputs.logp, inputs)
    metrics = {"vespo/phi_seq_mean": LossMetric(phi.sum(), "sequence"), **clip_metrics(None, per_token)}
    return PolicyTerm(per_token, per_token.new_zeros(()), metrics)
