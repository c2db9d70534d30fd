"""xDr (ALGORITHMS.md §5): Dr.GRPO plus a tempered group aggregation. Each completion's
token term is multiplied by ``G * softmax(U / tau)`` within its group, ``U_i = A_i T_i / L_max``
(frozen at the rollout policy); mode-adaptive xDr divides tau by ``ln(1 + kappa)``, kappa
the number of distinct best answers in the group (a ModeBench row's
answers compared by mode key). The preset is Dr.GRPO's, as published.
"""

from __future__ import annotations

import torch

from maxent_grpo.core.logprobs import per_token_logp
from maxent_grpo.core.weighting import mode_adaptive_tau, xdr_multipliers, xdr_utilities
from maxent_grpo.methods.registry import Method, MethodTargets, TargetInputs, register


def distinct_best_answers(keys: list[str | None], total: torch.Tensor, g: int) -> torch.Tensor:
    """``[P]`` kappa: distinct answer keys among each group's top-reward completions (top > 0)."""
    grouped = total.view(-1, g)
    best = grouped.max(dim=1).values
    kappa = [
        len({keys[p * g + i] for i in range(g) if best[p] > 0 and grouped[p, i] == best[p]} - {None})
        for p in range(grouped.shape[0])
    ]
    return torch.tensor(kappa, dtype=torch.float64)


def xdr_targets(inputs: TargetInputs) -> MethodTargets:
    cfg, g = inputs.cfg, inputs.num_generations
    rc = inputs.reward_comp
    lengths = inputs.lengths.view(-1, g)
    util = xdr_utilities(rc.advantages.view(-1, g), lengths, cfg.generation.max_new_tokens)
    tau: float | torch.Tensor = cfg.xdr.tau
    if cfg.xdr.mode_adaptive:
        tau = mode_adaptive_tau(cfg.xdr.tau, distinct_best_answers(inputs.answer_keys, rc.total, g))
    ref_seq = None
    if inputs.ref_logp_sum is not None and cfg.xdr.lam > 0:
        ref_seq = per_token_logp(inputs.ref_logp_sum, inputs.lengths).view(-1, g)
    weights = xdr_multipliers(util, lengths > 0, tau, lam=cfg.xdr.lam, ref_logp=ref_seq)
    return MethodTargets(row_weights=weights.reshape(-1))


register(Method(
    "xdr", "maxent", "xDr: Dr.GRPO with per-row multipliers G * softmax(U / tau) in each group",
    preset={"loss.loss_type": "dr_grpo", "loss.scale_rewards": "none"},
    weighting="xdr", targets=xdr_targets,
    needs_reference=lambda cfg: cfg.loss.beta > 0 or cfg.xdr.lam > 0,
))
