"""xDr (ALGORITHMS.md §5): Dr.GRPO plus a tempered group aggregation. Each completion's
token term is multiplied by ``G * softmax(U / tau)`` within its group, ``U_i = A_i T_i / L_max``
(frozen at the rollout policy); mode-adaptive xDr divides tau by ``ln(1 + kappa)``, kappa
the number of distinct best answers in the group (a ModeBench row's
answers compared by mode key). The preset is Dr.GRPO's, as published.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from maxent_grpo.core.logprobs import per_token_logp
from maxent_grpo.core.weighting import mode_adaptive_tau, xdr_multipliers, xdr_utilities
from maxent_grpo.methods.registry import Method, MethodTargets, PlanInputs, TargetInputs, register


def distinct_best_answers(keys: list[str | None], total: torch.Tensor, g: int) -> torch.Tensor:
    """``[P]`` kappa: distinct answer keys among each group's top-reward completions (top > 0)."""
    grouped = total.view(-1, g)
    best = grouped.max(dim=1).values
    kappa = [
        len({keys[p * g + i] for i in range(g) if best[p] > 0 and grouped[p, i] == best[p]} - {None})
        for p in range(grouped.shape[0])
    ]
    return torch.tensor(kappa, dtype=torch.float64)


@dataclass
class XdrConfig:
    tau: float = field(default=0.05, metadata={
        "help": "temperature of the group softmax over U_i = A_i T_i / L_max (the paper's best; >= 0.5 is null there; .inf: no reweighting)"})
    lam: float = field(default=0.0, metadata={"help": "weight of the reference log-prob in the utilities (needs a reference)"})
    mode_adaptive: bool = field(default=False, metadata={
        "help": "divide tau by ln(1 + kappa), kappa the distinct best answers in the group"})


def _check(inputs: PlanInputs) -> list[tuple[str, str]]:
    s = inputs.settings
    out = []
    if not s.tau >= 0:
        out.append(("xdr.tau", f"must be >= 0 (use .inf for no reweighting), got {s.tau}"))
    if not s.lam >= 0:
        out.append(("xdr.lam", f"must be >= 0, got {s.lam}"))
    return out


def _targets(inputs: PlanInputs):
    s: XdrConfig = inputs.settings
    max_new_tokens = inputs.max_new_tokens

    def xdr_targets(batch: TargetInputs) -> MethodTargets:
        g, rc = batch.num_generations, batch.reward_comp
        lengths = batch.lengths.view(-1, g)
        util = xdr_utilities(rc.advantages.view(-1, g), lengths, max_new_tokens)
        tau: float | torch.Tensor = s.tau
        if s.mode_adaptive:
            tau = mode_adaptive_tau(s.tau, distinct_best_answers(batch.answer_keys, rc.total, g))
        ref_seq = None
        if batch.ref_logp_sum is not None and s.lam > 0:
            ref_seq = per_token_logp(batch.ref_logp_sum, batch.lengths).view(-1, g)
        weights = xdr_multipliers(util, lengths > 0, tau, lam=s.lam, ref_logp=ref_seq)
        return MethodTargets(row_weights=weights.reshape(-1))

    return xdr_targets


register(Method(
    "xdr", "maxent", "xDr: Dr.GRPO with per-row multipliers G * softmax(U / tau) in each group",
    preset={"loss.loss_type": "dr_grpo", "loss.scale_rewards": "none"},
    section="xdr", settings=XdrConfig, weighting="xdr", targets=_targets, check=_check,
    needs_reference=lambda inputs: inputs.loss.beta > 0 or inputs.settings.lam > 0,
))
