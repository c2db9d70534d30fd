"""Verified mode replay wired into a run (training/replay.py, methods/replay.py): the redr and remax
methods on a ModeBench task through the CLI, the bank's metrics, the bank in every checkpoint and
a resume that changes a replay setting, refused in one line; replay on a task without mode keys
refused before any model loads."""

from __future__ import annotations

import json

import pytest

from maxent_grpo.cli import main
from maxent_grpo.training.metrics import read_metrics
from tiny_runs import tiny_overrides

SOURCE = "modebench_pkg:countdown"


def _args(model_dir, out, steps, *extra):
    return tiny_overrides(model_dir, out, rewards="[{name: modebench_pkg}]", steps=steps, source=SOURCE,
                          extra=["checkpoint.save_steps=1", *extra])


@pytest.mark.parametrize("method", ["redr", "remax"])
def test_a_replay_run_logs_its_bank_and_checkpoints_it(method, tiny_model_dir, tmp_path):
    out = tmp_path / "run"
    assert main(["train", *_args(tiny_model_dir, out, 2, f"method={method}")]) == 0
    rows = read_metrics(out / "metrics.jsonl")
    for key in ("bank/prompts", "bank/modes", "bank/exemplars", "bank/new_modes", "bank/disagreements",
                "bank/capacity_dropped", "bank/support_ge2_frac", "time/replay_admission"):
        assert key in rows[-1], key
    # What replay costs: seconds of its passes (0 while the bank is empty) and its share of the step.
    for row in rows:
        assert row["replay/time_s"] >= 0.0 and 0.0 <= row["replay/time_share"] <= 1.0
        assert ("replay/groups" in row) or row["replay/time_s"] == 0.0
        if "replay/groups" in row:
            assert row["replay/time_s"] > 0.0
        assert row["replay/time_s"] <= row["time/policy"] + row["time/optimizer"]
    state = json.loads((out / "checkpoints" / "step-2" / "trainer_state.json").read_text())
    assert state["replay"]["bank"]["groups_scored"] == 2 * 2  # two prompts a step, two steps
    assert state["replay"]["bank"]["rows_scored"] == 2 * 2 * 4


def test_a_resume_with_another_replay_setting_is_refused(tiny_model_dir, tmp_path, capsys):
    out = tmp_path / "run"
    assert main(["train", *_args(tiny_model_dir, out, 1, "method=redr")]) == 0
    capsys.readouterr()
    code = main(["train", *_args(tiny_model_dir, out, 2, "method=redr", "replay.compute_only=true"), "--resume",
                 "--allow-config-change"])
    assert code != 0
    err = capsys.readouterr().err.strip().splitlines()
    assert any("replay.compute_only" in line and "would change what the run samples or trains on" in line
               for line in err), err


def test_replay_without_mode_keys_is_a_config_error(tiny_model_dir, tmp_path, capsys):
    args = tiny_overrides(tiny_model_dir, tmp_path / "run", rewards="[{name: boxed_accuracy}]", extra=["method=redr"])
    assert main(["train", *args]) != 0
    assert "replay.enabled: needs a task whose verifier gives mode keys" in capsys.readouterr().err


def test_each_completion_reaches_the_verifier_once_a_step(tiny_model_dir, tmp_path, monkeypatch):
    """The reward, the answer keys and replay admission share the batch's grades
    (``tasks.modebench_package.Grades``): no (task, completion) is graded twice in a step."""
    api = pytest.importorskip("modebench.api", reason="modebench is not installed (the GPU machine's image)")
    calls, real = [], api.grade

    def grade(task, response):
        calls.append((task.id, response))
        return real(task, response)

    monkeypatch.setattr(api, "grade", grade)
    out = tmp_path / "run"
    assert main(["train", *tiny_overrides(tiny_model_dir, out, rewards="[{name: modebench_pkg}]", steps=1,
                                          source=SOURCE, extra=["method=redr"])]) == 0
    assert calls and len(calls) == len(set(calls))
    assert len(calls) <= 2 * 4  # two prompts of four completions: at most one call each
