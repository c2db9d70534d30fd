"""SEED-GRPO (ALGORITHMS.md §7): each group's advantages are scaled by its semantic entropy,
the entropy of the sampler's probability mass over the group's distinct answers.

The method's whole difference is here: its settings section (``seed_grpo:``) and the hook
that builds the reward statistics' SEED inputs from a batch (answer clusters and the
sampler's sequence log-probs).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from maxent_grpo.core.seed_grpo import cluster_ids_from_answers
from maxent_grpo.methods.registry import Method, PlanInputs, RewardScalingInputs, register
from maxent_grpo.rewards.maxent import SeedGrpoInputs


@dataclass
class SeedGrpoConfig:
    alpha: float = field(default=0.0417, metadata={"help": "strength of the semantic-entropy scaling of the advantages"})
    normalize_by_max_entropy: bool = field(
        default=True, metadata={"help": "divide the group's entropy by its maximum, log G"})
    length_normalize_logprobs: bool = field(
        default=True, metadata={"help": "use per-token mean log-probs for each completion's probability"})


def _check(inputs: PlanInputs) -> list[tuple[str, str]]:
    return [] if inputs.settings.alpha >= 0 else [("seed_grpo.alpha", f"must be >= 0, got {inputs.settings.alpha}")]


def _scaling(inputs: PlanInputs):
    s: SeedGrpoConfig = inputs.settings

    def seed_inputs(batch: RewardScalingInputs) -> SeedGrpoInputs:
        if batch.behaviour_logps is None:
            raise ValueError("the generator returned no behaviour log-probs")
        g, keys = batch.num_generations, batch.answer_keys
        return SeedGrpoInputs(
            cluster_ids=cluster_ids_from_answers([keys[i : i + g] for i in range(0, len(keys), g)]).reshape(-1),
            seq_logps=(batch.behaviour_logps * batch.completion_mask).sum(1).cpu(),
            token_counts=batch.completion_mask.sum(1).cpu(),
            alpha=s.alpha, normalize_by_max_entropy=s.normalize_by_max_entropy,
            length_normalize=s.length_normalize_logprobs,
        )

    return seed_inputs


register(Method(
    "seed_grpo", "grpo", "SEED-GRPO: advantages scaled by the group's semantic entropy",
    preset={"loss.loss_type": "dapo"}, section="seed_grpo", settings=SeedGrpoConfig,
    check=_check, reward_scaling=_scaling,
))
