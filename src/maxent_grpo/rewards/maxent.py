"""MaxEnt-GRPO reward statistics, listwise weights and controllers: the public face.

The names follow the seed page ``maxent_grpo.rewards.maxent``. They are
defined next door and re-exported here, so callers import from one place:

- :mod:`maxent_grpo.rewards.weighting_settings`: ``WeightingSettings`` and its
  settings records;
- :mod:`maxent_grpo.rewards.reward_stats`: rewards, group advantages, q and SEED
  scales (``RewardComputation``);
- :mod:`maxent_grpo.rewards.weight_stats`: listwise weights and their entropy
  diagnostics (``WeightStats``).

This module itself holds the controller steps that update a
``WeightingSettings`` in place, and their save / load / broadcast. The
arithmetic lives in ``maxent_grpo.core`` and is not repeated anywhere here.
"""

from __future__ import annotations


from maxent_grpo.core import controllers as ctl
from maxent_grpo.rollout.backend import GenerationBackend, RolloutBatch, SamplingParams, generate_groups
from maxent_grpo.core.controllers import (
    ControllerMetaSettings,
    ControllerState,
    KlControllerSettings,
    TauSchedule,
)
from maxent_grpo.rewards.reward_stats import (
    RewardComputation,
    RewardStatsSettings,
    SeedGrpoInputs,
    apply_policy_entropy_bonus,
    compute_reward_statistics,
    compute_reward_totals,
    group_advantages,
    reward_moments,
)
from maxent_grpo.rewards.weight_stats import (
    ReferenceLogprobs,
    WeightLoggingView,
    WeightStats,
    build_uniform_weight_stats,
    collect_weight_entropy,
    compute_weight_stats,
    split_reference_logprobs,
    split_reference_token_counts,
    weight_matrix_from_q,
    weight_vector_from_q,
)
from maxent_grpo.rewards.weighting_settings import (
    QDistributionSettings,
    WeightingSettings,
    WeightNormalizationSettings,
)

__all__ = [
    "WeightNormalizationSettings",
    "QDistributionSettings",
    "TauSchedule",
    "KlControllerSettings",
    "ControllerMetaSettings",
    "ControllerState",
    "WeightingSettings",
    "ReferenceLogprobs",
    "SeedGrpoInputs",
    "RewardStatsSettings",
    "RewardComputation",
    "WeightStats",
    "WeightLoggingView",
    "compute_reward_statistics",
    "compute_reward_totals",
    "prepare_generation_batch",
    "apply_policy_entropy_bonus",
    "reward_moments",
    "group_advantages",
    "weight_vector_from_q",
    "weight_matrix_from_q",
    "compute_weight_stats",
    "collect_weight_entropy",
    "build_uniform_weight_stats",
    "split_reference_logprobs",
    "split_reference_token_counts",
    "maybe_update_tau",
    "maybe_update_beta",
    "apply_meta_controller_update",
    "controller_state_dict",
    "restore_controller_state",
]



def prepare_generation_batch(
    prompts: list[str],
    backend: GenerationBackend,
    generation_stats: dict[str, int],
    expected_generations: int,
    params: SamplingParams,
    max_retry_rounds: int = 2,
) -> RolloutBatch | None:
    """Generate ``expected_generations`` completions per prompt, re-asking for missing ones (§9).

    Dropped prompts are counted in ``generation_stats["dropped_prompts"]``; returns ``None``
    when no prompt got a complete group.
    """
    batch, dropped = generate_groups(
        backend, prompts, expected_generations, params, max_retry_rounds=max_retry_rounds
    )
    generation_stats["dropped_prompts"] = generation_stats.get("dropped_prompts", 0) + len(dropped)
    return batch if batch.num_prompts else None


def _live_state(cfg: WeightingSettings) -> ControllerState:
    """The controller state with ``cfg.tau`` / ``cfg.beta`` (which callers may have set directly)."""
    return cfg.controller_state.with_params(cfg.tau, cfg.beta)


def _commit(cfg: WeightingSettings, state: ControllerState) -> None:
    cfg.controller_state = state
    cfg.tau = state.tau
    cfg.beta = state.beta


def maybe_update_tau(
    weighting_cfg: WeightingSettings,
    weight_stats: WeightStats | WeightLoggingView,
    global_step: int,
    lr_scale: float | None = None,
) -> None:
    """Tau controller step toward the target weight entropy, in place (no-op when unconfigured or warming up).

    Pass the globally averaged :class:`WeightLoggingView` in multi-process runs.
    """
    if isinstance(weight_stats, WeightStats):
        entropy = weight_stats.weight_entropy
    elif isinstance(weight_stats, WeightLoggingView):
        entropy = weight_stats.entropy
    else:
        raise ValueError(f"weight_stats must be WeightStats or WeightLoggingView, got {type(weight_stats).__name__}")
    state = ctl.update_tau(_live_state(weighting_cfg), entropy, weighting_cfg.tau_schedule, global_step,
                           1.0 if lr_scale is None else lr_scale)
    _commit(weighting_cfg, state)


def maybe_update_beta(weighting_cfg: WeightingSettings, measured_kl: float, global_step: int) -> None:
    """Adaptive-KL beta step after optimizer step ``global_step``, in place (no-op unless target,
    horizon and step size are all > 0)."""
    _commit(weighting_cfg, ctl.update_beta(_live_state(weighting_cfg), measured_kl, weighting_cfg.kl_controller,
                                           global_step))


def apply_meta_controller_update(
    weighting_cfg: WeightingSettings,
    *,
    tau_grad: float | None = None,
    beta_grad: float | None = None,
    lr_scale: float = 1.0,
) -> bool:
    """Meta-controller gradient step on tau / beta, in place; ``True`` when either changed.

    Does nothing (``False``) unless ``controller_meta.enabled``.
    """
    if not weighting_cfg.controller_meta.enabled:
        return False
    before = _live_state(weighting_cfg)
    after = ctl.apply_meta_gradients(before, weighting_cfg.controller_settings, tau_grad=tau_grad,
                                     beta_grad=beta_grad, lr_scale=lr_scale)
    _commit(weighting_cfg, after)
    return (after.tau, after.beta) != (before.tau, before.beta)


def controller_state_dict(weighting_cfg: WeightingSettings) -> dict:
    """JSON-ready snapshot of the controller state."""
    return _live_state(weighting_cfg).to_dict()


def restore_controller_state(weighting_cfg: WeightingSettings, state: dict) -> None:
    """Restore a snapshot made by :func:`controller_state_dict` (a checkpoint's copy) into ``weighting_cfg``."""
    _commit(weighting_cfg, ControllerState.from_dict(state))


