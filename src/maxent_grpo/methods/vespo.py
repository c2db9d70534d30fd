"""VESPO (Variational Sequence-Level Soft Policy Optimization, arXiv 2602.10693; ALGORITHMS.md §22): no
clip; a smooth, asymmetric gamma weight of the sequence's importance ratio scales a REINFORCE term,
aggregated like DAPO; TRL 1.16's ``loss_type: vespo``. The loss is ``core/vespo.py``'s ``vespo``;
this file is the method: its ``vespo:`` settings and its preset.
"""

from __future__ import annotations

from maxent_grpo.core.vespo import VespoParams
from maxent_grpo.methods.registry import register_policy_loss_method

# The vespo: section is VespoParams's fields and defaults (core/peer_losses.py), with help on each.
VespoConfig = register_policy_loss_method("vespo", VespoParams, {
    "k_pos": "VESPO gamma shape k for sequences with A >= 0 (TRL vespo_k_pos)",
    "lambda_pos": "VESPO gamma rate lambda for sequences with A >= 0 (TRL vespo_lambda_pos)",
    "k_neg": "VESPO gamma shape k for sequences with A < 0 (TRL vespo_k_neg)",
    "lambda_neg": "VESPO gamma rate lambda for sequences with A < 0 (TRL vespo_lambda_neg)",
},
    "VESPO: -phi(w) * A * log pi, phi a gamma weight of the sequence ratio, no clip, token-level mean",
    loss_type="dapo", module=__name__)
