"""Map the run config onto the MaxEnt weighting and controller settings."""

from __future__ import annotations

from maxent_grpo.rewards.maxent import (
    ControllerMetaSettings,
    KlControllerSettings,
    QDistributionSettings,
    TauSchedule,
    WeightingSettings,
    WeightNormalizationSettings,
)
from maxent_grpo.training.config import TrainConfig


def weighting_from_config(cfg: TrainConfig) -> WeightingSettings:
    m = cfg.maxent
    return WeightingSettings(
        tau=m.tau,
        beta=cfg.loss.beta,
        normalization=WeightNormalizationSettings(len_norm_ref=m.length_normalize_ref),
        q_distribution=QDistributionSettings(temperature=m.q_temperature, epsilon=m.q_epsilon),
        tau_schedule=TauSchedule(
            target_entropy=m.tau_target_entropy,
            target_final=m.tau_target_final,
            horizon=m.tau_target_horizon,
            lr=m.tau_lr,
            min=m.tau_min,
            max=m.tau_max,
            warmup_steps=m.tau_warmup_steps,
        ),
        kl_controller=KlControllerSettings(target=m.kl_target, horizon=m.kl_horizon, step_size=m.kl_step_size),
        controller_meta=ControllerMetaSettings(),
        scale_rewards=cfg.loss.scale_rewards,
    )
