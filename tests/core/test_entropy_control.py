"""The adaptive entropy coefficient (core/entropy_control.py) against TRL 1.16's controller,
written out here from its trainer: the coefficients applied over a run of measured entropies."""

from __future__ import annotations

import json
import math
import random

import pytest

from maxent_grpo.core.entropy_control import AdaptiveEntropy, EntropyCoefState, update_entropy_coef


def _trl(initial, entropies, target, delta, lo, hi):
    """TRL: apply coef iff last_world_entropy <= target (inf at start); then step the coef."""
    coef, last, applied = initial, float("inf"), []
    for h in entropies:
        applied.append(coef if last <= target else 0.0)
        coef = min(coef + delta, hi) if h <= target else max(coef - delta, lo)
        last = h
    return applied, coef


def test_the_applied_coefficients_follow_trls_controller():
    rng = random.Random(0)
    settings = AdaptiveEntropy(target=0.3, delta=0.01, coef_min=0.0, coef_max=0.05)
    entropies = [rng.uniform(0.1, 0.5) for _ in range(200)]
    state, applied = EntropyCoefState(0.02), []
    for h in entropies:
        applied.append(state.applied(settings))
        state = update_entropy_coef(state, h, settings)
    theirs, final = _trl(0.02, entropies, 0.3, 0.01, 0.0, 0.05)
    assert applied == pytest.approx(theirs, abs=1e-15) and state.coef == pytest.approx(final, abs=1e-15)
    assert max(applied) <= 0.05 and applied[0] == 0.0


def test_state_round_trips_through_json_and_checks():
    state = EntropyCoefState(0.1)
    assert EntropyCoefState.from_dict(json.loads(json.dumps(state.to_dict()))) == state
    later = update_entropy_coef(state, 0.1, AdaptiveEntropy())
    assert EntropyCoefState.from_dict(json.loads(json.dumps(later.to_dict()))) == later
    with pytest.raises(ValueError):
        AdaptiveEntropy(coef_min=0.5, coef_max=0.1)
    with pytest.raises(ValueError):
        update_entropy_coef(state, math.nan, AdaptiveEntropy())
