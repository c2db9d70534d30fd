"""REINFORCE++ and REINFORCE++-baseline advantages (``loss.advantage_estimator: reinforce_pp`` /
``reinforce_pp_baseline``; arXiv 2501.03262), float64, from the peers' formulas (OpenRLHF
``_normalize_advantages``, verl ``compute_reinforce_plus_plus*_outcome_advantage``): the reference
below builds the per-token returns literally (one entry per valid completion token) and whitens
them with the ``statistics`` module, so it shares no code with the library."""

from __future__ import annotations

import math
import statistics

import pytest
import torch

from maxent_grpo.core.advantages import compute_advantages

NAN = float("nan")


def reference(rewards: list[float], counts: list[int], g: int, baseline: bool) -> list[float]:
    """Token returns r_i (minus the group mean for the baseline), whitened over every valid token:
    (x - mean) / sqrt(max(pvariance, 1e-8)); a sequence's advantage is its tokens' value."""
    values = []
    for p in range(len(rewards) // g):
        group = rewards[p * g : (p + 1) * g]
        valid = [r for r in group if not math.isnan(r)]
        mean = statistics.fmean(valid) if valid else 0.0
        same = len(valid) < 2 or max(valid) == min(valid)
        for r in group:
            if math.isnan(r):
                values.append(None)
            elif baseline:
                values.append(0.0 if same else r - mean)
            else:
                values.append(r)
    tokens = [v for v, t in zip(values, counts) if v is not None for _ in range(t)]
    if not tokens or max(tokens) == min(tokens):
        return [0.0] * len(rewards)
    mu = statistics.fmean(tokens)
    rstd = 1.0 / math.sqrt(max(statistics.pvariance(tokens), 1e-8))
    return [0.0 if v is None or t == 0 else (v - mu) * rstd for v, t in zip(values, counts)]


def adv(rewards, counts, g, estimator):
    return compute_advantages(torch.tensor(rewards, dtype=torch.float64), g, estimator=estimator,
                              scale_rewards="none", token_counts=torch.tensor(counts))


ESTIMATORS = [("reinforce_pp", False), ("reinforce_pp_baseline", True)]
REWARDS = [1.0, 0.0, 0.5, 2.0, 0.3, NAN, 0.3, 1.7, 0.1, 0.1, 0.1, 0.1, NAN, 4.0, NAN, 1.0]
COUNTS = [3, 7, 1, 0, 5, 4, 2, 8, 6, 6, 2, 9, 3, 1, 4, 2]


@pytest.mark.parametrize("estimator, baseline", ESTIMATORS)
def test_matches_the_token_level_reference(estimator, baseline):
    got = adv(REWARDS, COUNTS, 4, estimator)
    want = torch.tensor(reference(REWARDS, COUNTS, 4, baseline), dtype=torch.float64)
    torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("estimator, baseline", ESTIMATORS)
def test_random_batches_match_the_reference(estimator, baseline):
    gen = torch.Generator().manual_seed(1)
    r = torch.randn(48, generator=gen, dtype=torch.float64)
    r[torch.rand(48, generator=gen) < 0.1] = NAN
    t = torch.randint(0, 12, (48,), generator=gen)
    got = adv(r.tolist(), t.tolist(), 6, estimator)
    want = torch.tensor(reference(r.tolist(), t.tolist(), 6, baseline), dtype=torch.float64)
    torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12)


def test_by_hand():
    # Rewards [1, 0] with 1 and 3 tokens: tokens [1, 0, 0, 0], mean 1/4, pvariance 3/16, std sqrt(3)/4.
    a = adv([1.0, 0.0], [1, 3], 2, "reinforce_pp")
    s = math.sqrt(3) / 4
    torch.testing.assert_close(a, torch.tensor([0.75 / s, -0.25 / s], dtype=torch.float64), rtol=1e-15, atol=0)
    # Baseline: group mean 1/2 -> [1/2, -1/2]; tokens [.5, -.5, -.5, -.5]: mean -1/4, same spread.
    b = adv([1.0, 0.0], [1, 3], 2, "reinforce_pp_baseline")
    torch.testing.assert_close(b, torch.tensor([0.75 / s, -0.25 / s], dtype=torch.float64), rtol=1e-15, atol=0)


def test_token_weighting_is_not_a_sequence_mean():
    # Weighted once per token, the long failure dominates the mean; unweighted it would be [1, -1].
    a = adv([1.0, 0.0], [1, 9], 2, "reinforce_pp")
    assert a[0].item() == pytest.approx(3.0, rel=1e-12) and a[1].item() == pytest.approx(-1 / 3, rel=1e-12)


@pytest.mark.parametrize("estimator, baseline", ESTIMATORS)
def test_all_equal_rewards_in_the_batch_give_exact_zero(estimator, baseline):
    # Three tokens of 0.1: their float mean is 0.10000000000000002, not 0.1, so only an explicit
    # equality test gives 0 (a 1e-17 deviation times rsqrt(1e-8) would be 1e-13).
    assert statistics.fmean([0.1] * 3) != 0.1 and sum([0.1] * 3) / 3 != 0.1
    for r, t in (([0.1] * 6, [1, 1, 1, 0, 0, 0]), ([0.1] * 6, [3, 1, 4, 1, 5, 9]), ([1.0] * 6, [1] * 6)):
        a = adv(r, t, 3, estimator)
        assert torch.equal(a, torch.zeros(6, dtype=torch.float64)) and not torch.isnan(a).any()


def test_baseline_of_zero_std_groups_is_exactly_zero():
    # Every group's rewards agree (at different levels): every centred value is 0, so every advantage.
    a = adv([0.1, 0.1, 0.1, 0.7, 0.7, 0.7, 0.3, 0.3, 0.3], [1, 2, 3, 1, 2, 3, 4, 5, 6], 3, "reinforce_pp_baseline")
    assert torch.equal(a, torch.zeros(9, dtype=torch.float64))


@pytest.mark.parametrize("estimator, baseline", ESTIMATORS)
def test_an_empty_completion_contributes_nothing(estimator, baseline):
    # The third row has 0 tokens: the result is the batch without its tokens, and it gets 0.
    r, t = [1.0, 0.0, 7.0, 0.5, 0.2, 0.9], [2, 3, 0, 4, 1, 2]
    a = adv(r, t, 3, estimator)
    assert a[2].item() == 0.0
    if not baseline:  # without a baseline the row's reward must not move mu or sigma at all
        other = adv([1.0, 0.0, 0.0, 0.5, 0.2, 0.9], t, 3, estimator)
        assert torch.equal(a, other)
    torch.testing.assert_close(a, torch.tensor(reference(r, t, 3, baseline), dtype=torch.float64),
                               rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("estimator, baseline", ESTIMATORS)
def test_nan_row_is_zero_and_not_counted(estimator, baseline):
    a = adv([1.0, NAN, 0.0, 0.0], [2, 5, 2, 2], 4, estimator)
    b = adv([1.0, 0.0, 0.0], [2, 2, 2], 3, estimator)
    assert a[1].item() == 0.0
    torch.testing.assert_close(a[[0, 2, 3]], b, rtol=1e-15, atol=0)


def test_no_tokens_at_all_is_zero():
    assert torch.equal(adv([1.0, 0.0], [0, 0], 2, "reinforce_pp"), torch.zeros(2, dtype=torch.float64))


def test_baseline_whitening_shifts_a_zero_std_group():
    # Group 1 is all equal (centred 0); the batch mean of the centred tokens is not 0, so it moves.
    r, t = [1.0, 1.0, 1.0, 0.0], [1, 1, 1, 3]
    a = adv(r, t, 2, "reinforce_pp_baseline")
    torch.testing.assert_close(a, torch.tensor(reference(r, t, 2, True), dtype=torch.float64), rtol=1e-12, atol=0)
    assert a[0].item() != 0.0


@pytest.mark.parametrize("estimator", ["reinforce_pp", "reinforce_pp_baseline"])
def test_needs_scale_none_and_token_counts(estimator):
    with pytest.raises(ValueError, match="scale_rewards must be none"):
        compute_advantages(torch.tensor([1.0, 0.0]), 2, estimator=estimator, scale_rewards="group",
                           token_counts=torch.tensor([1, 1]))
    with pytest.raises(ValueError, match="token_counts"):
        compute_advantages(torch.tensor([1.0, 0.0]), 2, estimator=estimator, scale_rewards="none")
    with pytest.raises(ValueError, match="token_counts"):
        compute_advantages(torch.tensor([1.0, 0.0]), 2, estimator=estimator, scale_rewards="none",
                           token_counts=torch.tensor([1, -1]))
