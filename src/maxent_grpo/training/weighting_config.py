"""Map the run config onto the MaxEnt weighting and controller settings.

The core's settings records check their own bounds; :func:`weighting_from_config`
builds them, and ``config.validate`` calls it before any model loads, so each bound
is written once and a violation names the config key the user wrote.
"""

from __future__ import annotations

import re

from maxent_grpo.errors import ConfigError
from maxent_grpo.rewards.maxent import (
    ControllerMetaSettings,
    KlControllerSettings,
    QDistributionSettings,
    TauSchedule,
    WeightingSettings,
    WeightNormalizationSettings,
)
from maxent_grpo.training.config_schema import TrainConfig

# The field names the records use in their errors -> the config keys they come from.
_KEYS = {
    "tau": "maxent.tau",
    "beta": "loss.beta",
    "scale_rewards": "loss.scale_rewards",
    "q_distribution.temperature": "maxent.q_temperature",
    "q_distribution.epsilon": "maxent.q_epsilon",
    **{f"tau_schedule.{f}": f"maxent.tau_{k}" for f, k in (
        ("target_entropy", "target_entropy"), ("target_final", "target_final"), ("horizon", "target_horizon"),
        ("lr", "lr"), ("min", "min"), ("max", "max"), ("warmup_steps", "warmup_steps"))},
    **{f"kl_controller.{f}": f"maxent.kl_{f}" for f in ("target", "horizon", "step_size")},
    **{f"controller_meta.{f}": f"maxent.meta_{f}" for f in ("lr_tau", "lr_beta", "every", "grad_clip")},
}
_FIELD = re.compile(r"(?<![\w.])(" + "|".join(sorted(map(re.escape, _KEYS), key=len, reverse=True)) + r")(?![\w.])")


def weighting_from_config(cfg: TrainConfig) -> WeightingSettings:
    """The run's :class:`WeightingSettings`; a bad value raises :class:`ConfigError` naming its key."""
    try:
        return _build(cfg)
    except ValueError as exc:
        message = str(exc)
        first = _FIELD.match(message)
        if first is None:
            raise  # not a bound the user set: a bug, keep the traceback
        rest = _FIELD.sub(lambda m: _KEYS[m.group(1)], message[first.end():]).strip()
        raise ConfigError(f"{_KEYS[first.group(1)]}: {rest}") from None


def _build(cfg: TrainConfig) -> WeightingSettings:
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
        controller_meta=ControllerMetaSettings(lr_tau=m.meta_lr_tau, lr_beta=m.meta_lr_beta, every=m.meta_every,
                                               grad_clip=m.meta_grad_clip),
        scale_rewards=cfg.loss.scale_rewards,
    )
