"""DAPO's soft overlong punishment (``soft_overlong``): Eq. 13's closed form, TRL's function on the
same lengths, and its option checks."""

from __future__ import annotations

import pytest

from maxent_grpo.rewards.registry import build_reward_spec, evaluate_rewards, RewardConfigError

get_soft_overlong_punishment = pytest.importorskip("trl.rewards", reason="trl is not installed (the GPU machine's image)").get_soft_overlong_punishment


def _rewards(lengths, **kwargs):
    spec = build_reward_spec([{"name": "soft_overlong", "kwargs": kwargs}])
    ids = [[7] * n for n in lengths]
    return evaluate_rewards(spec, ["p"] * len(ids), ["c"] * len(ids), {"completion_ids": ids})[:, 0].tolist()


def test_closed_form():
    assert _rewards([0, 80, 81, 90, 100, 101], max_completion_len=100, soft_punish_cache=20) == [
        0.0, 0.0, -1 / 20, -0.5, -1.0, -1.0]


@pytest.mark.parametrize("cache", [0, 1, 20, 99])
def test_equal_to_trl_on_every_length(cache):
    lengths = list(range(0, 131))
    theirs = get_soft_overlong_punishment(max_completion_len=100, soft_punish_cache=cache)(
        completion_ids=[[7] * n for n in lengths])
    assert _rewards(lengths, max_completion_len=100, soft_punish_cache=cache) == pytest.approx(theirs, abs=1e-15)


@pytest.mark.parametrize("kwargs", [{"max_completion_len": 0, "soft_punish_cache": 0},
                                    {"max_completion_len": 10, "soft_punish_cache": 10},
                                    {"max_completion_len": 10, "soft_punish_cache": -1}])
def test_bad_options_name_the_entry(kwargs):
    with pytest.raises((RewardConfigError, ValueError), match="soft_punish_cache|max_completion_len"):
        build_reward_spec([{"name": "soft_overlong", "kwargs": kwargs}])
