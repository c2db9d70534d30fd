"""The controller steps of ALGORITHMS.md §8 on a :class:`WeightingSettings`, in place (the seed's API).

The formulas are pure functions in :mod:`maxent_grpo.core.controllers`, which return a new
:class:`ControllerState`; this module is a thin layer that applies them to a ``WeightingSettings``
(its ``tau`` / ``beta`` and ``controller_state``) and snapshots / restores that state. The run
itself holds the state as a value (``TrainState.controllers``, stepped by
``core.controllers.step_controllers``) and builds the step's ``WeightingSettings`` from it.
"""

from __future__ import annotations

from dataclasses import replace

from maxent_grpo.core import controllers as ctl
from maxent_grpo.core.controllers import ControllerState
from maxent_grpo.rewards.maxent.settings import WeightingSettings
from maxent_grpo.rewards.maxent.weight_stats import WeightLoggingView, WeightStats


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
    step: int | None = None,
) -> bool:
    """Meta-controller gradient step on tau / beta (at optimizer step ``step``), in place;
    ``True`` when either changed. Does nothing (``False``) unless the meta controller is on.
    """
    if not weighting_cfg.controller_meta.enabled:
        return False
    before = _live_state(weighting_cfg)
    after = ctl.apply_meta_gradients(before, weighting_cfg.controller_settings, tau_grad=tau_grad,
                                     beta_grad=beta_grad, lr_scale=lr_scale, step=step)
    _commit(weighting_cfg, after)
    return (after.tau, after.beta) != (before.tau, before.beta)


def update_controllers(
    weighting_cfg: WeightingSettings, weights: WeightLoggingView | None, measured_kl: float | None, step: int
) -> None:
    """All of §8 after optimizer step ``step``, in place (``core.controllers.step_controllers``): the
    meta controller every ``controller_meta.every`` steps when it is on, else the tau then the beta
    controller.

    ``weights`` (None without listwise weights) and ``measured_kl`` (None without a KL
    term) must already be averaged over every process.
    """
    entropy = None if weights is None else weights.entropy
    _commit(weighting_cfg, ctl.step_controllers(_live_state(weighting_cfg), weighting_cfg.controller_settings,
                                                entropy, measured_kl, step))


def weighting_at(settings: WeightingSettings, state: ControllerState) -> WeightingSettings:
    """``settings`` with the controllers' ``state`` (its tau and beta live): the step's record for the
    methods' targets, made from the run's ``TrainState.controllers`` (``settings`` is not changed)."""
    return replace(settings, tau=state.tau, beta=state.beta, controller_state=state)


def controller_state_dict(weighting_cfg: WeightingSettings) -> dict:
    """JSON-ready snapshot of the controller state."""
    return _live_state(weighting_cfg).to_dict()


def restore_controller_state(weighting_cfg: WeightingSettings, state: dict) -> None:
    """Restore a snapshot made by :func:`controller_state_dict` (a checkpoint's copy) into ``weighting_cfg``."""
    _commit(weighting_cfg, ControllerState.from_dict(state))


