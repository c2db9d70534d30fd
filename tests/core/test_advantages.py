import math
import statistics

import pytest
import torch

from maxent_grpo.core.advantages import (
    ADVANTAGE_ESTIMATORS,
    combine_rewards,
    compute_advantages,
    group_reward_std,
    zero_std_groups,
    zero_truncated_rewards,
)

NAN = float("nan")


def _reference(rewards: list[float], g: int, estimator: str, scale: str) -> list[float]:
    """Row-by-row float64 reference using the statistics module."""
    valid_all = [r for r in rewards if not math.isnan(r)]
    batch_std = statistics.stdev(valid_all) if len(valid_all) > 1 else 0.0
    out = []
    for p in range(len(rewards) // g):
        group = rewards[p * g : (p + 1) * g]
        valid = [r for r in group if not math.isnan(r)]
        if len(valid) < 2 or max(valid) == min(valid):
            out += [0.0] * g
            continue
        std = statistics.stdev(valid)
        for r in group:
            if math.isnan(r):
                out.append(0.0)
                continue
            if estimator == "grpo":
                a = r - statistics.fmean(valid)
            else:
                others = list(valid)
                others.remove(r)
                a = r - statistics.fmean(others)
            if scale == "group":
                a /= std + 1e-4
            elif scale == "batch":
                a /= batch_std + 1e-4
            out.append(a)
    return out


REWARDS = [1.0, 0.0, 0.5, 2.0, 0.3, NAN, 0.3, 1.7, 0.1, 0.1, 0.1, 0.1, NAN, 4.0, NAN, NAN]


@pytest.mark.parametrize("estimator", ["grpo", "rloo"])
@pytest.mark.parametrize("scale", ["group", "batch", "none"])
def test_advantages_match_reference(estimator, scale):
    got = compute_advantages(torch.tensor(REWARDS, dtype=torch.float64), 4, estimator=estimator, scale_rewards=scale)
    want = torch.tensor(_reference(REWARDS, 4, estimator, scale), dtype=torch.float64)
    torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12)


def test_rloo_is_grpo_times_g_over_g_minus_1():
    r = torch.randn(24, dtype=torch.float64)
    for g in (2, 3, 6):
        a = compute_advantages(r, g, estimator="grpo", scale_rewards="none")
        b = compute_advantages(r, g, estimator="rloo", scale_rewards="none")
        torch.testing.assert_close(b, a * g / (g - 1))


def test_nan_rows_are_zero_and_excluded_from_group_stats():
    full = torch.tensor([1.0, NAN, 3.0, 6.0], dtype=torch.float64)
    adv = compute_advantages(full, 4)
    assert adv[1] == 0
    # Same as the group without that row (G=3).
    ref = compute_advantages(torch.tensor([1.0, 3.0, 6.0], dtype=torch.float64), 3)
    torch.testing.assert_close(adv[[0, 2, 3]], ref)


# The group-baseline estimators (maxrl's zeros are tested in test_maxrl.py, with binary rewards).
@pytest.mark.parametrize("estimator", ["grpo", "rloo"])
@pytest.mark.parametrize("scale", ["group", "batch", "none"])
def test_equal_rewards_give_exact_zero(estimator, scale):
    # 0.1 three times: the float mean is not exactly 0.1, so only an explicit test gives 0.
    r = torch.tensor([0.1, 0.1, 0.1, 0.7, 0.2, NAN], dtype=torch.float64)
    adv = compute_advantages(r, 3, estimator=estimator, scale_rewards=scale)
    assert torch.equal(adv[:3], torch.zeros(3, dtype=torch.float64))
    assert adv[5] == 0 and adv[3] != 0


def test_group_with_single_valid_reward_is_zero():
    adv = compute_advantages(torch.tensor([NAN, 5.0, NAN, 1.0, 2.0, 3.0]), 3)
    assert torch.equal(adv[:3], torch.zeros(3))
    assert not torch.isnan(adv).any()


def test_group_scaling_is_unit_std_up_to_eps():
    r = torch.randn(40, dtype=torch.float64) * 7 + 3
    adv = compute_advantages(r, 8).view(5, 8)
    std = r.view(5, 8).std(dim=1)
    torch.testing.assert_close(adv.std(dim=1), std / (std + 1e-4))
    torch.testing.assert_close(adv.mean(dim=1), torch.zeros(5, dtype=torch.float64), atol=1e-12, rtol=0)


def test_batch_scaling_uses_one_scalar():
    r = torch.tensor([0.0, 1.0, 10.0, 30.0], dtype=torch.float64)
    adv = compute_advantages(r, 2, scale_rewards="batch")
    s = statistics.stdev([0.0, 1.0, 10.0, 30.0]) + 1e-4
    torch.testing.assert_close(adv, torch.tensor([-0.5, 0.5, -10.0, 10.0], dtype=torch.float64) / s)


@pytest.mark.parametrize(
    "kwargs, name",
    [
        (dict(rewards=torch.zeros(7), num_generations=2), "num_generations"),
        (dict(rewards=torch.zeros(4), num_generations=1), "num_generations"),
        (dict(rewards=torch.zeros(4), num_generations=2, estimator="ppo"), "estimator"),
        (dict(rewards=torch.zeros(4), num_generations=2, scale_rewards="True"), "scale_rewards"),
        (dict(rewards=torch.zeros(2, 2), num_generations=2), "rewards"),
    ],
)
def test_bad_arguments_raise(kwargs, name):
    assert set(ADVANTAGE_ESTIMATORS) >= {"grpo", "rloo", "maxrl", "reinforce_pp", "reinforce_pp_baseline"}
    with pytest.raises(ValueError, match=name):
        compute_advantages(**kwargs)


def test_combine_rewards_nan_sum():
    per_fn = torch.tensor([[1.0, 2.0, NAN], [NAN, NAN, NAN], [NAN, 3.0, 4.0], [0.5, 0.0, 1.0]], dtype=torch.float64)
    w = torch.tensor([1.0, 0.5, -2.0], dtype=torch.float64)
    got = combine_rewards(per_fn, w)
    want = []
    for row in per_fn.tolist():
        vals = [wk * f for wk, f in zip(w.tolist(), row) if not math.isnan(f)]
        want.append(sum(vals) if vals else NAN)
    torch.testing.assert_close(got, torch.tensor(want, dtype=torch.float64), equal_nan=True)
    assert torch.isnan(got[1]) and not torch.isnan(got[[0, 2, 3]]).any()


def test_combine_rewards_all_none_row_gets_zero_advantage():
    per_fn = torch.tensor([[1.0], [NAN], [0.0], [3.0]])
    adv = compute_advantages(combine_rewards(per_fn, torch.ones(1)), 4)
    assert adv[1] == 0 and adv[3] > 0 and adv[2] < 0


def test_combine_rewards_shape_errors():
    with pytest.raises(ValueError, match="weights"):
        combine_rewards(torch.zeros(3, 2), torch.ones(3))
    with pytest.raises(ValueError, match="per_function"):
        combine_rewards(torch.zeros(3), torch.ones(3))


def test_zero_truncated_rewards():
    r = torch.tensor([1.0, 2.0, NAN, 4.0])
    out = zero_truncated_rewards(r, torch.tensor([False, True, True, False]))
    assert out.tolist()[0] == 1.0 and out[1] == 0 and out[2] == 0 and out[3] == 4.0
    with pytest.raises(ValueError, match="truncated"):
        zero_truncated_rewards(r, torch.tensor([0, 1, 1, 0]))


def test_group_std_and_zero_std_groups():
    r = torch.tensor([1.0, 1.0, 1.0, 0.0, 2.0, 4.0, NAN, NAN, 5.0, 0.1, 0.1, NAN], dtype=torch.float64)
    std = group_reward_std(r, 3)
    assert std[0] == 0 and std[2] == 0 and std[3] == 0
    assert std[1] == pytest.approx(statistics.stdev([0.0, 2.0, 4.0]))
    assert zero_std_groups(r, 3).tolist() == [True, False, True, True]
    assert zero_std_groups(r, 3).float().mean().item() == 0.75
