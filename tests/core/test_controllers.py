"""Tau / beta / meta controllers and their state (§8)."""

from __future__ import annotations

import json
import math
from dataclasses import replace

import pytest

from maxent_grpo.core.controllers import (
    ControllerMetaSettings,
    ControllerSettings,
    ControllerState,
    KlControllerSettings,
    TauSchedule,
    apply_meta_gradients,
    meta_gradients,
    target_entropy_at,
    update_beta,
    update_tau,
)

SCHED = TauSchedule(target_entropy=1.0, lr=0.5, min=0.01, max=10.0, warmup_steps=2)


def test_tau_skips_warmup_then_initialises_ema_and_steps_log_tau():
    s = ControllerState.initial(0.5, 0.1)
    for step in (1, 2):
        s = update_tau(s, 0.2, SCHED, step)
        assert (s.tau, s.tau_entropy_ema, s.tau_history) == (0.5, None, ())
        assert s.step == step
    s = update_tau(s, 0.4, SCHED, 3)
    assert s.tau_entropy_ema == 0.4  # first value initialises the EMA
    expect = math.exp(math.log(0.5) + 0.5 * (1.0 - 0.4))
    assert s.tau == pytest.approx(expect, rel=1e-12)
    assert s.tau_log == pytest.approx(math.log(expect), rel=1e-12)
    s2 = update_tau(s, 0.8, SCHED, 4, lr_scale=0.5)
    ema = 0.9 * 0.4 + 0.1 * 0.8
    assert s2.tau_entropy_ema == pytest.approx(ema, rel=1e-12)
    assert s2.tau == pytest.approx(math.exp(math.log(expect) + 0.25 * (1.0 - ema)), rel=1e-12)
    assert [h[0] for h in s2.tau_history] == [3, 4]
    assert s.tau == pytest.approx(expect)  # pure: the old state is untouched


def test_tau_moves_toward_target_entropy():
    s = ControllerState.initial(1.0, 0.0)
    sched = TauSchedule(target_entropy=1.0, lr=0.1)
    assert update_tau(s, 0.5, sched, 1).tau > 1.0  # too peaked: raise tau
    assert update_tau(s, 1.5, sched, 1).tau < 1.0


def test_tau_clamps_and_resets_log_tau_at_the_bound():
    s = ControllerState.initial(1.0, 0.0)
    hi = update_tau(s, -100.0, SCHED, 5)
    assert hi.tau == 10.0 and hi.tau_log == pytest.approx(math.log(10.0))
    lo = update_tau(s, 100.0, SCHED, 5)
    assert lo.tau == 0.01 and lo.tau_log == pytest.approx(math.log(0.01))
    # no wind-up: one step back from the bound moves off it at once
    back = update_tau(replace(hi, tau_entropy_ema=None), 1.5, SCHED, 6)
    assert back.tau < 10.0


@pytest.mark.parametrize("lo,hi", [(0.0, 0.0), (-1.0, -1.0)])
def test_tau_bounds_at_or_below_zero_are_unbounded(lo, hi):
    sched = TauSchedule(target_entropy=1.0, lr=1.0, min=lo, max=hi)
    s = ControllerState.initial(1.0, 0.0)
    assert update_tau(s, -30.0, sched, 1).tau == pytest.approx(math.exp(31.0))
    assert update_tau(s, 31.0, sched, 1).tau == pytest.approx(math.exp(-30.0))


def test_tau_disabled_or_zero():
    s = ControllerState.initial(0.5, 0.0)
    assert update_tau(s, 0.1, TauSchedule(target_entropy=None, lr=1.0), 9).tau == 0.5
    assert update_tau(s, 0.1, TauSchedule(target_entropy=1.0, lr=0.0), 9).tau == 0.5
    with pytest.raises(ValueError, match="tau"):
        update_tau(ControllerState.initial(0.0, 0.0), 0.1, TauSchedule(target_entropy=1.0, lr=1.0), 1)
    # a positive floor lifts tau off 0
    assert update_tau(ControllerState.initial(0.0, 0.0), 0.1, TauSchedule(target_entropy=1.0, lr=1.0, min=0.2), 1).tau == 0.2
    with pytest.raises(ValueError, match="measured_entropy"):
        update_tau(s, math.nan, SCHED, 9)


def test_target_entropy_schedule_is_linear_then_flat():
    sched = TauSchedule(target_entropy=2.0, target_final=1.0, horizon=10, lr=0.1)
    assert [target_entropy_at(sched, k) for k in (0, 5, 10, 50)] == pytest.approx([2.0, 1.5, 1.0, 1.0])
    assert target_entropy_at(TauSchedule(target_entropy=2.0, target_final=1.0), 5) == 2.0  # no horizon
    s = update_tau(ControllerState.initial(1.0, 0.0), 1.5, sched, 5)
    assert s.tau == pytest.approx(1.0)  # H == H*(5): no move


@pytest.mark.parametrize("settings", [
    KlControllerSettings(0.0, 10, 0.2), KlControllerSettings(0.1, 0, 0.2), KlControllerSettings(0.1, 10, 0.0),
])
def test_beta_off_unless_target_horizon_and_step_all_positive(settings):
    s = ControllerState.initial(0.5, 0.2)
    assert update_beta(s, 5.0, settings, 1) == s


def test_beta_adaptive_kl_step():
    kl = KlControllerSettings(target=0.1, horizon=10, step_size=0.2)
    s = ControllerState.initial(0.5, 0.2)
    assert update_beta(s, 0.11, kl, 1).beta == pytest.approx(0.2 * (1 + 0.1 / 10), rel=1e-12)
    assert update_beta(s, 0.5, kl, 1).beta == pytest.approx(0.2 * (1 + 0.2 / 10), rel=1e-12)  # clipped at +s
    assert update_beta(s, 0.0, kl, 1).beta == pytest.approx(0.2 * (1 - 0.2 / 10), rel=1e-12)  # clipped at -s
    wild = KlControllerSettings(target=0.1, horizon=1, step_size=5.0)
    assert update_beta(s, -1.0, wild, 1).beta == 0.0  # never negative (k1 KL estimates can be < 0)
    assert update_beta(ControllerState.initial(0.5, 0.0), 1.0, kl, 1).beta == 0.0
    with pytest.raises(ValueError, match="measured_kl"):
        update_beta(s, math.inf, kl, 1)


META = ControllerSettings(
    tau_schedule=TauSchedule(target_entropy=1.0, min=0.05, max=2.0),
    kl_controller=KlControllerSettings(target=0.1),
    meta=ControllerMetaSettings(lr_tau=0.5, lr_beta=2.0, every=2, grad_clip=0.05),
)


def meta_step(s, entropy, kl, settings, step):
    tau_grad, beta_grad = meta_gradients(entropy, kl, settings, step)
    return apply_meta_gradients(s, settings, tau_grad=tau_grad, beta_grad=beta_grad, step=step)


def test_meta_analytic_step():
    """tau <- clip(tau - lr_tau (H - H*)), beta <- max(0, beta + lr_beta clip(KL - KL*, +-g)) (§8)."""
    s = ControllerState.initial(0.5, 0.2)
    out = meta_step(s, 1.4, 0.12, META, step=4)
    assert out.tau == pytest.approx(0.5 - 0.5 * (1.4 - 1.0)) and out.step == 4
    assert out.beta == pytest.approx(0.2 + 2.0 * 0.02)
    clipped = meta_step(s, 0.8, 0.9, META, step=4)
    assert clipped.tau == pytest.approx(0.5 + 0.5 * 0.2)
    assert clipped.beta == pytest.approx(0.2 + 2.0 * 0.05)  # KL error clipped at g
    low = meta_step(s, 5.0, 0.0, META, step=4)
    assert low.tau == 0.05  # clamped to tau_min
    assert low.beta == pytest.approx(0.2 - 2.0 * 0.05)
    assert meta_gradients(None, None, META, 4) == (None, None)
    assert meta_step(s, None, None, META, step=4).tau == 0.5
    no_target = ControllerSettings(TauSchedule(), KlControllerSettings(), META.meta)
    assert meta_gradients(1.0, 0.5, no_target, 4) == (None, None)  # nothing to steer toward


def test_meta_unclipped_and_disabled():
    unclipped = ControllerSettings(META.tau_schedule, META.kl_controller,
                                   ControllerMetaSettings(lr_beta=1.0, grad_clip=0.0))
    s = ControllerState.initial(0.5, 0.2)
    assert meta_step(s, 1.0, 5.1, unclipped, 1).beta == pytest.approx(0.2 + 5.0)
    assert meta_step(s, 1.0, -100.0, unclipped, 1).beta == 0.0
    assert not ControllerMetaSettings().enabled and ControllerMetaSettings(lr_tau=1e-3).enabled
    grads = apply_meta_gradients(s, META, tau_grad=0.1, beta_grad=-1.0, lr_scale=0.5)
    assert grads.tau == pytest.approx(0.5 - 0.5 * 0.5 * 0.1)
    assert grads.beta == pytest.approx(0.2 + 0.5 * 2.0 * 0.05)


def test_settings_validation_names_the_field():
    with pytest.raises(ValueError, match="tau_schedule.lr"):
        TauSchedule(lr=-1.0)
    with pytest.raises(ValueError, match="tau_schedule.min"):
        TauSchedule(min=2.0, max=1.0)
    with pytest.raises(ValueError, match="target_final"):
        TauSchedule(target_final=1.0)
    with pytest.raises(ValueError, match="warmup_steps"):
        TauSchedule(warmup_steps=-1)
    with pytest.raises(ValueError, match="controller_meta.every"):
        ControllerMetaSettings(every=0)
    with pytest.raises(ValueError, match="tau"):
        ControllerState.initial(-1.0, 0.0)
    with pytest.raises(ValueError, match="beta"):
        ControllerState.initial(1.0, math.nan)


# ---------------------------------------------------------------- persistence


def _busy_state() -> ControllerState:
    s = ControllerState.initial(0.5, 0.2)
    s = update_tau(s, 0.3, TauSchedule(target_entropy=1.0, lr=0.2), 1)
    return update_beta(s, 0.3, KlControllerSettings(0.1, 10, 0.2), 1)


def test_dict_round_trip():
    s = _busy_state()
    assert ControllerState.from_dict(json.loads(json.dumps(s.to_dict()))) == s
    zero = ControllerState.initial(0.0, 0.0)
    d = zero.to_dict()
    assert d["tau_log"] is None and d["tau_entropy_ema"] is None
    assert ControllerState.from_dict(d) == zero
    with pytest.raises(ValueError, match="unknown keys"):
        ControllerState.from_dict({**d, "gamma": 1})
    with pytest.raises(ValueError, match="tau"):
        ControllerState.from_dict({"beta": 0.1})
