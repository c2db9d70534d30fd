"""Group-advantage methods: the policy term is a per-token surrogate on ``A_i`` (ALGORITHMS.md §2-3, §6-7).

They differ in their preset (aggregation, clipping, reward scaling) and in the
policy loss (the PPO clipped surrogate, or CISPO's truncated importance weight). GSPO and LUSPO
take one ratio per sequence; LUSPO sums each sequence's loss over its tokens.
SEED-GRPO, which scales the advantages by semantic entropy, is in ``seed_grpo.py``.
"""

from __future__ import annotations

import dataclasses

from maxent_grpo.methods.registry import Method, register

register(Method(
    "grpo", "grpo", "GRPO (DeepSeekMath): group-normalised advantages, per-sequence token means",
    preset={"loss.loss_type": "grpo"},
))
register(Method(
    "dr_grpo", "grpo", "Dr.GRPO: mean-centred advantages, constant normaliser (num_sequences x L_max)",
    preset={"loss.loss_type": "dr_grpo", "loss.scale_rewards": "none"},
))
register(Method(
    "dapo", "grpo", "DAPO: token-level mean, asymmetric clip 0.2/0.28, dynamic sampling",
    preset={"loss.loss_type": "dapo", "loss.epsilon_high": 0.28, "loss.dynamic_sampling": True},
))
register(Method(
    "gspo", "grpo", "GSPO: sequence-level importance ratio with a narrow clip",
    preset={"loss.importance_sampling_level": "sequence", "loss.epsilon": 3e-4, "loss.epsilon_high": 4e-4},
))
register(Method(
    # LUSPO (arXiv 2602.05261; ALGORITHMS.md §21): GSPO's ratio and clip, each sequence's loss summed over its
    # tokens (loss.loss_type: luspo), so a long sequence weighs in proportion to its length.
    "luspo", "grpo", "LUSPO: GSPO's sequence ratio and clip, per-sequence sums averaged over sequences",
    preset={"loss.loss_type": "luspo", "loss.importance_sampling_level": "sequence", "loss.epsilon": 3e-4,
            "loss.epsilon_high": 4e-4},
))
register(Method(
    # MiniMax-M1 / ScaleRL: the IS weight min(r, eps_max) is clipped and detached, so every
    # token keeps its gradient; TRL, verl and EasyDeL use epsilon_high = 5 as eps_max.
    "cispo", "grpo", "CISPO: -sg(min(r, epsilon_high)) * A * log pi, token-level mean",
    preset={"loss.loss_type": "dapo", "loss.epsilon_high": 5.0},
    loss=lambda inputs: dataclasses.replace(inputs.loss, policy_loss="cispo"),
))
register(Method(
    "maxent_entropy", "maxent", "Token-MaxEnt: GRPO plus a token-entropy bonus (loss.entropy_coef)",
    preset={"loss.entropy_coef": 0.01},
))
