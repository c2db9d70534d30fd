"""One optimizer step of our trainer equals TRL's GRPOTrainer step (``benchmarks/update_parity.py``).

Same tiny model, same rollouts (prompts, completion ids, rewards), gradient clipping
active, three micro-batches of unequal completion lengths: the clipped gradients agree
to float32 rounding and so do the parameter changes (Adam's first step amplifies a
rounding difference in a gradient element near eps, hence the looser bound on them).
The conventions where the two differ are pinned with their numbers.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

pytest.importorskip("trl")
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # benchmarks/ is not part of the package

from benchmarks.update_parity import CASES, LEARNING_RATE, compare  # noqa: E402

pytestmark = pytest.mark.slow  # a TRL trainer per case, about two seconds each
CASE = {case.name: case for case in CASES}


@pytest.mark.parametrize("name", [
    "dapo", "grpo", "dr_grpo", "bnpo",  # the four normalisers, over 3 micro-batches
    "dapo-fp64",  # TRL's fused LM head accumulates in float32: the same float32 floor
    "betas-0.8-0.95-2steps",  # the betas act from the second step on
    "linear-warmup3-2steps",  # lr 0 then lr/3 on both sides
    "weight-decay-0.1",  # both decay the 2-D weights only (biases and norm gains are exempt)
])
def test_one_step_matches_trl(name, tiny_model_dir):
    row = compare(CASE[name], tiny_model_dir)
    assert row["lrs_ours"] == pytest.approx(row["lrs_trl"], rel=1e-12, abs=0)
    assert row["clipped"] and row["grad_norm_ours"] == pytest.approx(row["grad_norm_trl"], rel=1e-5)
    assert row["advantage_max_abs"] < 1e-6  # TRL's rewards and advantages are float32
    assert row["grad_rel"] < 2e-6
    assert row["delta_rel"] < 1e-4 and row["delta_norm_trl"] > 0.05


def test_the_conventions_that_differ_from_trl(tiny_model_dir):
    # TRL's "constant" schedule ignores warmup_steps; ours warms up (HF's warmup applies lr 0 at step 1).
    row = compare(CASE["constant-warmup3-trl-constant"], tiny_model_dir)
    assert (row["lrs_ours"], row["lrs_trl"]) == ([0.0], [LEARNING_RATE])
    # bnpo normalises each micro-batch by its own tokens: TRL's random split changes the step.
    row = compare(CASE["bnpo-trl-shuffle"], tiny_model_dir)
    assert row["grad_rel"] > 1e-2
