"""MaxEnt-GRPO batch statistics: from a batch's rewards to its training signal.

The seed page ``maxent_grpo.rewards.maxent`` names this namespace; the names
below are the code ``maxent-grpo train`` runs, defined in this package's
modules (``docs/SEED_API.md`` lists the seed names that were removed, and why):

- :mod:`.settings`: ``WeightingSettings``, the listwise hyperparameters and the
  live controller state;
- :mod:`.reward_stats`: total rewards, group advantages, the q-distribution and
  SEED scales of one batch (``RewardComputation``);
- :mod:`.weight_stats`: listwise weights and their entropy diagnostics (``WeightStats``);
- :mod:`.controllers`: the tau, beta and meta controller steps (§8), in place.

The formulas are in :mod:`maxent_grpo.core`. This package sits above the reward
functions (``maxent_grpo.rewards.*``), which never import it, and below
``methods`` and ``training``.
"""

from maxent_grpo.core.controllers import ControllerMetaSettings, ControllerState, KlControllerSettings, TauSchedule
from maxent_grpo.rewards.maxent.controllers import (
    apply_meta_controller_update,
    controller_state_dict,
    maybe_update_beta,
    maybe_update_tau,
    restore_controller_state,
    update_controllers,
    weighting_at,
)
from maxent_grpo.rewards.maxent.reward_stats import (
    RewardComputation,
    RewardStatsSettings,
    SeedGrpoInputs,
    apply_policy_entropy_bonus,
    compute_reward_statistics,
    reward_moments,
)
from maxent_grpo.rewards.maxent.settings import MaxEntConfig, QDistributionSettings, WeightingSettings, WeightNormalizationSettings
from maxent_grpo.rewards.maxent.weight_stats import (
    ReferenceLogprobs,
    WeightLoggingView,
    WeightStats,
    collect_weight_entropy,
    compute_weight_stats,
    split_reference_logprobs,
    split_reference_token_counts,
    weight_matrix_from_q,
)

__all__ = [
    "ControllerMetaSettings",
    "ControllerState",
    "KlControllerSettings",
    "MaxEntConfig",
    "QDistributionSettings",
    "ReferenceLogprobs",
    "RewardComputation",
    "RewardStatsSettings",
    "SeedGrpoInputs",
    "TauSchedule",
    "WeightLoggingView",
    "WeightNormalizationSettings",
    "WeightStats",
    "WeightingSettings",
    "apply_meta_controller_update",
    "apply_policy_entropy_bonus",
    "collect_weight_entropy",
    "compute_reward_statistics",
    "compute_weight_stats",
    "controller_state_dict",
    "maybe_update_beta",
    "maybe_update_tau",
    "restore_controller_state",
    "reward_moments",
    "split_reference_logprobs",
    "split_reference_token_counts",
    "update_controllers",
    "weighting_at",
    "weight_matrix_from_q",
]
