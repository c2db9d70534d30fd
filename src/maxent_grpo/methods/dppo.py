"""DPPO (Divergence PPO, arXiv 2602.04879; ALGORITHMS.md §13): instead of clipping the ratio,
a token is masked when its probability moved past a threshold in the direction of its
advantage (Binary-TV ``p - p_anchor``, or the binary KL); verl's ``dppo_tv`` / ``dppo_kl``
and prime-rl's default loss. The loss is ``core.peer_losses``'s ``dppo``; this file holds the
method, its ``dppo:`` settings and its preset (token-level mean, as verl and prime-rl).
"""

from __future__ import annotations

import dataclasses

from maxent_grpo.core.peer_losses import DppoParams
from maxent_grpo.methods.registry import Method, PlanInputs, register, section_of


# The dppo: section is DppoParams's fields and defaults (core/peer_losses.py), with help on each.
DppoConfig = section_of(DppoParams, "DppoConfig", {
    "divergence": "trust region: tv (probability difference) or binary_kl (use thresholds near 0.05)",
    "delta_low": "DPPO threshold for tokens with A <= 0",
    "delta_high": "DPPO threshold for tokens with A > 0",
    "anchor": "probabilities the move is measured from: old (the trainer's) or behaviour (the sampler's)",
    "ratio_cap": "cap C on the detached ratio weight min(r, C) (null: loss.delta, else none)",
}, __name__)


def _loss(inputs: PlanInputs):
    params = DppoParams(**dataclasses.asdict(inputs.settings))
    return dataclasses.replace(inputs.loss, policy_loss="dppo", policy_params=params)


register(Method(
    "dppo", "grpo", "DPPO: tokens whose probability moved past a threshold along A are masked, no ratio clip",
    preset={"loss.loss_type": "dapo"}, section="dppo", settings=DppoConfig, loss=_loss,
))
