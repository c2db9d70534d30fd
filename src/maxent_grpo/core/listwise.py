"""Listwise losses (ALGORITHMS.md §4): each group's completions fit MaxEnt target weights ``w``
through sequence scores ``s_i`` (cross-entropy, weighted MLE or its centred form), registered as
policy losses with their own settings record :class:`ListwiseParams`.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from maxent_grpo.core.bounds import require
from maxent_grpo.core.losses import (
    PolicyInputs,
    PolicyTerm,
    StepNormalizer,
    clip_metrics,
    ppo_clip_terms,
    register_policy_loss,
    sequence_mean,
)

LISTWISE_SCORES = ("token_mean", "sum")


@dataclass(frozen=True)
class ListwiseParams:
    """The listwise losses' own settings (§4).

    ``score``: the sequence score ``s_i`` the loss fits to the weights, the token mean
    ``(1/T_i) sum_t m*logp`` (the spec's) or the plain sum. ``clip_coef`` weights the optional
    sequence-level clipped term with advantages ``a_i = w_i - 1/G`` (0 = off).
    """

    score: str = "token_mean"
    clip_coef: float = 0.0

    def __post_init__(self) -> None:
        require(self.score in LISTWISE_SCORES, "score", f"must be one of {list(LISTWISE_SCORES)}, got {self.score!r}")
        require(self.clip_coef >= 0, "clip_coef", f"must be >= 0, got {self.clip_coef}")


def sequence_scores(logp: torch.Tensor, mask: torch.Tensor, score: str = "token_mean") -> torch.Tensor:
    """``s_i`` ``[B]`` of ``logp`` ``[B, T]``: ``(1/T_i) sum_t m*logp`` (``token_mean``; 0 for empty
    completions) or ``sum_t m*logp`` (``sum``)."""
    mask = mask.to(logp.dtype)
    if score == "sum":
        return (logp * mask).sum(-1)
    return sequence_mean(logp, mask)


def _check_listwise(seq_scores: torch.Tensor, weights: torch.Tensor, active: torch.Tensor) -> None:
    if seq_scores.dim() != 2:
        raise ValueError(f"seq_scores must be [P, G], got shape {tuple(seq_scores.shape)}")
    if weights.shape != seq_scores.shape:
        raise ValueError(f"weights shape {tuple(weights.shape)} does not match seq_scores {tuple(seq_scores.shape)}")
    if active.shape != seq_scores.shape[:1] or active.dtype != torch.bool:
        raise ValueError(f"active must be a bool [P={seq_scores.shape[0]}] tensor, got {active.dtype} {tuple(active.shape)}")


def listwise_cross_entropy(
    seq_scores: torch.Tensor, weights: torch.Tensor, active: torch.Tensor, num_groups: int
) -> torch.Tensor:
    """``sum over active groups of -sum_i w_i log softmax_g(s)_i``, divided by ``num_groups``.

    ``num_groups`` is the step's active group count over all micro-batches and
    ranks. Weights are detached; d/ds_i = (p_i - w_i)/num_groups for active groups.
    """
    _check_listwise(seq_scores, weights, active)
    log_p = torch.log_softmax(seq_scores, dim=-1)
    per_group = -(weights.detach().to(log_p.dtype) * log_p).sum(-1)
    return torch.where(active, per_group, torch.zeros_like(per_group)).sum() / max(num_groups, 1)


def listwise_weighted_mle(
    seq_scores: torch.Tensor, weights: torch.Tensor, active: torch.Tensor, num_groups: int
) -> torch.Tensor:
    """``sum over active groups of -sum_i w_i s_i``, divided by ``num_groups`` (weights detached)."""
    _check_listwise(seq_scores, weights, active)
    per_group = -(weights.detach().to(seq_scores.dtype) * seq_scores).sum(-1)
    return torch.where(active, per_group, torch.zeros_like(per_group)).sum() / max(num_groups, 1)


def listwise_centered_mle(
    seq_scores: torch.Tensor, weights: torch.Tensor, active: torch.Tensor, num_groups: int
) -> torch.Tensor:
    """``sum over active groups of -sum_i (w_i - 1/G) s_i``, divided by ``num_groups`` (weights detached).

    The weighted MLE with the uniform weight as baseline: d/ds_i = -(w_i - 1/G)/num_groups sums to
    0 over a group, so a completion weighted below uniform is pushed down, where the weighted MLE
    pushes every completion up (ALGORITHMS.md §4). It is the cross-entropy's gradient at a uniform
    policy ``p_i = 1/G``, held there.
    """
    _check_listwise(seq_scores, weights, active)
    w = weights.detach().to(seq_scores.dtype)
    per_group = -((w - 1.0 / w.shape[-1]) * seq_scores).sum(-1)
    return torch.where(active, per_group, torch.zeros_like(per_group)).sum() / max(num_groups, 1)


def _listwise(loss_fn, inputs: PolicyInputs, norm: StepNormalizer) -> PolicyTerm:
    if inputs.listwise_weights is None or inputs.listwise_active is None:
        raise ValueError("listwise_weights and listwise_active are required by the listwise policy losses")
    if inputs.row_weights is not None:
        raise ValueError("row_weights apply to the clipped_surrogate policy loss only")
    params: ListwiseParams = inputs.params
    g = inputs.num_generations
    b = inputs.logp.shape[0]
    if b % g != 0:
        raise ValueError(f"micro-batch of {b} rows is not a whole number of groups of num_generations={g}")
    scores = sequence_scores(inputs.logp, inputs.mask, params.score).view(-1, g)
    weights = inputs.listwise_weights.view(-1, g)
    group_loss = loss_fn(scores, weights, inputs.listwise_active, norm.num_groups)
    if params.clip_coef == 0:
        return PolicyTerm(torch.zeros_like(inputs.logp), group_loss, clip_metrics(None, group_loss))
    # Optional sequence-level clip term with a_i = w_i - 1/G, active groups only.
    row_active = inputs.listwise_active.repeat_interleave(g).to(weights.dtype)
    adv = (inputs.listwise_weights.detach() - 1.0 / g) * row_active
    terms = ppo_clip_terms(inputs.logp, inputs.old_logp, adv, inputs.mask, inputs.clip)
    per_token = params.clip_coef * terms.per_token_loss * inputs.policy_mask
    return PolicyTerm(per_token, group_loss, clip_metrics(terms, per_token))


@register_policy_loss("listwise_cross_entropy", params=ListwiseParams)
def listwise_cross_entropy_objective(inputs: PolicyInputs, norm: StepNormalizer) -> PolicyTerm:
    return _listwise(listwise_cross_entropy, inputs, norm)


@register_policy_loss("listwise_weighted_mle", params=ListwiseParams)
def listwise_weighted_mle_objective(inputs: PolicyInputs, norm: StepNormalizer) -> PolicyTerm:
    return _listwise(listwise_weighted_mle, inputs, norm)


@register_policy_loss("listwise_centered_mle", params=ListwiseParams)
def listwise_centered_mle_objective(inputs: PolicyInputs, norm: StepNormalizer) -> PolicyTerm:
    return _listwise(listwise_centered_mle, inputs, norm)
