"""Reward-side policy-entropy bonus (ALGORITHMS.md §6, ``policy_entropy_bonus_coef``).

``r'_i = r_i + c * sigma_r * z_i``: ``z_i`` is completion i's mean token
entropy z-scored within its group, ``sigma_r`` the batch reward std (1 if 0),
so ``c`` is in units of reward spread and the bonus cannot dominate a batch
whose rewards barely vary. Advantages, q and SEED scales are recomputed from
``r'`` by the caller.
"""

from __future__ import annotations

import math

import torch

__all__ = ["entropy_bonus_rewards", "ENTROPY_STD_FLOOR"]

# Floor on the within-group entropy std: a group of (nearly) identical
# completions gets z = 0 rather than an amplified rounding difference.
ENTROPY_STD_FLOOR = 1e-6


def entropy_bonus_rewards(rewards: torch.Tensor, mean_token_entropy: torch.Tensor, coef: float) -> torch.Tensor:
    """``[P, G]`` rewards plus the entropy bonus; ``coef = 0`` returns the rewards unchanged.

    Both standard deviations are unbiased (divisor ``n - 1``), as for group
    advantages. The entropies are treated as data (detached). A ``NaN`` reward
    (no reward function applied) stays ``NaN`` and is left out of ``sigma_r``.
    """
    if rewards.dim() != 2:
        raise ValueError(f"rewards must be a [P, G] tensor, got shape {tuple(rewards.shape)}")
    if mean_token_entropy.shape != rewards.shape:
        raise ValueError(
            f"mean_token_entropy must have the shape of rewards {tuple(rewards.shape)}, "
            f"got {tuple(mean_token_entropy.shape)}"
        )
    if rewards.shape[1] < 2:
        raise ValueError(f"rewards: a within-group z-score needs G >= 2 completions per group, got G={rewards.shape[1]}")
    if not math.isfinite(coef):
        raise ValueError(f"coef must be finite, got {coef}")
    if coef == 0.0:
        return rewards.clone()
    h = mean_token_entropy.detach().to(rewards.dtype)
    z = (h - h.mean(dim=-1, keepdim=True)) / h.std(dim=-1, keepdim=True).clamp(min=ENTROPY_STD_FLOOR)
    known = rewards.detach()[~torch.isnan(rewards)]
    # "No spread" is decided on the values, not on the std: twelve rewards of 0.1 have a
    # floating-point std of ~1e-17, which would switch the bonus off instead of using 1.
    spread = known.numel() >= 2 and bool(known.max() > known.min())
    sigma_r = known.std() if spread else torch.ones((), dtype=rewards.dtype, device=rewards.device)
    return rewards + coef * sigma_r * z
