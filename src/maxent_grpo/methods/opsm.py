"""OPSM (off-policy sequence masking, DeepSeek-V3.2 arXiv:2512.02556 Eq. 9; ALGORITHMS.md §14): the
PPO clipped surrogate, with a negative-advantage sequence dropped when its mean per-token log-
ratio to the sampler (the trainer's old policy without one) exceeds ``delta``; TRL's
``off_policy_mask_threshold``, slime's ``--use-opsm``. The loss is ``core.peer_losses``'s
``opsm``; this file is the method: its ``opsm:`` settings and its preset.
"""

from __future__ import annotations

from maxent_grpo.core.peer_losses import OpsmParams
from maxent_grpo.methods.registry import register_policy_loss_method

# The opsm: section is OpsmParams's fields and defaults (core/peer_losses.py), with help on each.
OpsmConfig = register_policy_loss_method("opsm", OpsmParams, {
    "delta": "OPSM threshold on a sequence's mean log-ratio to the sampler (slime 1e-4; TRL suggests 0.5)",
},
    "OPSM: the PPO clip, with off-policy negative-advantage sequences masked",
    loss_type="dapo", module=__name__)
