"""The staleness bound of asynchronous rollouts (ALGORITHMS.md §15, item 1 and float64 test 3)."""

from __future__ import annotations

import pytest
import torch

from maxent_grpo.core.staleness import admissible, staleness


def test_staleness_is_the_steps_since_the_sampling_weights():
    versions = torch.tensor([7, 5, 0, 4], dtype=torch.int32)
    lag = staleness(7, versions)
    assert lag.tolist() == [0, 2, 7, 3]
    assert lag.dtype == torch.int64


@pytest.mark.parametrize("k", [0, 1, 2, 8])
def test_the_boundary_is_kept_and_one_more_is_dropped(k):
    step = 10
    versions = torch.tensor([step, step - k, step - k - 1, 0])  # current, exactly k, k + 1, the first
    keep = admissible(step, versions, k).tolist()
    assert keep == [True, True, False, k >= step]


def test_k_zero_keeps_only_the_current_version():
    versions = torch.arange(6)
    assert admissible(5, versions, 0).tolist() == [False] * 5 + [True]
    # Before any update (step 0) everything was sampled by version 0.
    assert admissible(0, torch.zeros(3, dtype=torch.long), 0).tolist() == [True] * 3


def test_an_empty_batch_has_nothing_to_drop():
    assert admissible(3, torch.zeros(0, dtype=torch.long), 1).shape == (0,)


def test_a_version_newer_than_the_step_is_an_error():
    with pytest.raises(ValueError, match="newer than step 4: 5"):
        staleness(4, torch.tensor([3, 5, 4]))
    with pytest.raises(ValueError, match="newer than step"):
        admissible(4, torch.tensor([5]), 8)


@pytest.mark.parametrize("k", [-1, True, False, 1.0, 2.5, "1", None])
def test_a_bad_bound_is_an_error(k):
    with pytest.raises(ValueError, match="max_staleness must be an integer >= 0"):
        admissible(3, torch.tensor([3]), k)
