"""GMPO (Geometric-Mean Policy Optimization, arXiv 2507.20673; ALGORITHMS.md §12): the
sequence ratio is the geometric mean of the token ratios, each clipped in log space on the
side the advantage pushes; verl's ``geo_mean``. The loss is ``core.peer_losses``'s ``gmpo``
(defined for ``loss_type: grpo`` only, the mean over sequences); this file holds the method,
its ``gmpo:`` settings (the wider 0.4 clip of the paper, not PPO's 0.2) and its preset.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

from maxent_grpo.core.peer_losses import GmpoParams
from maxent_grpo.methods.registry import Method, PlanInputs, register


@dataclass
class GmpoConfig:
    eps_low: float = field(default=0.4, metadata={"help": "GMPO log-ratio clip below (-eps_low), for A < 0"})
    eps_high: float = field(default=0.4, metadata={"help": "GMPO log-ratio clip above (eps_high), for A > 0"})


def _loss(inputs: PlanInputs):
    s: GmpoConfig = inputs.settings
    return dataclasses.replace(inputs.loss, policy_loss="gmpo", policy_params=GmpoParams(s.eps_low, s.eps_high))


register(Method(
    "gmpo", "grpo", "GMPO: geometric mean of log-clipped token ratios per sequence, mean over sequences",
    preset={"loss.loss_type": "grpo"}, section="gmpo", settings=GmpoConfig, loss=_loss,
))
