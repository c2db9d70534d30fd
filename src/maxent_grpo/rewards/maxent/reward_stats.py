"""Reward statistics of one batch: total rewards, group advantages, q-distribution, SEED scales.

The arithmetic lives in ``maxent_grpo.core`` (advantages, weighting,
seed_grpo, reward_entropy); this module validates shapes and assembles
:class:`RewardComputation`. Tensors are flat ``[N]`` (prompt-major,
``N = P * G``) or grouped ``[P, G]``.

A reward of ``NaN`` marks a completion for which every reward function returned
``None``: it gets advantage 0, is left out of its group's statistics, and
counts as reward 0 in the q-distribution.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, replace

import torch

from maxent_grpo.core.advantages import (
    REWARD_AGGREGATIONS,
    combine_rewards,
    compute_advantages,
    group_reward_std,
    normalize_then_sum,
    zero_std_groups,
    zero_truncated_rewards,
)
from maxent_grpo.core.reward_entropy import entropy_bonus_rewards
from maxent_grpo.core.seed_grpo import seed_grpo_scales
from maxent_grpo.core.weighting import q_distribution
from maxent_grpo.rewards.maxent.settings import QDistributionSettings
from maxent_grpo.rewards.maxent.shapes import check_num_generations, grouped


@dataclass(frozen=True)
class SeedGrpoInputs:
    """What SEED-GRPO needs per completion (flat ``[N]``) and its settings.

    ``cluster_ids`` are compared within a group only; a completion with no
    answer must have an id no other completion of its group has.
    ``seq_logps`` are the behaviour policy's summed sequence log-probs.
    """

    cluster_ids: torch.Tensor
    seq_logps: torch.Tensor
    token_counts: torch.Tensor
    alpha: float = 0.0417
    normalize_by_max_entropy: bool = True
    length_normalize: bool = True

    def scales(self, num_generations: int) -> torch.Tensor:
        return seed_grpo_scales(
            grouped("seed_grpo.cluster_ids", self.cluster_ids, num_generations),
            grouped("seed_grpo.seq_logps", self.seq_logps, num_generations),
            grouped("seed_grpo.token_counts", self.token_counts, num_generations),
            alpha=self.alpha,
            normalize_by_max_entropy=self.normalize_by_max_entropy,
            length_normalize=self.length_normalize,
        )


@dataclass(frozen=True)
class RewardStatsSettings:
    """How a batch's rewards become its statistics: the listwise target q (the MaxEnt weighting's own
    ``QDistributionSettings``), the advantage scaling and estimator, and how reward functions combine."""

    q: QDistributionSettings
    scale_rewards: str = "group"
    advantage_estimator: str = "grpo"
    aggregation: str = "sum_then_normalize"  # how the reward functions combine (core/advantages.py)


@dataclass(frozen=True)
class RewardComputation:
    """Rewards of one batch and everything derived from them.

    ``total[N]`` is the reward each completion is trained on (after truncation
    zeroing and any entropy bonus; ``NaN`` = no reward applied);
    ``advantages[N]`` already include the SEED scales when SEED is on;
    ``q[P, G]`` is the floored listwise target.
    """

    per_function: torch.Tensor
    reward_names: tuple[str, ...]
    total: torch.Tensor
    advantages: torch.Tensor
    q: torch.Tensor
    group_std: torch.Tensor
    zero_std: torch.Tensor
    seed_scales: torch.Tensor | None
    num_generations: int
    settings: RewardStatsSettings
    seed_grpo: SeedGrpoInputs | None = None
    entropy_bonus: torch.Tensor | None = None
    token_counts: torch.Tensor | None = None  # [N] completion tokens in the loss (REINFORCE++ whitening)

    @property
    def num_prompts(self) -> int:
        return self.q.shape[0]

    @property
    def frac_zero_std(self) -> float:
        return float(self.zero_std.to(torch.float64).mean())

    @property
    def train_reward_mean(self) -> float:
        return reward_moments(self.total)[0]

    @property
    def train_reward_std(self) -> float:
        return reward_moments(self.total)[1]


def _derived(total: torch.Tensor, num_generations: int, settings: RewardStatsSettings,
             seed: SeedGrpoInputs | None, token_counts: torch.Tensor | None) -> dict[str, torch.Tensor | None]:
    """Advantages, q, group statistics and SEED scales from the final rewards."""
    adv = compute_advantages(total, num_generations, estimator=settings.advantage_estimator,
                             scale_rewards=settings.scale_rewards, token_counts=token_counts)
    scales = None
    if seed is not None:
        scales = seed.scales(num_generations).to(adv.dtype)
        adv = (adv.view(-1, num_generations) * scales[:, None]).reshape(-1)
    q_input = torch.nan_to_num(total.view(-1, num_generations), nan=0.0)
    return {
        "advantages": adv,
        "q": q_distribution(q_input, settings.q.temperature, settings.q.epsilon),
        "group_std": group_reward_std(total, num_generations),
        "zero_std": zero_std_groups(total, num_generations),
        "seed_scales": scales,
    }


def compute_reward_statistics(
    per_function: torch.Tensor,
    weights: torch.Tensor | Sequence[float],
    num_generations: int,
    *,
    q_temperature: float,
    q_epsilon: float,
    scale_rewards: str = "group",
    advantage_estimator: str = "grpo",
    truncated: torch.Tensor | None = None,
    zero_truncated_completion_rewards: bool = False,
    seed_grpo: SeedGrpoInputs | None = None,
    names: Sequence[str] | None = None,
    token_counts: torch.Tensor | None = None,
    aggregation: str = "sum_then_normalize",
) -> RewardComputation:
    """Total rewards, group advantages, q-distribution and (optionally) SEED scales for one batch.

    ``per_function[N, K]`` holds each reward function's value (``NaN`` where it
    returned ``None``), ``weights[K]`` their weights, combined by ``aggregation``: their weighted
    sum, or ``normalize_then_sum`` (GDPO: each normalised over its group first). With
    ``zero_truncated_completion_rewards``, rows flagged in ``truncated[N]`` get
    reward 0. ``token_counts[N]``: each completion's tokens in the loss (the REINFORCE++
    estimators whiten over them; required by those).
    """
    return reward_statistics(
        per_function, weights, num_generations,
        RewardStatsSettings(QDistributionSettings(q_temperature, q_epsilon), scale_rewards, advantage_estimator,
                            aggregation),
        truncated=truncated, zero_truncated_completion_rewards=zero_truncated_completion_rewards,
        seed_grpo=seed_grpo, names=names, token_counts=token_counts,
    )


def reward_statistics(
    per_function: torch.Tensor,
    weights: torch.Tensor | Sequence[float],
    num_generations: int,
    settings: RewardStatsSettings,
    *,
    truncated: torch.Tensor | None = None,
    zero_truncated_completion_rewards: bool = False,
    seed_grpo: SeedGrpoInputs | None = None,
    names: Sequence[str] | None = None,
    token_counts: torch.Tensor | None = None,
) -> RewardComputation:
    """:func:`compute_reward_statistics` with its settings as the run's record (the pipeline's call)."""
    check_num_generations(num_generations)
    if per_function.dim() != 2 or per_function.shape[0] % num_generations != 0:
        raise ValueError(f"per_function must be [N, K] with N a multiple of num_generations={num_generations}, "
                         f"got shape {tuple(per_function.shape)}")
    w = torch.as_tensor(weights, dtype=per_function.dtype, device=per_function.device)
    k = per_function.shape[1]
    names = tuple(names) if names is not None else tuple(f"reward_{i}" for i in range(k))
    if len(names) != k:
        raise ValueError(f"names must hold one name per reward function ({k}), got {len(names)}")
    aggregation = settings.aggregation
    if aggregation not in REWARD_AGGREGATIONS:
        raise ValueError(f"aggregation must be one of {list(REWARD_AGGREGATIONS)}, got {aggregation!r}")
    total = (normalize_then_sum(per_function, w, num_generations) if aggregation == "normalize_then_sum"
             else combine_rewards(per_function, w))
    if zero_truncated_completion_rewards:
        if truncated is None:
            raise ValueError("truncated is required when zero_truncated_completion_rewards=True")
        total = zero_truncated_rewards(total, truncated)
    return RewardComputation(
        per_function=per_function,
        reward_names=names,
        total=total,
        num_generations=num_generations,
        settings=settings,
        seed_grpo=seed_grpo,
        token_counts=token_counts,
        **_derived(total, num_generations, settings, seed_grpo, token_counts),
    )


def apply_policy_entropy_bonus(
    reward_comp: RewardComputation, mean_token_entropy: torch.Tensor, coef: float
) -> RewardComputation:
    """Add ``coef * sigma_r * z(entropy)`` to the rewards and recompute advantages, q and SEED scales (§6).

    ``mean_token_entropy[N]`` is each completion's mean token entropy.
    ``coef = 0`` returns ``reward_comp`` itself. Applying a bonus twice is an error.
    """
    if coef == 0.0:
        return reward_comp
    if reward_comp.entropy_bonus is not None:
        raise ValueError("reward_comp: the policy entropy bonus has already been applied")
    g = reward_comp.num_generations
    h = grouped("mean_token_entropy", mean_token_entropy, g)
    if h.shape[0] != reward_comp.num_prompts:
        raise ValueError(f"mean_token_entropy must be [N={reward_comp.total.shape[0]}], got {tuple(mean_token_entropy.shape)}")
    total = entropy_bonus_rewards(reward_comp.total.view(-1, g), h, coef).reshape(-1)
    return replace(
        reward_comp,
        total=total,
        entropy_bonus=total - reward_comp.total,
        **_derived(total, g, reward_comp.settings, reward_comp.seed_grpo, reward_comp.token_counts),
    )


def reward_moments(total: torch.Tensor) -> tuple[float, float]:
    """Mean and unbiased std of the rewards that were applied (``NaN`` rows left out; std 0 under two values)."""
    known = total[~torch.isnan(total)].to(torch.float64)
    if known.numel() == 0:
        return 0.0, 0.0
    std = float(known.std()) if known.numel() >= 2 else 0.0
    return float(known.mean()), std
