"""OPSM (off-policy sequence masking, DeepSeek-V3.2 arXiv:2512.02556 Eq. 9; ALGORITHMS.md §14):
the PPO clipped surrogate, with a negative-advantage sequence dropped when its mean per-token
log-ratio to the sampler (the trainer's old policy without one) exceeds ``delta``; TRL's
``off_policy_mask_threshold``, slime's ``--use-opsm``. The loss is ``core.peer_losses``'s
``opsm``; this file holds the method, its ``opsm:`` settings and its preset.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

from maxent_grpo.core.peer_losses import OpsmParams
from maxent_grpo.methods.registry import Method, PlanInputs, register


@dataclass
class OpsmConfig:
    delta: float = field(default=1e-4, metadata={
        "help": "OPSM threshold on a sequence's mean log-ratio to the sampler (slime 1e-4; TRL suggests 0.5)"})


def _loss(inputs: PlanInputs):
    s: OpsmConfig = inputs.settings
    return dataclasses.replace(inputs.loss, policy_loss="opsm", policy_params=OpsmParams(s.delta))


register(Method(
    "opsm", "grpo", "OPSM: the PPO clip, with off-policy negative-advantage sequences masked",
    preset={"loss.loss_type": "dapo"}, section="opsm", settings=OpsmConfig, loss=_loss,
))
