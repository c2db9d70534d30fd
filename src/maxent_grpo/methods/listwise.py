"""MaxEnt listwise (ALGORITHMS.md §4): each group's completions get target weights
``w ∝ q^{1/(tau+beta)} * pi_ref^{beta/(tau+beta)}`` and the policy matches them with a
listwise cross-entropy, a weighted MLE or a centred weighted MLE over sequence scores
(mean token log-probs, or their sums). With ``maxent.zero_weight_unrewarded`` the weights
cover only the completions with a positive reward.

The reference (beta) acts inside the weights, so the token loss has no KL term;
groups whose rewards all agree train nothing unless ``maxent.keep_zero_variance_groups``.
"""

from __future__ import annotations

import dataclasses

import torch

from maxent_grpo.core.listwise import ListwiseParams
from maxent_grpo.methods.registry import Method, MethodTargets, PlanInputs, TargetInputs, register
from maxent_grpo.rewards.maxent import ReferenceLogprobs, compute_weight_stats


def _targets(inputs: PlanInputs):
    keep_all = inputs.maxent.keep_zero_variance_groups
    rewarded_only = inputs.maxent.zero_weight_unrewarded

    def listwise_targets(batch: TargetInputs) -> MethodTargets:
        rc = batch.reward_comp
        active = torch.ones_like(rc.zero_std) if keep_all else ~rc.zero_std
        support = None
        if rewarded_only:
            support = (rc.total > 0).view(-1, rc.num_generations)  # NaN (no reward) is not > 0
            active = active & support.any(-1)
        ref = None
        if batch.ref_logp_sum is not None:
            ref = ReferenceLogprobs(ref_logp_sum=batch.ref_logp_sum, ref_tok_counts=batch.lengths)
        return MethodTargets(weight_stats=compute_weight_stats(rc, ref, batch.weighting, active, support),
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
    params = ListwiseParams(score=m.listwise_score, clip_coef=m.listwise_clip_coef)
    return dataclasses.replace(inputs.loss, policy_loss=f"listwise_{m.listwise_loss}", policy_params=params)


register(Method(
    "maxent_listwise", "maxent", "MaxEnt listwise: target weights from q and the reference, matched per group",
    loss=_loss, weighting="listwise", kl_in_token_loss=False, check=_check, targets=_targets,
    collapse_advice=("maxent.listwise_loss=centered_mle (the default: pushes completions weighted below uniform "
                     "down), maxent.zero_weight_unrewarded=true, or a lower training.learning_rate"),
))
