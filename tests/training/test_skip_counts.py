"""The run's skip counts (training/skip_counts.py): what a batch adds, and the checkpoint round trip."""

from __future__ import annotations

from maxent_grpo.rollout.data_plane import Skipped
from maxent_grpo.training.skip_counts import SkipCounts


def test_a_run_of_skips_is_counted_and_ends_with_a_batch_that_trains():
    skips = SkipCounts()
    skips.count({"incomplete_groups": 2}, None)
    skips.count({}, Skipped("reward", "judge unreachable"))
    skips.count({"incomplete_groups": 1}, Skipped("reference", "non-finite reference log-probs"))
    assert dict(skips.by_stage) == {"incomplete_groups": 3, "reward": 1, "reference": 1}
    assert skips.in_a_row == 2 and skips.last == Skipped("reference", "non-finite reference log-probs")
    assert skips.metrics() == {"skipped/incomplete_groups": 3.0, "skipped/reward": 1.0, "skipped/reference": 1.0}
    saved = skips.state_dict()
    back = SkipCounts()
    back.load_state_dict(saved)
    assert back == skips
    back.count({}, None)
    assert back.in_a_row == 0 and back.last == skips.last  # the last skip stays named


def test_a_checkpoint_from_before_the_run_of_skips_was_saved_resumes_its_counts():
    old = SkipCounts()
    old.load_state_dict({"skips": {"no_signal": 4}})
    assert dict(old.by_stage) == {"no_signal": 4} and old.in_a_row == 0 and old.last is None
