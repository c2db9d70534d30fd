"""Entropy terms of the loss (ALGORITHMS.md §3, §6): the step-wide top-entropy token mask
("80/20") and the normalised entropy bonus averaged as the loss is. ``core.step`` applies them
around the registered policy loss. The coefficient is ``loss.entropy_coef``, or the adaptive one
of ``loss.adaptive_entropy`` (training/loop.py).
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch

from maxent_grpo.core.bounds import require
from maxent_grpo.core.losses import Aggregator, StepNormalizer, aggregate_bnpo, aggregate_dapo, aggregate_grpo

# How the entropy term is averaged for each loss_type (§6): sequence means for
# grpo / dr_grpo / luspo, token means for bnpo / dapo.
ENTROPY_AGGREGATIONS: dict[str, Aggregator] = {
    "grpo": aggregate_grpo,
    "dr_grpo": aggregate_grpo,
    "luspo": aggregate_grpo,
    "bnpo": aggregate_bnpo,
    "dapo": aggregate_dapo,
}



def check_top_entropy_quantile(quantile: float) -> None:
    require(0 < quantile <= 1, "top_entropy_quantile", f"must be in (0, 1], got {quantile}")


def top_entropy_threshold(entropies: Sequence[torch.Tensor], masks: Sequence[torch.Tensor], quantile: float) -> float:
    """The entropy of the ``ceil(quantile * n)``-th highest-entropy active token over all of
    ``entropies`` (the step's micro-batches, ``[B_i, T]`` each; ``n`` active tokens in all).

    ALGORITHMS.md §3 (Wang et al. 2025, "80/20"): the top fraction is taken over the
    whole step's tokens, so the gradient does not depend on how the step is split into
    micro-batches. ``-inf`` (keep every token) when ``quantile == 1`` or nothing is active.
    """
    check_top_entropy_quantile(quantile)
    values = torch.cat([e.detach()[m > 0].reshape(-1) for e, m in zip(entropies, masks)])
    if quantile == 1 or values.numel() == 0:
        return -math.inf
    k = math.ceil(quantile * values.numel())
    return float(torch.topk(values, k, sorted=False).values.min())


def top_entropy_mask(entropies: torch.Tensor, mask: torch.Tensor, quantile: float, threshold: float | None = None) -> torch.Tensor:
    """Float mask of the active tokens whose entropy is at least ``threshold`` (ties kept).

    Without ``threshold``: the ``ceil(quantile * n)`` highest of the ``n`` active tokens passed in.
    """
    active = mask > 0
    if threshold is None:
        threshold = top_entropy_threshold([entropies], [mask], quantile)
    return (active & (entropies.detach() >= threshold)).to(entropies.dtype)


def entropy_bonus(
    entropies: torch.Tensor,
    mask: torch.Tensor,
    vocab_size: int,
    loss_type: str,
    norm: StepNormalizer,
) -> torch.Tensor:
    """Contribution to ``B``, the token entropy over ``log V``, averaged as the loss is (§6).

    The loss subtracts ``alpha * B``; gradients flow through ``entropies``.
    """
    if vocab_size < 2:
        raise ValueError(f"vocab_size must be >= 2, got {vocab_size}")
    if loss_type not in ENTROPY_AGGREGATIONS:
        raise ValueError(f"loss_type must be one of {sorted(ENTROPY_AGGREGATIONS)}, got {loss_type!r}")
    return ENTROPY_AGGREGATIONS[loss_type](entropies / math.log(vocab_size), mask.to(entropies.dtype), norm)
