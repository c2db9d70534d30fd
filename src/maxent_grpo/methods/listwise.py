"""MaxEnt listwise (ALGORITHMS.md §4): each group's completions get target weights
``w ∝ q^{1/(tau+beta)} * pi_ref^{beta/(tau+beta)}`` and the policy matches them with a
listwise cross-entropy or a weighted MLE over length-normalised sequence scores.

The reference (beta) acts inside the weights, so the token loss has no KL term;
groups whose rewards all agree train nothing unless ``maxent.keep_zero_variance_groups``.
"""

from __future__ import annotations

import torch

from maxent_grpo.methods.registry import Method, MethodTargets, TargetInputs, register
from maxent_grpo.rewards.maxent import ReferenceLogprobs, compute_weight_stats


def listwise_targets(inputs: TargetInputs) -> MethodTargets:
    rc = inputs.reward_comp
    active = torch.ones_like(rc.zero_std) if inputs.cfg.maxent.keep_zero_variance_groups else ~rc.zero_std
    ref = None
    if inputs.ref_logp_sum is not None:
        ref = ReferenceLogprobs(ref_logp_sum=inputs.ref_logp_sum, ref_tok_counts=inputs.lengths)
    return MethodTargets(weight_stats=compute_weight_stats(rc, ref, inputs.weighting, active), listwise_active=active)


def _check(cfg) -> list[tuple[str, str]]:
    g, mb = cfg.generation.num_generations, cfg.training.micro_batch_size
    if mb % g:
        return [("training.micro_batch_size", f"{mb} is not a multiple of generation.num_generations={g} "
                 "(listwise losses need whole groups per micro-batch)")]
    return []


def _policy_loss(cfg) -> str:
    return "listwise_cross_entropy" if cfg.maxent.listwise_loss == "cross_entropy" else "listwise_weighted_mle"


register(Method(
    "maxent_listwise", "maxent", "MaxEnt listwise: target weights from q and the reference, matched per group",
    policy_loss=_policy_loss, weighting="listwise", kl_in_token_loss=False, check=_check, targets=listwise_targets,
))
