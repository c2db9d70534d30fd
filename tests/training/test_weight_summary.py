"""``training.metrics.summarize_weight_stats``: every field of the logged view is computed, none is a placeholder."""

from __future__ import annotations

import math

import pytest
import torch

from maxent_grpo.rewards.maxent import WeightStats
from maxent_grpo.training.distributed import Dist
from maxent_grpo.training.metrics import summarize_weight_stats


def test_the_view_matches_a_float64_reference_over_the_groups_in_the_loss():
    w = torch.tensor([[0.7, 0.2, 0.1], [1 / 3, 1 / 3, 1 / 3], [0.5, 0.5, 0.0]], dtype=torch.float64)
    active = [0, 2]  # the middle group is out of the loss (uniform weights, no say in the entropy)
    h = [-sum(p * math.log(p) for p in row if p > 0) for row in w.tolist()]
    adv = [p - 1 / 3 for row in w.tolist() for p in row]
    stats = WeightStats(w, w.reshape(-1), (h[0] + h[2]) / 2, min(h[0], h[2]), max(h[0], h[2]),
                        torch.tensor(adv, dtype=torch.float64), len(active))
    view = summarize_weight_stats(Dist(), stats)
    entropy = (h[0] + h[2]) / 2
    mean = sum(adv) / len(adv)
    std = math.sqrt(sum((a - mean) ** 2 for a in adv) / (len(adv) - 1))
    assert view.entropy == pytest.approx(entropy, rel=1e-12)
    assert view.entropy_norm == pytest.approx(entropy / math.log(3), rel=1e-12)
    assert (view.entropy_min, view.entropy_max) == (pytest.approx(h[2]), pytest.approx(h[0]))
    assert view.advantage_entropy_mean == pytest.approx(mean, abs=1e-15)
    assert view.advantage_entropy_std == pytest.approx(std, rel=1e-12) and view.advantage_entropy_std > 0
    # One process: the same view as the batch's own.
    local = stats.logging_view()
    assert (view.entropy_norm, view.advantage_entropy_std) == (pytest.approx(local.entropy_norm),
                                                               pytest.approx(local.advantage_entropy_std))


def test_no_group_in_the_loss_gives_no_view():
    w = torch.full((2, 4), 0.25, dtype=torch.float64)
    stats = WeightStats(w, w.reshape(-1), math.nan, math.nan, math.nan, (w - 0.25).reshape(-1), 0)
    assert summarize_weight_stats(Dist(), stats) is None
