"""Listwise MaxEnt weights and xDr aggregation multipliers (ALGORITHMS.md §4, §5).

Every function takes ``[P, G]`` tensors (P prompts, G completions each) and
works on all groups at once. The per-prompt program

    max_w <w, log q> + tau * H(w) - beta * KL(w || pi_ref)

has the closed form ``w = softmax((log q + beta * lref) / (tau + beta))``; the
xDr program is the same with utilities in place of ``log q``.
"""

from __future__ import annotations

import math

import torch

from maxent_grpo.core.logprobs import per_token_logp

__all__ = [
    "q_distribution",
    "listwise_weights",
    "weight_entropy",
    "xdr_utilities",
    "xdr_multipliers",
    "mode_adaptive_tau",
]


def _check_grouped(name: str, x: torch.Tensor) -> None:
    if x.dim() != 2:
        raise ValueError(f"{name} must be a [P, G] tensor (prompts x generations), got shape {tuple(x.shape)}")
    if x.shape[1] < 1:
        raise ValueError(f"{name} must have at least one generation per group, got shape {tuple(x.shape)}")


def _check_same_shape(name: str, x: torch.Tensor, like: torch.Tensor, like_name: str) -> None:
    if x.shape != like.shape:
        raise ValueError(f"{name} must have the shape of {like_name} {tuple(like.shape)}, got {tuple(x.shape)}")


def _check_coef(name: str, value: float, *, allow_inf: bool) -> None:
    if math.isnan(value) or value < 0 or (not allow_inf and math.isinf(value)):
        bound = "a number >= 0 (inf allowed)" if allow_inf else "a finite number >= 0"
        raise ValueError(f"{name} must be {bound}, got {value}")


def _argmax_set_uniform(scores: torch.Tensor, valid: torch.Tensor | None = None) -> torch.Tensor:
    """Uniform weights over each row's maximal entries (exact ties), 0 elsewhere."""
    if valid is not None:
        scores = scores.masked_fill(~valid, float("-inf"))
    top = scores.max(dim=-1, keepdim=True).values
    hit = scores == top
    if valid is not None:
        hit = hit & valid
    hit = hit.to(scores.dtype)
    count = hit.sum(dim=-1, keepdim=True)
    return torch.where(count > 0, hit / count.clamp(min=1), torch.zeros_like(hit))


def q_distribution(rewards: torch.Tensor, temperature: float, epsilon: float) -> torch.Tensor:
    """Target distribution ``q = softmax(r / T_q)`` per group, floored so every candidate keeps support.

    ``q <- (1 - G*eps) * q + eps`` with ``eps = min(epsilon, 1/G - 1e-8)``; the
    result still sums to 1. ``T_q`` is applied here and nowhere downstream.
    """
    _check_grouped("rewards", rewards)
    if not rewards.is_floating_point():
        raise ValueError(f"rewards must be floating point, got dtype {rewards.dtype}")
    if not (math.isfinite(temperature) and temperature > 0):
        raise ValueError(f"temperature must be a finite number > 0, got {temperature}")
    _check_coef("epsilon", epsilon, allow_inf=False)
    if not bool(torch.isfinite(rewards).all()):
        raise ValueError("rewards must be finite (a row with no applicable reward should be given 0 upstream)")
    g = rewards.shape[1]
    eps = min(epsilon, 1.0 / g - 1e-8)
    q = torch.softmax(rewards / temperature, dim=-1)
    return (1.0 - g * eps) * q + eps


def listwise_weights(
    q: torch.Tensor,
    tau: float,
    beta: float,
    *,
    ref_logp: torch.Tensor | None = None,
    token_counts: torch.Tensor | None = None,
    length_normalize: bool = True,
) -> torch.Tensor:
    """Closed-form listwise weights ``softmax((log q + beta * lref) / (tau + beta))`` per group.

    ``ref_logp`` is the reference model's *summed* sequence log-prob; with
    ``length_normalize`` it is divided by ``token_counts`` (clamped to >= 1),
    because the raw sum favours short answers. ``ref_logp=None`` means a
    uniform reference over the G candidates, which cancels in the softmax
    (the denominator is still ``tau + beta``). ``beta = 0`` ignores
    ``ref_logp`` entirely.

    Limits: ``tau + beta = 0`` gives the uniform distribution over each group's
    argmax of ``q``; ``tau = inf`` gives uniform weights. ``beta`` must be finite.
    The result is detached from autograd only if the inputs are; callers
    treating the weights as targets detach them.
    """
    _check_grouped("q", q)
    _check_coef("tau", tau, allow_inf=True)
    _check_coef("beta", beta, allow_inf=False)
    use_ref = ref_logp is not None and beta > 0
    if ref_logp is not None:
        _check_same_shape("ref_logp", ref_logp, q, "q")
    if token_counts is not None:
        _check_same_shape("token_counts", token_counts, q, "q")
    if use_ref and length_normalize and token_counts is None:
        raise ValueError("token_counts is required when ref_logp is given with length_normalize=True")

    if math.isinf(tau):
        return torch.full_like(q, 1.0 / q.shape[1])
    log_q = torch.log(q)
    denom = tau + beta
    if denom == 0.0:
        # beta = 0 here, so the reference plays no part in the limit.
        return _argmax_set_uniform(log_q)
    logits = log_q
    if use_ref:
        lref = per_token_logp(ref_logp, token_counts) if length_normalize else ref_logp
        logits = logits + beta * lref
    return torch.softmax(logits / denom, dim=-1)


def restrict_support(weights: torch.Tensor, support: torch.Tensor) -> torch.Tensor:
    """Weights ``[P, G]`` renormalised over each group's ``support`` ``[P, G]`` (bool).

    ``w'_i = w_i [i in S] / sum_{j in S} w_j``. Since ``w ∝ q^(1/(tau+beta)) * pi_ref^(beta/(tau+beta))``,
    this is the closed form with ``q`` restricted to ``S`` (``q_i = 0`` outside it). A group with an
    empty support gets all zeros: it has no target, and the caller leaves it out of the loss.
    """
    _check_grouped("weights", weights)
    _check_same_shape("support", support, weights, "weights")
    if support.dtype != torch.bool:
        raise ValueError(f"support must be a bool tensor, got {support.dtype}")
    kept = torch.where(support, weights, torch.zeros_like(weights))
    total = kept.sum(-1, keepdim=True)
    return torch.where(total > 0, kept / total.clamp_min(torch.finfo(weights.dtype).tiny), kept)


def weight_entropy(w: torch.Tensor) -> torch.Tensor:
    """Shannon entropy (nats) of each group's weights, ``[P, G] -> [P]``, with ``0 log 0 = 0``."""
    _check_grouped("w", w)
    return -torch.special.xlogy(w, w).sum(dim=-1)


def xdr_utilities(advantages: torch.Tensor, lengths: torch.Tensor, max_completion_length: int) -> torch.Tensor:
    """Per-candidate utilities ``U_i = A_i * T_i / L_max``, frozen at the rollout policy."""
    _check_grouped("advantages", advantages)
    _check_same_shape("lengths", lengths, advantages, "advantages")
    if max_completion_length < 1:
        raise ValueError(f"max_completion_length must be >= 1, got {max_completion_length}")
    if bool((lengths < 0).any()):
        raise ValueError("lengths must be >= 0")
    return (advantages * lengths.to(advantages.dtype) / max_completion_length).detach()


def xdr_multipliers(
    utilities: torch.Tensor,
    valid: torch.Tensor,
    tau: float | torch.Tensor,
    *,
    lam: float = 0.0,
    ref_logp: torch.Tensor | None = None,
) -> torch.Tensor:
    """Detached per-row multipliers ``a_i = n_valid * w_i`` for the policy term (§5).

    ``w = softmax_valid((U + lam * ref_logp) / (tau + lam))`` over each group's
    valid rows; ``ref_logp`` is used as given (length-normalise it upstream if
    wanted); ``None`` means a uniform reference. ``tau`` is a scalar or a ``[P]``
    tensor (see :func:`mode_adaptive_tau`).

    * A group with ``tau = inf`` gets exactly 1.0 on every row, masked or not,
      so multiplying the base per-row loss leaves it bit-identical.
    * ``tau + lam = 0``: uniform over the argmax set of the valid utilities.
    * Otherwise masked rows get 0, and a group of equal utilities gives 1 on
      every valid row.
    """
    _check_grouped("utilities", utilities)
    _check_same_shape("valid", valid, utilities, "utilities")
    if valid.dtype != torch.bool:
        raise ValueError(f"valid must be a bool tensor, got dtype {valid.dtype}")
    _check_coef("lam", lam, allow_inf=False)
    p = utilities.shape[0]
    if isinstance(tau, torch.Tensor):
        if tau.shape != (p,):
            raise ValueError(f"tau must be a float or a [P] = [{p}] tensor, got shape {tuple(tau.shape)}")
        tau_row = tau.to(device=utilities.device, dtype=utilities.dtype)
    else:
        tau_row = torch.full((p,), float(tau), device=utilities.device, dtype=utilities.dtype)
    if bool(torch.isnan(tau_row).any()) or bool((tau_row < 0).any()):
        raise ValueError("tau must be >= 0 (inf allowed) for every group")
    use_ref = ref_logp is not None and lam > 0
    if ref_logp is not None:
        _check_same_shape("ref_logp", ref_logp, utilities, "utilities")

    utilities = utilities.detach()
    valid_f = valid.to(utilities.dtype)
    n_valid = valid_f.sum(dim=-1, keepdim=True)
    denom = (tau_row + lam)[:, None]
    finite = torch.isfinite(denom) & (denom > 0)
    logits = utilities if not use_ref else utilities + lam * ref_logp.detach()
    logits = logits / torch.where(finite, denom, torch.ones_like(denom))
    logits = logits.masked_fill(~valid, float("-inf"))
    w_soft = torch.softmax(logits, dim=-1).nan_to_num(0.0)  # all-masked rows: 0/0
    w_arg = _argmax_set_uniform(utilities, valid)
    w = torch.where(denom == 0, w_arg, w_soft)
    mult = n_valid * w * valid_f
    # n * (1/n) is not always 1.0 in floating point (49 * (1/49) < 1 in float64);
    # equal utilities mean no reweighting, so give those groups exactly 1.
    if not use_ref:
        hi = utilities.masked_fill(~valid, float("-inf")).amax(dim=-1, keepdim=True)
        lo = utilities.masked_fill(~valid, float("inf")).amin(dim=-1, keepdim=True)
        mult = torch.where(hi == lo, valid_f, mult)
    return torch.where(torch.isinf(denom), torch.ones_like(mult), mult)


def mode_adaptive_tau(tau0: float, num_distinct_correct: torch.Tensor) -> torch.Tensor:
    """Per-group temperature ``tau0 / ln(1 + kappa)`` (§5).

    ``kappa = 0`` (no correct answer in the group, so no modes to spread over)
    gives ``inf``: that group is not reweighted at all.
    """
    _check_coef("tau0", tau0, allow_inf=True)
    if num_distinct_correct.dim() != 1:
        raise ValueError(
            f"num_distinct_correct must be a [P] tensor, got shape {tuple(num_distinct_correct.shape)}"
        )
    if bool((num_distinct_correct < 0).any()):
        raise ValueError("num_distinct_correct must be >= 0")
    kappa = num_distinct_correct.to(torch.get_default_dtype())
    tau = tau0 / torch.log1p(kappa).clamp(min=torch.finfo(kappa.dtype).tiny)
    return torch.where(kappa == 0, torch.full_like(kappa, math.inf), tau)
