"""GMPO (Geometric-Mean Policy Optimization, arXiv 2507.20673; ALGORITHMS.md §12): the sequence ratio
is the geometric mean of the token ratios, each clipped in log space on the side the advantage
pushes; verl's ``geo_mean``. The loss is ``core.peer_losses``'s ``gmpo`` (defined for ``loss_type:
grpo`` only, the mean over sequences); this file holds the method, its ``gmpo:`` settings (the
wider 0.4 clip of the paper, not PPO's 0.2) and its preset.
"""

from __future__ import annotations

from maxent_grpo.core.peer_losses import GmpoParams
from maxent_grpo.methods.registry import register_policy_loss_method

# The gmpo: section is GmpoParams's fields and defaults (core/peer_losses.py), with help on each.
GmpoConfig = register_policy_loss_method("gmpo", GmpoParams, {
    "eps_low": "GMPO log-ratio clip below (-eps_low), for A < 0",
    "eps_high": "GMPO log-ratio clip above (eps_high), for A > 0",
},
    "GMPO: geometric mean of log-clipped token ratios per sequence, mean over sequences",
    loss_type="grpo", module=__name__)
