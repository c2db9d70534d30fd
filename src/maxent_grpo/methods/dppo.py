"""DPPO (Divergence PPO, arXiv 2602.04879; ALGORITHMS.md §13): instead of clipping the ratio, a token
is masked when its probability moved past a threshold in the direction of its advantage (Binary-TV
``p - p_anchor``, or the binary KL); verl's ``dppo_tv`` / ``dppo_kl`` and prime-rl's default loss.
The loss is ``core.peer_losses``'s ``dppo``; this file is the method: its ``dppo:`` settings and
its preset (token-level mean, as verl and prime-rl).
"""

from __future__ import annotations

from maxent_grpo.core.peer_losses import DppoParams
from maxent_grpo.methods.registry import register_policy_loss_method

# The dppo: section is DppoParams's fields and defaults (core/peer_losses.py), with help on each.
DppoConfig = register_policy_loss_method("dppo", DppoParams, {
    "divergence": "trust region: tv (probability difference) or binary_kl (use thresholds near 0.05)",
    "delta_low": "DPPO threshold for tokens with A <= 0",
    "delta_high": "DPPO threshold for tokens with A > 0",
    "anchor": "probabilities the move is measured from: old (the trainer's) or behaviour (the sampler's)",
    "ratio_cap": "cap C on the detached ratio weight min(r, C) (null: loss.delta, else none)",
},
    "DPPO: tokens whose probability moved past a threshold along A are masked, no ratio clip",
    loss_type="dapo", module=__name__)
