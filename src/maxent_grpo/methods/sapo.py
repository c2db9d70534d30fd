"""SAPO (Soft Adaptive Policy Optimization, arXiv 2511.20347; ALGORITHMS.md §11): the PPO clip
replaced by a soft gate ``(4/tau) * sigmoid(tau (r - 1))`` whose temperature depends on the sign
of the advantage; TRL, verl, AReaL and SkyRL ship it. The loss is ``core.peer_losses``'s ``sapo``;
this file is the method: its ``sapo:`` settings and its preset (``grpo`` aggregation, as the
paper, verl and TRL).
"""

from __future__ import annotations

from maxent_grpo.core.peer_losses import SapoParams
from maxent_grpo.methods.registry import register_policy_loss_method

# The sapo: section is SapoParams's fields and defaults (core/peer_losses.py), with help on each.
SapoConfig = register_policy_loss_method("sapo", SapoParams, {
    "tau_pos": "SAPO gate temperature for tokens with A > 0",
    "tau_neg": "SAPO gate temperature for tokens with A <= 0 (the paper keeps it above tau_pos)",
},
    "SAPO: a soft sigmoid gate on the ratio in place of the clip, temperature by the sign of A",
    loss_type="grpo", module=__name__)
