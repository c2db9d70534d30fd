"""MaxEnt listwise (ALGORITHMS.md §4): each group's completions get target weights
``w ∝ q^{1/(tau+beta)} * pi_ref^{beta/(tau+beta)}`` and the policy matches them with a
listwise cross-entropy or a weighted MLE over length-normalised sequence scores.

The reference (beta) acts inside the weights, so the token loss has no KL term;
groups whose rewards all agree train nothing unless ``maxent.keep_zero_variance_groups``.
"""

from __future__ import annotations

import dataclasses

import torch

from maxent_grpo.methods.registry import Method, MethodTargets, PlanInputs, TargetInputs, register
from maxent_grpo.rewards.maxent import ReferenceLogprobs, compute_weight_stats


def _targets(inputs: PlanInputs):
    keep_all = inputs.maxent.keep_zero_variance_groups

    def listwise_targets(batch: TargetInputs) -> MethodTargets:
        rc = batch.reward_comp
        active = torch.ones_like(rc.zero_std) if keep_all else ~rc.zero_std
        ref = None
        if batch.ref_logp_sum is not None:
            ref = ReferenceLogprobs(ref_logp_sum=batch.ref_logp_sum, ref_tok_counts=batch.lengths)
        return MethodTargets(weight_stats=compute_weight_stats(rc, ref, batch.weighting, active),
                             listwise_active=active)

    return listwise_targets


def _check(inputs: PlanInputs) -> list[tuple[str, str]]:
    g, mb = inputs.num_generations, inputs.micro_batch_size
    if mb % g:
        return [("training.micro_batch_size", f"{mb} is not a multiple of generation.num_generations={g} "
                 "(listwise losses need whole groups per micro-batch)")]
    return []


def _loss(inputs: PlanInputs):
    m = inputs.maxent
    name = "listwise_cross_entropy" if m.listwise_loss == "cross_entropy" else "listwise_weighted_mle"
    return dataclasses.replace(inputs.loss, policy_loss=name, listwise_clip_coef=m.listwise_clip_coef)


register(Method(
    "maxent_listwise", "maxent", "MaxEnt listwise: target weights from q and the reference, matched per group",
    loss=_loss, weighting="listwise", kl_in_token_loss=False, check=_check, targets=_targets,
))
