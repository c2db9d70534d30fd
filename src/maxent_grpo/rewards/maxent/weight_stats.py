"""Listwise weights of one batch and their entropy diagnostics.

The weight formula lives in ``maxent_grpo.core.weighting``; this module slices
the reference log-probs per group, calls it, and summarises the result in
:class:`WeightStats`. Tensors are flat ``[N]`` (prompt-major, ``N = P * G``)
or grouped ``[P, G]``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from maxent_grpo.core.logprobs import per_token_logp
from maxent_grpo.core.weighting import listwise_weights, restrict_support, weight_entropy
from maxent_grpo.rewards.maxent.reward_stats import RewardComputation
from maxent_grpo.rewards.maxent.shapes import grouped
from maxent_grpo.rewards.maxent.settings import WeightingSettings


@dataclass(frozen=True)
class ReferenceLogprobs:
    """Reference-model sequence log-probs: ``ref_logp_sum[N]`` summed over each completion's ``ref_tok_counts[N]`` tokens."""

    ref_logp_sum: torch.Tensor
    ref_tok_counts: torch.Tensor

    def __post_init__(self) -> None:
        if self.ref_logp_sum.dim() != 1 or self.ref_tok_counts.shape != self.ref_logp_sum.shape:
            raise ValueError(
                f"ref_logp_sum and ref_tok_counts must both be [N], got {tuple(self.ref_logp_sum.shape)} "
                f"and {tuple(self.ref_tok_counts.shape)}"
            )

    @property
    def ref_logp_per_token(self) -> torch.Tensor:
        """Length-normalised log-probs ``sum / max(T, 1)``."""
        return per_token_logp(self.ref_logp_sum, self.ref_tok_counts)

    @property
    def ref_logp_mean(self) -> float:
        return float(self.ref_logp_per_token.mean())

    @property
    def avg_completion_tokens(self) -> float:
        return float(self.ref_tok_counts.to(torch.float64).mean())


@dataclass(frozen=True)
class WeightLoggingView:
    """Aggregated entropy statistics for logging (nats; ``entropy_norm`` divides by ``log G``)."""

    entropy: float = 0.0
    entropy_norm: float = 0.0
    entropy_min: float = 0.0
    entropy_max: float = 0.0
    advantage_entropy_mean: float = 0.0
    advantage_entropy_std: float = 0.0


@dataclass(frozen=True)
class WeightStats:
    """Listwise weights of a batch and their entropy diagnostics.

    ``advantage_entropy[N]`` are the listwise advantages ``w_i - 1/G`` (the
    seed's name for them).
    """

    weights_grouped: torch.Tensor
    flat_weights: torch.Tensor
    weight_entropy: float
    weight_entropy_min: float
    weight_entropy_max: float
    advantage_entropy: torch.Tensor
    # Groups the entropy statistics are over (those that enter the loss); NaN statistics when 0.
    num_active_groups: int | None = None

    def logging_view(self) -> WeightLoggingView:
        """This batch's statistics as a :class:`WeightLoggingView` (local; cross-rank reduction is the caller's)."""
        g = self.weights_grouped.shape[1]
        adv = self.advantage_entropy.to(torch.float64)
        return WeightLoggingView(
            entropy=self.weight_entropy,
            entropy_norm=self.weight_entropy / math.log(g) if g > 1 else 0.0,
            entropy_min=self.weight_entropy_min,
            entropy_max=self.weight_entropy_max,
            advantage_entropy_mean=float(adv.mean()),
            advantage_entropy_std=float(adv.std()) if adv.numel() >= 2 else 0.0,
        )


def split_reference_logprobs(ref_stats: ReferenceLogprobs, num_generations: int, len_norm_ref: bool) -> torch.Tensor:
    """Reference sequence log-probs grouped ``[P, G]``, divided by token counts when ``len_norm_ref``."""
    values = ref_stats.ref_logp_per_token if len_norm_ref else ref_stats.ref_logp_sum
    return grouped("ref_stats.ref_logp_sum", values, num_generations)


def split_reference_token_counts(ref_stats: ReferenceLogprobs, num_generations: int) -> torch.Tensor:
    """Reference token counts grouped ``[P, G]``."""
    return grouped("ref_stats.ref_tok_counts", ref_stats.ref_tok_counts, num_generations)


def weight_matrix_from_q(
    q_values: torch.Tensor,
    ref_logp: torch.Tensor | None,
    token_counts: torch.Tensor | None,
    weighting_cfg: WeightingSettings,
    *,
    include_reference_term: bool = True,
) -> torch.Tensor:
    """Listwise weights ``[P, G]`` from q (already tempered and floored) and summed reference log-probs.

    The reference term is length-normalised when ``weighting_cfg.len_norm_ref``;
    without it (``include_reference_term=False`` or ``ref_logp=None``) the
    reference is uniform, and the denominator is still ``tau + beta``.
    """
    return listwise_weights(
        q_values,
        weighting_cfg.tau,
        weighting_cfg.beta,
        ref_logp=ref_logp if include_reference_term else None,
        token_counts=token_counts,
        length_normalize=weighting_cfg.len_norm_ref,
    ).detach()


def collect_weight_entropy(weights_grouped: torch.Tensor) -> tuple[float, float, float, torch.Tensor]:
    """(mean, min, max) of the per-group weight entropies and the listwise advantages ``w - 1/G`` flat."""
    h = weight_entropy(weights_grouped).to(torch.float64)
    adv = (weights_grouped - 1.0 / weights_grouped.shape[1]).reshape(-1)
    return float(h.mean()), float(h.min()), float(h.max()), adv


def _weight_stats(weights_grouped: torch.Tensor, active: torch.Tensor | None = None) -> WeightStats:
    if active is None or bool(active.all()):
        mean, lo, hi, adv = collect_weight_entropy(weights_grouped)
        return WeightStats(weights_grouped, weights_grouped.reshape(-1), mean, lo, hi, adv, weights_grouped.shape[0])
    # Groups left out of the loss train on nothing: uniform weights, and no say in the entropy
    # the tau controller steers by.
    g = weights_grouped.shape[1]
    weights_grouped = torch.where(active.unsqueeze(1), weights_grouped, torch.full_like(weights_grouped, 1.0 / g))
    adv = (weights_grouped - 1.0 / g).reshape(-1)
    n = int(active.sum())
    if n == 0:
        return WeightStats(weights_grouped, weights_grouped.reshape(-1), math.nan, math.nan, math.nan, adv, 0)
    mean, lo, hi, _ = collect_weight_entropy(weights_grouped[active])
    return WeightStats(weights_grouped, weights_grouped.reshape(-1), mean, lo, hi, adv, n)


def compute_weight_stats(
    reward_comp: RewardComputation,
    ref_stats: ReferenceLogprobs | None,
    weighting_cfg: WeightingSettings,
    active: torch.Tensor | None = None,
    support: torch.Tensor | None = None,
) -> WeightStats:
    """Listwise weights for the batch from its q and the reference log-probs (detached).

    ``ref_stats`` may be ``None`` only when ``beta = 0`` (no reference model).
    ``active[P]`` marks the groups that enter the listwise loss (None: all); the others
    get uniform weights and are left out of the entropy statistics. ``support[P, G]`` (bool;
    None: every completion) restricts each group's weights to the completions it marks.
    """
    g = reward_comp.num_generations
    ref_logp = token_counts = None
    if weighting_cfg.beta > 0:
        if ref_stats is None:
            raise ValueError("ref_stats is required when beta > 0")
        ref_logp = split_reference_logprobs(ref_stats, g, len_norm_ref=False)
        token_counts = split_reference_token_counts(ref_stats, g)
        if ref_logp.shape != reward_comp.q.shape:
            raise ValueError(f"ref_stats must cover the batch's {reward_comp.total.shape[0]} completions, "
                             f"got {ref_stats.ref_logp_sum.shape[0]}")
    weights = weight_matrix_from_q(reward_comp.q, ref_logp, token_counts, weighting_cfg)
    if support is not None:
        weights = restrict_support(weights, support)
    return _weight_stats(weights, active)
