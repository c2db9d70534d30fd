"""A reference that follows the policy (TR-DPO, arXiv 2404.09656; TRL ``sync_ref_model``):
every ``sync_steps`` optimizer steps, ``pi_ref <- alpha * pi_theta + (1 - alpha) * pi_ref``
(``alpha = 1``: a hard copy), parameter by parameter, in place, without gradients."""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from maxent_grpo.core.bounds import require

__all__ = ["RefSync", "due", "mix_into_reference"]


@dataclass(frozen=True)
class RefSync:
    """TR-DPO's update: ``alpha`` in (0, 1] (1: a hard copy) every ``sync_steps`` >= 1 optimizer steps
    (the defaults are TRL DPOConfig's ``ref_model_mixup_alpha`` 0.6 and ``ref_model_sync_steps`` 512)."""

    alpha: float = 0.6
    sync_steps: int = 512

    def __post_init__(self) -> None:
        require(math.isfinite(self.alpha) and 0.0 < self.alpha <= 1.0, "ref_model_mixup_alpha",
                f"must be in (0, 1], got {self.alpha!r}")
        require(self.sync_steps >= 1, "ref_model_sync_steps", f"must be >= 1, got {self.sync_steps}")


def due(step: int, sync_steps: int) -> bool:
    """Whether the reference is updated after optimizer step ``step`` (1 after the first)."""
    if sync_steps < 1:
        raise ValueError(f"sync_steps must be >= 1, got {sync_steps}")
    return step > 0 and step % sync_steps == 0


@torch.no_grad()
def mix_into_reference(reference: torch.nn.Module, policy: torch.nn.Module, alpha: float) -> None:
    """``reference <- alpha * policy + (1 - alpha) * reference`` over same-named parameters (the
    policy unwrapped, full, as the reference was loaded); one line naming a missing or mis-shaped one."""
    if not (math.isfinite(alpha) and 0.0 < alpha <= 1.0):
        raise ValueError(f"alpha must be in (0, 1], got {alpha!r}")
    source = dict(policy.named_parameters())
    for name, ref in reference.named_parameters():
        if name not in source or source[name].shape != ref.shape:
            raise ValueError(f"the reference's parameter {name} has no same-shaped policy parameter")
        ref.lerp_(source[name].to(device=ref.device, dtype=ref.dtype), alpha)
