"""loss.adaptive_entropy in a run: the coefficient each step applies follows the controller on the
run's own measured entropies, it is saved in the checkpoint, and a resumed run goes on exactly;
bad settings are refused naming the key."""

from __future__ import annotations

import json

import pytest

from maxent_grpo.cli import main
from maxent_grpo.core.entropy_control import AdaptiveEntropy, EntropyCoefState, update_entropy_coef
from maxent_grpo.training.metrics import read_metrics
from tiny_runs import tiny_overrides

REWARDS = "[{name: boxed_accuracy}, {name: length, kwargs: {max_length: 100}}]"
SETTINGS = ["method=grpo", "loss.adaptive_entropy=true", "loss.entropy_coef=0.01", "loss.entropy_target=10.0",
            "loss.entropy_coef_delta=0.02", "loss.entropy_coef_max=0.05", "checkpoint.save_steps=2"]


def test_the_applied_coefficients_follow_the_controller_and_resume_exactly(tiny_model_dir, tmp_path):
    full = tmp_path / "full"
    assert main(["train", *tiny_overrides(tiny_model_dir, full, rewards=REWARDS, steps=4, extra=SETTINGS)]) == 0
    rows = read_metrics(full / "metrics.jsonl")
    state, settings = EntropyCoefState(0.01), AdaptiveEntropy(10.0, 0.02, 0.0, 0.05)
    for row in rows:
        assert row["entropy_coef"] == state.applied(settings)
        state = update_entropy_coef(state, row["entropy"], settings)
    saved = json.loads((full / "checkpoints" / "step-2" / "trainer_state.json").read_text())["entropy_control"]
    assert saved["coef"] > 0
    part = tmp_path / "part"
    assert main(["train", *tiny_overrides(tiny_model_dir, part, rewards=REWARDS, steps=2, extra=SETTINGS)]) == 0
    assert main(["train", *tiny_overrides(tiny_model_dir, part, rewards=REWARDS, steps=4, extra=SETTINGS),
                 "--resume"]) == 0
    resumed = read_metrics(part / "metrics.jsonl")
    assert [r["entropy_coef"] for r in resumed] == [r["entropy_coef"] for r in rows]
    assert [r["loss"] for r in resumed] == [r["loss"] for r in rows]


@pytest.mark.parametrize("setting,match", [("loss.entropy_coef_delta=-1", "loss.entropy_coef_delta"),
                                           ("loss.entropy_coef=2.0", "loss.entropy_coef")])
def test_bad_settings_name_the_key(setting, match, tiny_model_dir, tmp_path, capsys):
    extra = ["method=grpo", "loss.adaptive_entropy=true", setting]
    assert main(["train", *tiny_overrides(tiny_model_dir, tmp_path / "run", rewards=REWARDS, extra=extra)]) != 0
    assert match in capsys.readouterr().err
