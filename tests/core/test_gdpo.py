"""GDPO's normalize-then-sum aggregation (core/advantages.normalize_then_sum): TRL 1.16's
``multi_objective_aggregation="normalize_then_sum"`` branch on random rewards with NaN, a
closed form, and the advantages TRL then takes."""

from __future__ import annotations

import pytest
import torch

from maxent_grpo.core.advantages import compute_advantages, normalize_then_sum

nanstd = pytest.importorskip("trl.trainer.utils", reason="trl is not installed (the GPU machine's image)").nanstd


def _trl_rewards(per_function, weights, g):
    """TRL's branch (grpo_trainer.py, normalize_then_sum), before its batch normalisation."""
    k = per_function.shape[1]
    grouped = per_function.view(-1, g, k)
    mean_k = torch.nanmean(grouped, dim=1, keepdim=True)
    std_k = nanstd(grouped, dim=1, keepdim=True)
    rewards = (((grouped - mean_k) / (std_k + 1e-4)).view(-1, k) * weights.unsqueeze(0)).nansum(dim=1)
    rewards[torch.isnan(per_function).all(dim=1)] = torch.nan
    return rewards


# TRL's nanstd takes its Bessel factor count / (count - 1) from int tensors, so in float32: its
# values agree with a float64 computation to about 2e-8, not to rounding.
TRL_FLOAT32_BESSEL = 1e-6  # absolute, on values of order 1


def test_equal_to_trl_with_missing_values():
    gen = torch.Generator().manual_seed(0)
    for trial in range(20):
        g, k, p = 4, 3, 5
        r = torch.rand(p * g, k, generator=gen, dtype=torch.float64)
        r[torch.rand(p * g, k, generator=gen) < 0.2] = float("nan")
        r[3] = float("nan")
        w = torch.rand(k, generator=gen, dtype=torch.float64) + 0.1
        ours, theirs = normalize_then_sum(r, w, g), _trl_rewards(r, w, g)
        assert torch.equal(torch.isnan(ours), torch.isnan(theirs))
        assert torch.allclose(ours[~torch.isnan(ours)], theirs[~torch.isnan(theirs)], rtol=0, atol=TRL_FLOAT32_BESSEL)


def test_a_sparse_reward_is_not_drowned_by_a_dense_one():
    sparse = torch.tensor([1.0, 0.0, 0.0, 0.0], dtype=torch.float64)
    dense = torch.tensor([0.0, 10.0, 20.0, 30.0], dtype=torch.float64)
    total = normalize_then_sum(torch.stack([sparse, dense], 1), torch.tensor([1.0, 1.0], dtype=torch.float64), 4)
    z = lambda x: (x - x.mean()) / (x.std() + 1e-4)  # noqa: E731
    assert torch.allclose(total, z(sparse) + z(dense), rtol=0, atol=1e-14)
    # the weighted sum first: the sparse reward's spread is 1/30 of the dense one's
    assert float(z(sparse).abs().max()) == pytest.approx(1.5, abs=1e-3)


def test_batch_scaled_advantages_equal_trls():
    gen = torch.Generator().manual_seed(1)
    r = torch.rand(12, 2, generator=gen, dtype=torch.float64)
    w = torch.tensor([1.0, 0.3], dtype=torch.float64)
    total = normalize_then_sum(r, w, 4)
    theirs = _trl_rewards(r, w, 4)
    theirs = (theirs - theirs.mean()) / (nanstd(theirs) + 1e-4)
    assert torch.allclose(compute_advantages(total, 4, scale_rewards="batch"), theirs, rtol=0, atol=TRL_FLOAT32_BESSEL)


def test_bad_shapes():
    with pytest.raises(ValueError):
        normalize_then_sum(torch.zeros(6, 2, dtype=torch.float64), torch.ones(2, dtype=torch.float64), 4)
    with pytest.raises(ValueError):
        normalize_then_sum(torch.zeros(8, 2, dtype=torch.float64), torch.ones(3, dtype=torch.float64), 4)


def test_a_run_trains_with_normalize_then_sum(tiny_model_dir, tmp_path):
    from maxent_grpo.cli import main
    from maxent_grpo.training.metrics import read_metrics
    from tiny_runs import tiny_overrides

    out = tmp_path / "run"
    args = tiny_overrides(tiny_model_dir, out, steps=2, rewards="[{name: boxed_accuracy}, {name: length, kwargs: {max_length: 100}}]",
                          extra=["method=grpo", "loss.multi_objective_aggregation=normalize_then_sum",
                                 "loss.scale_rewards=batch"])
    assert main(["train", *args]) == 0
    assert [r["step"] for r in read_metrics(out / "metrics.jsonl")] == [1, 2]


def test_reward_statistics_use_the_aggregation():
    from maxent_grpo.rewards.maxent import compute_reward_statistics

    gen = torch.Generator().manual_seed(2)
    r = torch.rand(8, 2, generator=gen, dtype=torch.float64)
    w = torch.tensor([1.0, 0.5], dtype=torch.float64)
    comp = compute_reward_statistics(r, w, 4, q_temperature=1.0, q_epsilon=1e-6, aggregation="normalize_then_sum")
    assert torch.equal(comp.total, normalize_then_sum(r, w, 4))
    with pytest.raises(ValueError, match="aggregation"):
        compute_reward_statistics(r, w, 4, q_temperature=1.0, q_epsilon=1e-6, aggregation="max")
