"""Tau, beta and meta controllers and their state (ALGORITHMS.md §8).

The update functions are pure: they take a :class:`ControllerState` and return
a new one. They run once per optimizer step on inputs already averaged over
every process (``training.metrics.summarize_weight_stats``), so every rank
computes the same state. ``step`` is the number of completed optimizer steps
(1 after the first). The state is saved in each checkpoint's trainer state
(``to_dict`` / ``from_dict``); this module does no I/O and no communication.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, replace
from typing import Any

from maxent_grpo.core.bounds import require

__all__ = [
    "TAU_ENTROPY_EMA_DECAY",
    "TauSchedule",
    "KlControllerSettings",
    "ControllerMetaSettings",
    "ControllerSettings",
    "ControllerState",
    "target_entropy_at",
    "update_tau",
    "update_beta",
    "apply_meta_gradients",
    "meta_gradients",
]

# Hbar <- 0.9 * Hbar + 0.1 * H: per-batch weight entropy is noisy.
TAU_ENTROPY_EMA_DECAY = 0.9


def _finite(name: str, value: float) -> None:
    if not math.isfinite(value):
        raise ValueError(f"{name} must be finite, got {value}")


def _clamp_bounds(value: float, lo: float, hi: float) -> float:
    """Clamp to ``[lo, hi]``; a bound ``<= 0`` means that side is unbounded."""
    if hi > 0:
        value = min(value, hi)
    if lo > 0:
        value = max(value, lo)
    return value


def _log(tau: float) -> float:
    return math.log(tau) if tau > 0 else -math.inf


@dataclass(frozen=True)
class TauSchedule:
    """Tau controller toward a target weight entropy ``H*`` (nats); ``target_entropy=None`` disables it.

    ``H*`` goes linearly from ``target_entropy`` (step 0) to ``target_final``
    (step ``horizon``) when both ``target_final`` and ``horizon > 0`` are set.
    ``min`` / ``max`` bound tau; a bound ``<= 0`` means unbounded. Updates are
    skipped while ``step <= warmup_steps``.
    """

    target_entropy: float | None = None
    target_final: float | None = None
    horizon: int = 0
    lr: float = 0.0
    min: float = 0.0
    max: float = 0.0
    warmup_steps: int = 0

    def __post_init__(self) -> None:
        for name, value in (("target_entropy", self.target_entropy), ("target_final", self.target_final)):
            require(value is None or math.isfinite(value), f"tau_schedule.{name}", f"must be finite, got {value}")
        require(self.target_final is None or self.target_entropy is not None, "tau_schedule.target_final",
                "needs a start value, the target entropy")
        require(self.horizon >= 0, "tau_schedule.horizon", f"must be >= 0, got {self.horizon}")
        require(math.isfinite(self.lr) and self.lr >= 0, "tau_schedule.lr", f"must be a finite number >= 0, got {self.lr}")
        require(math.isfinite(self.min), "tau_schedule.min", f"must be finite, got {self.min}")
        require(math.isfinite(self.max), "tau_schedule.max", f"must be finite, got {self.max}")
        require(self.min <= 0 or self.max <= 0 or self.min <= self.max, "tau_schedule.min",
                f"must be <= the maximum, got {self.min} > {self.max}")
        require(self.warmup_steps >= 0, "tau_schedule.warmup_steps", f"must be >= 0, got {self.warmup_steps}")

    @property
    def enabled(self) -> bool:
        return self.target_entropy is not None and self.lr > 0


@dataclass(frozen=True)
class KlControllerSettings:
    """Adaptive-KL beta controller toward ``target``; off unless target, horizon and step_size are all > 0."""

    target: float = 0.0
    horizon: int = 0
    step_size: float = 0.0

    def __post_init__(self) -> None:
        require(math.isfinite(self.target), "kl_controller.target", f"must be finite, got {self.target}")
        require(math.isfinite(self.step_size), "kl_controller.step_size", f"must be finite, got {self.step_size}")

    @property
    def enabled(self) -> bool:
        return self.target > 0 and self.horizon > 0 and self.step_size > 0


@dataclass(frozen=True)
class ControllerMetaSettings:
    """Analytic meta-controller: gradient steps on tau and beta every ``every`` steps.

    On when either learning rate is > 0; it then replaces the tau and beta controllers.
    ``grad_clip`` bounds the KL error in the beta step (``<= 0``: unclipped);
    the tau step is not clipped, as in the spec.
    """

    lr_tau: float = 0.0
    lr_beta: float = 0.0
    every: int = 1
    grad_clip: float = 0.0

    def __post_init__(self) -> None:
        for name, value in (("lr_tau", self.lr_tau), ("lr_beta", self.lr_beta)):
            require(math.isfinite(value) and value >= 0, f"controller_meta.{name}",
                    f"must be a finite number >= 0, got {value}")
        require(self.every >= 1, "controller_meta.every", f"must be >= 1, got {self.every}")
        require(math.isfinite(self.grad_clip), "controller_meta.grad_clip", f"must be finite, got {self.grad_clip}")

    @property
    def enabled(self) -> bool:
        return self.lr_tau > 0 or self.lr_beta > 0


@dataclass(frozen=True)
class ControllerSettings:
    """All controller settings together (what :func:`apply_meta_gradients` needs)."""

    tau_schedule: TauSchedule = field(default_factory=TauSchedule)
    kl_controller: KlControllerSettings = field(default_factory=KlControllerSettings)
    meta: ControllerMetaSettings = field(default_factory=ControllerMetaSettings)


@dataclass(frozen=True)
class ControllerState:
    """Everything the controllers carry between steps; saved with every checkpoint.

    ``tau_log`` is the tau controller's working variable (``log tau``, ``-inf``
    when tau is 0). Histories hold ``(step, value)`` after every change.
    """

    tau: float
    beta: float
    tau_log: float
    tau_entropy_ema: float | None = None
    step: int = 0
    tau_history: tuple[tuple[int, float], ...] = ()
    beta_history: tuple[tuple[int, float], ...] = ()

    def __post_init__(self) -> None:
        if not (math.isfinite(self.tau) and self.tau >= 0):
            raise ValueError(f"tau must be a finite number >= 0, got {self.tau}")
        if not (math.isfinite(self.beta) and self.beta >= 0):
            raise ValueError(f"beta must be a finite number >= 0, got {self.beta}")
        if math.isnan(self.tau_log) or self.tau_log == math.inf:
            raise ValueError(f"tau_log must be a number < inf, got {self.tau_log}")
        if self.tau_entropy_ema is not None:
            _finite("tau_entropy_ema", self.tau_entropy_ema)

    @classmethod
    def initial(cls, tau: float, beta: float) -> ControllerState:
        return cls(tau=float(tau), beta=float(beta), tau_log=_log(float(tau)))

    def with_params(self, tau: float, beta: float) -> ControllerState:
        """This state with tau and beta set from outside (``tau_log`` follows a changed tau)."""
        if tau == self.tau and beta == self.beta:
            return self
        return replace(self, tau=float(tau), beta=float(beta),
                       tau_log=self.tau_log if tau == self.tau else _log(float(tau)))

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready dict; ``tau_log`` is ``None`` when it is ``-inf`` (tau = 0), keeping the JSON standard."""
        return {
            "tau": self.tau,
            "beta": self.beta,
            "tau_log": self.tau_log if math.isfinite(self.tau_log) else None,
            "tau_entropy_ema": self.tau_entropy_ema,
            "step": self.step,
            "tau_history": [[s, v] for s, v in self.tau_history],
            "beta_history": [[s, v] for s, v in self.beta_history],
        }

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> ControllerState:
        known = {"tau", "beta", "tau_log", "tau_entropy_ema", "step", "tau_history", "beta_history"}
        unknown = sorted(set(data) - known)
        if unknown:
            raise ValueError(f"controller state: unknown keys {unknown}")
        for key in ("tau", "beta"):
            if key not in data:
                raise ValueError(f"controller state: missing key {key!r}")
        tau = float(data["tau"])
        tau_log = data.get("tau_log")
        ema = data.get("tau_entropy_ema")
        return cls(
            tau=tau,
            beta=float(data["beta"]),
            tau_log=_log(tau) if tau_log is None else float(tau_log),
            tau_entropy_ema=None if ema is None else float(ema),
            step=int(data.get("step", 0)),
            tau_history=tuple((int(s), float(v)) for s, v in data.get("tau_history", ())),
            beta_history=tuple((int(s), float(v)) for s, v in data.get("beta_history", ())),
        )


def _with_tau(state: ControllerState, tau: float, step: int, **changes: Any) -> ControllerState:
    return replace(state, tau=tau, tau_log=_log(tau), step=step,
                   tau_history=state.tau_history + ((step, tau),), **changes)


def _with_beta(state: ControllerState, beta: float, step: int) -> ControllerState:
    return replace(state, beta=beta, step=step, beta_history=state.beta_history + ((step, beta),))


def target_entropy_at(settings: TauSchedule, step: int) -> float | None:
    """The scheduled ``H*`` at ``step``: linear from start to final over ``horizon`` steps, then flat."""
    start = settings.target_entropy
    if start is None or settings.target_final is None or settings.horizon <= 0:
        return start
    frac = min(max(step / settings.horizon, 0.0), 1.0)
    return start + (settings.target_final - start) * frac


def update_tau(
    state: ControllerState,
    measured_entropy: float,
    settings: TauSchedule,
    step: int,
    lr_scale: float = 1.0,
) -> ControllerState:
    """One tau step toward ``H*``: EMA of the measured weight entropy, then
    ``log tau += lr * lr_scale * (H* - Hbar)``, clamped to the bounds.

    Disabled settings or ``step <= warmup_steps`` return the state with only
    ``step`` changed (the EMA is not fed during warm-up, so the first value after
    warm-up initialises it). ``lr_scale`` lets the tau lr follow the main LR schedule.
    """
    if not settings.enabled or step <= settings.warmup_steps:
        return replace(state, step=step)
    _finite("measured_entropy", measured_entropy)
    if not (math.isfinite(lr_scale) and lr_scale >= 0):
        raise ValueError(f"lr_scale must be a finite number >= 0, got {lr_scale}")
    if state.tau == 0 and settings.min <= 0:
        raise ValueError("tau is 0, which the multiplicative tau controller cannot move; "
                         "start from tau > 0 or set tau_schedule.min > 0")
    target = target_entropy_at(settings, step)
    prev = state.tau_entropy_ema
    ema = measured_entropy if prev is None else TAU_ENTROPY_EMA_DECAY * prev + (1 - TAU_ENTROPY_EMA_DECAY) * measured_entropy
    tau_log = state.tau_log + settings.lr * lr_scale * (target - ema)
    tau = _clamp_bounds(math.exp(tau_log), settings.min, settings.max)
    # tau_log restarts from the clamped value so the controller does not wind up past a bound.
    return _with_tau(state, tau, step, tau_entropy_ema=ema)


def update_beta(state: ControllerState, measured_kl: float, settings: KlControllerSettings, step: int) -> ControllerState:
    """Adaptive-KL step ``beta <- max(0, beta * (1 + clip(KL/KL* - 1, -s, s) / horizon))`` at optimizer
    step ``step`` (the history records it); no-op when disabled."""
    if not settings.enabled:
        return state
    _finite("measured_kl", measured_kl)
    err = min(max(measured_kl / settings.target - 1.0, -settings.step_size), settings.step_size)
    beta = max(0.0, state.beta * (1.0 + err / settings.horizon))
    return _with_beta(state, beta, step)


def apply_meta_gradients(
    state: ControllerState,
    settings: ControllerSettings,
    *,
    tau_grad: float | None = None,
    beta_grad: float | None = None,
    lr_scale: float = 1.0,
    step: int | None = None,
) -> ControllerState:
    """Gradient step ``tau <- clip(tau - lr_tau * g_tau)``, ``beta <- max(0, beta - lr_beta * clip(g_beta, +-grad_clip))``.

    Tau is clamped to the tau schedule's bounds and to >= 0. A ``None``
    gradient (or a zero learning rate) leaves that parameter alone.
    """
    if not (math.isfinite(lr_scale) and lr_scale >= 0):
        raise ValueError(f"lr_scale must be a finite number >= 0, got {lr_scale}")
    meta, bounds = settings.meta, settings.tau_schedule
    step = state.step if step is None else step
    out = replace(state, step=step)
    if tau_grad is not None and meta.lr_tau > 0:
        _finite("tau_grad", tau_grad)
        tau = max(0.0, _clamp_bounds(state.tau - meta.lr_tau * lr_scale * tau_grad, bounds.min, bounds.max))
        out = _with_tau(out, tau, step)
    if beta_grad is not None and meta.lr_beta > 0:
        _finite("beta_grad", beta_grad)
        g = beta_grad if meta.grad_clip <= 0 else min(max(beta_grad, -meta.grad_clip), meta.grad_clip)
        out = _with_beta(out, max(0.0, state.beta - meta.lr_beta * lr_scale * g), step)
    return out


def meta_gradients(
    entropy: float | None, kl: float | None, settings: ControllerSettings, step: int
) -> tuple[float | None, float | None]:
    """The analytic meta controller's gradients ``(H - H*, KL* - KL)`` at ``step``, for
    :func:`apply_meta_gradients` (so ``tau <- clip(tau - lr_tau (H - H*))``,
    ``beta <- max(0, beta + lr_beta clip(KL - KL*, +-g))``).

    A part is ``None`` (skipped) without its input: the tau part needs ``entropy`` and a
    tau target, the beta part ``kl`` and ``kl_controller.target > 0``.
    """
    target_h = target_entropy_at(settings.tau_schedule, step)
    tau_grad = None if entropy is None or target_h is None else entropy - target_h
    kl_target = settings.kl_controller.target
    beta_grad = None if kl is None or kl_target <= 0 else kl_target - kl
    return tau_grad, beta_grad


def step_controllers(
    state: ControllerState, settings: ControllerSettings, weight_entropy: float | None, measured_kl: float | None,
    step: int,
) -> ControllerState:
    """All of §8 after optimizer step ``step``: the meta controller every ``meta.every`` steps when it
    is on, else the tau controller then the beta controller. Returns the new state.

    ``weight_entropy`` (None without listwise weights) and ``measured_kl`` (None without a KL term)
    must already be averaged over every process, so every rank steps to the same state.
    """
    meta = settings.meta
    if meta.enabled:
        if step % meta.every != 0:
            return state
        tau_grad, beta_grad = meta_gradients(weight_entropy, measured_kl, settings, step)
        return apply_meta_gradients(state, settings, tau_grad=tau_grad, beta_grad=beta_grad, step=step)
    if weight_entropy is not None:
        state = update_tau(state, weight_entropy, settings.tau_schedule, step)
    if measured_kl is not None:
        state = update_beta(state, measured_kl, settings.kl_controller, step)
    return state
