"""MaxRL advantages (``loss.advantage_estimator: maxrl``), float64, from ALGORITHMS.md §16 ("Chosen",
"Float64 tests"): the expected values are written out by hand or computed in plain Python from
the spec's formula, never from the library's code."""

from __future__ import annotations

import math

import pytest
import torch

from maxent_grpo.core.advantages import compute_advantages, maxrl_group_stats

NAN = float("nan")


def maxrl(rewards: list[float], g: int) -> torch.Tensor:
    return compute_advantages(torch.tensor(rewards, dtype=torch.float64), g, estimator="maxrl", scale_rewards="none")


def spec_maxrl(rewards: list[float], g: int) -> list[float]:
    """§16 Chosen 1: valid rows only, A_i = (G_v*r_i)/K - 1 if K > 0 (and G_v >= 2), else 0."""
    out = []
    for p in range(len(rewards) // g):
        group = rewards[p * g : (p + 1) * g]
        valid = [r for r in group if not math.isnan(r)]
        g_v, k = len(valid), sum(valid)
        out += [0.0 if math.isnan(r) or k == 0 or g_v < 2 else (g_v * r) / k - 1 for r in group]
    return out


def remax_binary_maxrl(r: torch.Tensor) -> torch.Tensor:
    """remax's ``binary_maxrl_advantages`` as §16 states it: ``[P, G]``, ``(r*G)/max(K, 1) - 1``
    where ``K > 0``, zeros elsewhere, in the input dtype."""
    g = r.shape[1]
    k = r.sum(dim=1, keepdim=True)
    return torch.where(k > 0, (r * g) / k.clamp(min=1) - 1, torch.zeros_like(r))


# --- Float64 test 1: G = 16 ---------------------------------------------------------------

def test_g16_one_success_gives_15_and_minus_ones():
    adv = maxrl([1.0] + [0.0] * 15, 16)
    assert adv.tolist() == [15.0] + [-1.0] * 15


def test_g16_three_successes():
    r = [0.0] * 16
    for i in (2, 7, 11):
        r[i] = 1.0
    adv = maxrl(r, 16)
    for i in range(16):
        if r[i] == 1.0:
            assert abs(adv[i].item() - 13 / 3) <= 1e-15
        else:
            assert adv[i].item() == -1.0


def test_g16_every_group_sums_to_zero():
    gen = torch.Generator().manual_seed(0)
    r = (torch.rand(64, 16, generator=gen, dtype=torch.float64) < torch.rand(64, 1, generator=gen,
                                                                          dtype=torch.float64)).to(torch.float64)
    adv = maxrl(r.reshape(-1).tolist(), 16).view(64, 16)
    assert adv.sum(dim=1).abs().max().item() <= 1e-12


@pytest.mark.parametrize("k", [0, 16])
def test_g16_no_success_and_all_success_are_exact_zeros(k):
    adv = maxrl([1.0] * k + [0.0] * (16 - k), 16)
    assert torch.equal(adv, torch.zeros(16, dtype=torch.float64))


# --- Float64 test 2: MaxRL times the success rate is the Dr.GRPO advantage --------------------

def test_times_success_rate_is_dr_grpo_including_nan_rows():
    rewards = [1, 0, 0, 1, NAN, 0,  0, 0, 0, 0, 1, NAN,  1, 1, 1, NAN, NAN, 1,  NAN, 1, 0, 0, 0, 0]
    rewards = [float(x) for x in rewards]
    adv = maxrl(rewards, 6).view(4, 6)
    dr = compute_advantages(torch.tensor(rewards, dtype=torch.float64), 6, estimator="grpo",
                            scale_rewards="none").view(4, 6)
    for p in range(4):
        group = rewards[p * 6 : (p + 1) * 6]
        valid = [r for r in group if not math.isnan(r)]
        rate = sum(valid) / len(valid)
        for i, r in enumerate(group):
            want = 0.0 if math.isnan(r) else r - rate  # Dr.GRPO, by hand
            assert abs(adv[p, i].item() * rate - want) <= 1e-12, (p, i)
            assert abs(dr[p, i].item() - want) <= 1e-12, (p, i)


# --- Float64 test 3: errors ---------------------------------------------------------------

@pytest.mark.parametrize("bad", [0.5, 2.0, -1.0, math.inf, -math.inf])
@pytest.mark.parametrize("row", [0, 5])
def test_non_binary_reward_raises_naming_value_and_row(bad, row):
    r = [1.0, 0.0, 0.0, 1.0, 0.0, 1.0]
    r[row] = bad
    with pytest.raises(ValueError) as err:
        maxrl(r, 3)
    assert f"row {row}" in str(err.value) and repr(bad) in str(err.value), str(err.value)


def test_one_sample_group_raises():
    with pytest.raises(ValueError, match="num_generations"):
        maxrl([1.0, 0.0], 1)


def test_nan_row_is_zero_and_excluded():
    # G = 4 with one NaN row is the G_v = 3 group [1, 0, 0]: 3*1/1 - 1 = 2, and -1.
    adv = maxrl([1.0, NAN, 0.0, 0.0], 4)
    assert adv.tolist() == [2.0, 0.0, -1.0, -1.0]


def test_scale_rewards_other_than_none_is_refused():
    for scale in ("group", "batch"):
        with pytest.raises(ValueError, match="scale_rewards"):
            compute_advantages(torch.tensor([1.0, 0.0]), 2, estimator="maxrl", scale_rewards=scale)


# --- Float64 test 4: remax parity, bit for bit ----------------------------------------------

@pytest.mark.parametrize("g", [2, 3, 8, 16])
def test_bit_for_bit_with_remax_formula(g):
    gen = torch.Generator().manual_seed(g)
    r = (torch.rand(50, g, generator=gen, dtype=torch.float64) < 0.3).to(torch.float64)
    r[0], r[1] = 0.0, 1.0  # a K = 0 and a K = G group
    got = maxrl(r.reshape(-1).tolist(), g).view(50, g)
    assert torch.equal(got, remax_binary_maxrl(r))
    assert got.dtype == torch.float64


def test_keeps_the_reward_dtype():
    r = torch.tensor([1.0, 0.0, 0.0], dtype=torch.float32)
    adv = compute_advantages(r, 3, estimator="maxrl", scale_rewards="none")
    assert adv.dtype == torch.float32 and adv.tolist() == [2.0, -1.0, -1.0]


# --- Edge cases --------------------------------------------------------------------------

@pytest.mark.parametrize("rewards, g, want", [
    ([1.0, 1.0, 1.0, 1.0], 4, [0.0] * 4),  # all equal (K = G)
    ([0.0, 0.0, 0.0], 3, [0.0] * 3),  # K = 0
    ([1.0, 0.0], 2, [1.0, -1.0]),  # a group of 2: 2*1/1 - 1
    ([0.0, 1.0, 1.0, 0.0, 0.0, 1.0], 3, [-1.0, 0.5, 0.5, -1.0, -1.0, 2.0]),  # 3*1/2 - 1, 3*1/1 - 1
    ([NAN, 1.0, NAN], 3, [0.0] * 3),  # G_v = 1 < 2
    ([NAN, NAN], 2, [0.0, 0.0]),  # no valid row
    ([1.0, NAN, 1.0, 0.0], 4, [0.5, 0.0, 0.5, -1.0]),  # G_v = 3, K = 2
])
def test_edge_cases(rewards, g, want):
    assert maxrl(rewards, g).tolist() == want
    assert spec_maxrl(rewards, g) == want


def test_random_groups_with_nan_rows_match_the_spec():
    gen = torch.Generator().manual_seed(3)
    r = (torch.rand(40 * 5, generator=gen, dtype=torch.float64) < 0.4).to(torch.float64)
    r[torch.rand(200, generator=gen) < 0.15] = NAN
    got = maxrl(r.tolist(), 5)
    want = torch.tensor(spec_maxrl(r.tolist(), 5), dtype=torch.float64)
    torch.testing.assert_close(got, want, rtol=1e-12, atol=0)


def test_group_stats_for_the_metrics():
    r = torch.tensor([1.0, 0.0, 0.0, 0.0,  0.0, 0.0, NAN, 0.0,  1.0, 1.0, NAN, 0.0,  NAN, NAN, NAN, NAN],
                     dtype=torch.float64)
    rate, none = maxrl_group_stats(r, 4)
    assert rate.tolist() == [0.25, 0.0, 2 / 3] and none.tolist() == [False, True, False]
    assert maxrl(r.tolist(), 4).max().item() == 3.0


def test_order_of_operations_is_g_v_times_r_over_k_minus_one():
    """§16 Chosen 6: ``(G_v*r)/K - 1`` in the reward dtype, exactly; ``G_v*(r/K) - 1`` (e.g. G=5, K=3)
    and ``(r - rbar)/rbar`` (e.g. G=3, K=1) differ in the last bit for some (G, K)."""
    for g in range(2, 33):
        for k in range(1, g + 1):
            adv = maxrl([1.0] * k + [0.0] * (g - k), g)
            assert adv[0].item() == (g * 1.0) / k - 1, (g, k)
            # The same group with a NaN row appended: G_v = g valid rows of g + 1.
            adv = maxrl([1.0] * k + [0.0] * (g - k) + [NAN], g + 1)
            assert adv[0].item() == (g * 1.0) / k - 1 and adv[-1].item() == 0.0, (g, k)
