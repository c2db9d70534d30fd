"""Rewards to group advantages (ALGORITHMS.md §2).

Layout: ``P`` prompts x ``G`` generations, prompt-major, so rows
``p*G .. p*G+G-1`` are prompt ``p`` and ``N = P*G``. A reward of ``NaN`` marks a
row for which every reward function returned ``None``: it gets advantage 0 and
is left out of its group's statistics.

A group is "zero-std" when its valid rewards are all equal (or it has fewer than
two valid rewards). Equality is tested exactly (max == min) instead of reading
``std == 0``, because a float mean of equal values is not always that value
(``(0.1+0.1+0.1)/3 != 0.1``), which would leave tiny non-zero advantages.
"""

from __future__ import annotations

from typing import Callable

import torch

# Added to the standard deviation before dividing (TRL's constant).
STD_EPS = 1e-4

SCALE_REWARDS = ("group", "batch", "none")


def combine_rewards(per_function: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
    """Weighted nan-sum over reward functions: ``[N, K]`` x ``[K]`` -> ``[N]``.

    ``NaN`` entries (the function returned ``None``) are skipped; a row where every
    function is ``NaN`` stays ``NaN``.
    """
    if per_function.dim() != 2:
        raise ValueError(f"per_function must be [N, K], got shape {tuple(per_function.shape)}")
    if weights.dim() != 1 or weights.shape[0] != per_function.shape[1]:
        raise ValueError(
            f"weights must be [K={per_function.shape[1]}], got shape {tuple(weights.shape)}"
        )
    missing = torch.isnan(per_function)
    weighted = torch.where(missing, torch.zeros_like(per_function), per_function * weights.to(per_function))
    total = weighted.sum(dim=1)
    return torch.where(missing.all(dim=1), torch.full_like(total, float("nan")), total)


def zero_truncated_rewards(rewards: torch.Tensor, truncated: torch.Tensor) -> torch.Tensor:
    """Reward 0 for completions that hit ``max_completion_length`` without EOS."""
    if truncated.shape != rewards.shape or truncated.dtype != torch.bool:
        raise ValueError(
            f"truncated must be a bool tensor shaped like rewards {tuple(rewards.shape)}, "
            f"got {truncated.dtype} {tuple(truncated.shape)}"
        )
    return torch.where(truncated, torch.zeros_like(rewards), rewards)


def _grouped(rewards: torch.Tensor, num_generations: int) -> torch.Tensor:
    if isinstance(num_generations, bool) or not isinstance(num_generations, int):
        raise ValueError(f"num_generations must be an int, got {num_generations!r}")
    if num_generations < 2:
        raise ValueError(f"num_generations must be >= 2 for group statistics, got {num_generations}")
    if rewards.dim() != 1:
        raise ValueError(f"rewards must be 1-D [N], got shape {tuple(rewards.shape)}")
    if rewards.shape[0] % num_generations != 0:
        raise ValueError(
            f"rewards has {rewards.shape[0]} rows, not a multiple of num_generations={num_generations}"
        )
    return rewards.view(-1, num_generations)


def _group_moments(r: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Per group ``[P, G]``: valid mask, count, mean and unbiased std over valid entries."""
    valid = ~torch.isnan(r)
    n = valid.sum(dim=1)
    r0 = torch.where(valid, r, torch.zeros_like(r))
    mean = r0.sum(dim=1) / n.clamp(min=1)
    dev = torch.where(valid, r - mean[:, None], torch.zeros_like(r))
    var = (dev * dev).sum(dim=1) / (n - 1).clamp(min=1)
    return valid, n, mean, var.sqrt()


def zero_std_groups(rewards: torch.Tensor, num_generations: int) -> torch.Tensor:
    """``[P]`` bool: the group's valid rewards are all equal (or fewer than two are valid)."""
    r = _grouped(rewards, num_generations)
    valid = ~torch.isnan(r)
    hi = torch.where(valid, r, torch.full_like(r, -torch.inf)).amax(dim=1)
    lo = torch.where(valid, r, torch.full_like(r, torch.inf)).amin(dim=1)
    return (valid.sum(dim=1) < 2) | (hi == lo)


def group_reward_std(rewards: torch.Tensor, num_generations: int) -> torch.Tensor:
    """``[P]`` unbiased reward std per group over valid rows; exactly 0 for zero-std groups."""
    r = _grouped(rewards, num_generations)
    _, _, _, std = _group_moments(r)
    return torch.where(zero_std_groups(rewards, num_generations), torch.zeros_like(std), std)


def _grpo_centered(r: torch.Tensor, n: torch.Tensor, mean: torch.Tensor) -> torch.Tensor:
    return r - mean[:, None]


def _rloo_centered(r: torch.Tensor, n: torch.Tensor, mean: torch.Tensor) -> torch.Tensor:
    # r_i - mean_{j != i} r_j == n/(n-1) * (r_i - mean), with n the group's valid count.
    n = n.to(r.dtype)
    return (n / (n - 1).clamp(min=1))[:, None] * (r - mean[:, None])


# Each estimator maps (rewards [P, G], valid counts [P], valid means [P]) to
# centred advantages [P, G]; NaN rows and zero-std groups are zeroed afterwards.
ADVANTAGE_ESTIMATORS: dict[str, Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]] = {
    "grpo": _grpo_centered,
    "rloo": _rloo_centered,
}


def _batch_std(rewards: torch.Tensor) -> torch.Tensor:
    valid = rewards[~torch.isnan(rewards)]
    if valid.numel() < 2:
        return torch.zeros((), dtype=rewards.dtype, device=rewards.device)
    return valid.std(unbiased=True)


def compute_advantages(
    rewards: torch.Tensor,
    num_generations: int,
    *,
    estimator: str = "grpo",
    scale_rewards: str = "group",
) -> torch.Tensor:
    """Group advantages ``[N]`` from total rewards ``[N]`` (prompt-major groups of ``num_generations``).

    * ``estimator="grpo"``: ``A_i = r_i - mean_g(r)``; ``"rloo"``: ``A_i = r_i - mean_{j!=i} r_j``.
    * ``scale_rewards="group"``: divide by the group's unbiased std ``+ 1e-4``.
      ``"batch"``: divide by ``std(all valid rewards passed in) + 1e-4`` (unbiased,
      one scalar; the centring stays per group, as in TRL). Pass the whole
      optimizer batch, gathered over ranks, for that scalar to be the global one.
      ``"none"`` (Dr.GRPO): no division.
    * Rows with ``NaN`` reward get 0 and do not count in their group's mean/std;
      groups whose valid rewards are all equal get exactly 0.
    """
    if estimator not in ADVANTAGE_ESTIMATORS:
        raise ValueError(f"estimator must be one of {sorted(ADVANTAGE_ESTIMATORS)}, got {estimator!r}")
    if scale_rewards not in SCALE_REWARDS:
        raise ValueError(f"scale_rewards must be one of {list(SCALE_REWARDS)}, got {scale_rewards!r}")
    r = _grouped(rewards, num_generations)
    valid, n, mean, std = _group_moments(r)
    adv = ADVANTAGE_ESTIMATORS[estimator](r, n, mean)
    if scale_rewards == "group":
        adv = adv / (std[:, None] + STD_EPS)
    elif scale_rewards == "batch":
        adv = adv / (_batch_std(rewards) + STD_EPS)
    keep = valid & ~zero_std_groups(rewards, num_generations)[:, None]
    return torch.where(keep, adv, torch.zeros_like(adv)).reshape(-1)
