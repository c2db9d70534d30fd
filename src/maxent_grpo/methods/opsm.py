"""OPSM (off-policy sequence masking, DeepSeek-V3.2 arXiv:2512.02556 Eq. 9; ALGORITHMS.md §14):
the PPO clipped surrogate, with a negative-advantage sequence dropped when its mean per-token
log-ratio to the sampler (the trainer's old policy without one) exceeds ``delta``; TRL's
``off_policy_mask_threshold``, slime's ``--use-opsm``. The loss is ``core.peer_losses``'s
``opsm``; this file holds the method, its ``opsm:`` settings and its preset.
"""

from __future__ import annotations

import dataclasses

from maxent_grpo.core.peer_losses import OpsmParams
from maxent_grpo.methods.registry import Method, PlanInputs, register, section_of


# The opsm: section is OpsmParams's fields and defaults (core/peer_losses.py), with help on each.
OpsmConfig = section_of(OpsmParams, "OpsmConfig", {
    "delta": "OPSM threshold on a sequence's mean log-ratio to the sampler (slime 1e-4; TRL suggests 0.5)",
}, __name__)


def _loss(inputs: PlanInputs):
    params = OpsmParams(**dataclasses.asdict(inputs.settings))
    return dataclasses.replace(inputs.loss, policy_loss="opsm", policy_params=params)


register(Method(
    "opsm", "grpo", "OPSM: the PPO clip, with off-policy negative-advantage sequences masked",
    preset={"loss.loss_type": "dapo"}, section="opsm", settings=OpsmConfig, loss=_loss,
))
