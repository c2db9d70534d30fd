"""Exact resume of the state a run carries from step to step: the skip counts (by stage, in a row, the
last), the collapse and constant-reward watches and the controllers (training/train_state.py).

One tiny run (the collapsing model of test_collapse, its answers falling to one token) meets each of
them: a reward function whose judge fails twice on step 3's batches (two skips in a row), a batch
without learning signal, a reward function that gives 0 from step 4 on (the constant-reward warning
at the third such batch) and the collapse warning. The same run is then cut four times: stopped by
``training.max_consecutive_skips`` at the first skip, stopped again by it at once on resuming, stopped
(``--max-steps``) while the constant reward is counting its batches, and killed (SIGKILL) in the step
of the collapse warning, after its backward; each time resumed. It writes what the uninterrupted run
writes: every step's metrics, every checkpoint's trainer state, the tracker's warnings, the weights.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from maxent_grpo.cli import main
from maxent_grpo.training.checkpoint import find_latest_checkpoint, list_checkpoints, read_trainer_state
from maxent_grpo.training.metrics import read_metrics
from tiny_runs import collapsing_model, tiny_overrides

TESTS = Path(__file__).resolve().parents[1]
STEPS = 10
FAILS_AT = 2  # the judge fails on the first two batches drawn for step 3 (trainer_state.global_step 2)
FLAT_FROM = 3  # flat_from gives 0 from step 4's batch on


def _args(model, out, tally, *, steps=STEPS, max_skips=3):
    rewards = ("[{name: length, kwargs: {max_length: 16, direction: favour, unit: tokens}}, "
               f"{{name: 'learnable_rewards:fails_at', weight: 0, kwargs: {{step: {FAILS_AT}, times: 2, tally: '{tally}'}}}}, "
               f"{{name: 'learnable_rewards:flat_from', weight: 0, kwargs: {{step: {FLAT_FROM}}}}}]")
    # test_collapse's settings (the answers collapse within a dozen steps) at four completions per prompt
    # (shapes whose CPU arithmetic repeats bitwise from run to run), a window of one step.
    extra = ["method=maxent_listwise", "maxent.listwise_loss=weighted_mle", "maxent.q_temperature=100",
             "training.learning_rate=1e-3", "logging.collapse_window=1",
             "logging.report_to=[tensorboard]", "checkpoint.save_steps=1", "checkpoint.keep_last=20",
             f"training.max_consecutive_skips={max_skips}"]
    return ["train", *tiny_overrides(model, out, rewards=rewards, steps=steps, max_new_tokens=16, extra=extra)]


def _comparable(rows):
    """Metrics without wall-clock timings."""
    return [{k: v for k, v in r.items() if not k.startswith("time/") and not k.endswith("_time")} for r in rows]


def _states(out) -> dict[int, dict]:
    """Each checkpoint's trainer state but the config (whose step budget and skip limit the cuts change)."""
    return {int(p.name.split("-")[1]): {k: v for k, v in read_trainer_state(p).items() if k != "config"}
            for p in list_checkpoints(out)}


def _warnings(out) -> dict[str, list]:
    """What the tracker (tensorboard, every process's event file) holds of the warnings: each kind's
    ``warnings/<kind>`` steps, and the ``warnings`` table's rows, in step order (event files are read in
    the order of their names, so a file started in the same second by a later process may come first)."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(out / "tensorboard"), size_guidance={"scalars": 0, "tensors": 0},
                              purge_orphaned_data=False)
    events.Reload()
    tags = events.Tags()
    found = {tag: sorted((e.step, e.value) for e in events.Scalars(tag)) for tag in tags["scalars"]
             if tag.startswith("warnings/")}
    found["table"] = sorted((e.step, e.tensor_proto.string_val[0].decode()) for e in events.Tensors("warnings/text_summary"))
    return found


def _first_step(warnings: dict, kind: str) -> int:
    return warnings[f"warnings/{kind}"][0][0]


@pytest.mark.slow
def test_skips_watches_and_warnings_resume_exactly(tiny_model_dir, tmp_path, capsys):
    model = collapsing_model(tiny_model_dir, tmp_path / "model")
    full = tmp_path / "full"
    assert main(_args(model, full, tmp_path / "full-tally")) == 0
    expected, expected_states, expected_warnings = (
        _comparable(read_metrics(full / "metrics.jsonl")), _states(full), _warnings(full))

    # What the uninterrupted run met, and where the cuts below fall: flat_from's constant-reward warning at
    # step `constant` (the run is stopped while its constant batches are counted), the collapse at step
    # `collapse` (the run is killed in that step: the warning must come from the restored watch).
    flat = "learnable_rewards:flat_from"
    said = f"reward '{flat}' gave every completion 0 in each of the last 3 batches, its lowest this run (it gave up to 1 before)"
    constant = next(step for step, table in expected_warnings["table"] if said in table)
    collapse = _first_step(expected_warnings, "collapse")
    assert [r["step"] for r in expected] == list(range(1, STEPS + 1))
    assert expected[FAILS_AT]["skipped/reward"] == 2 and "skipped/reward" not in expected[FAILS_AT - 1]
    assert _first_step(expected_warnings, "no_signal") == 1
    assert FAILS_AT + 1 < constant - 1 < collapse - 1 < STEPS, (constant, collapse)
    assert expected_states[constant - 1]["watches"]["constant_rewards"]["runs"][flat] == [0.0, 2]
    assert flat not in expected_states[constant - 1]["watches"]["constant_rewards"]["said"]
    assert [step for step, _ in expected_warnings["warnings/collapse"]] == [collapse]
    assert expected_states[collapse]["watches"]["collapse"]["holding"]

    out, tally = tmp_path / "cut", tmp_path / "cut-tally"
    capsys.readouterr()
    # The first skip stops the run (max_consecutive_skips=1), with a checkpoint holding it.
    assert main(_args(model, out, tally, max_skips=1)) == 1
    assert "1 batches in a row failed" in capsys.readouterr().err
    stopped = read_trainer_state(out / "checkpoints" / f"step-{FAILS_AT}")
    assert (stopped["skips"], stopped["skips_in_a_row"]) == ({**expected_states[FAILS_AT]["skips"], "reward": 1}, 1)
    assert stopped["last_skip"] == ["reward", "reward function 'learnable_rewards:fails_at': raised RuntimeError: "
                                              f"judge unreachable at step {FAILS_AT} (failure 1)"]
    saved = (out / "checkpoints" / f"step-{FAILS_AT}" / "trainer_state.json").read_text()

    # Resumed with a limit of 2, the second failure is the second in a row: the run stops at once, its
    # checkpoint untouched (it trained no step), and the batch is tried again on the next resume.
    resume = ["--resume", "--allow-config-change"]
    assert main([*_args(model, out, tally, max_skips=2), *resume]) == 1
    assert f"2 batches in a row failed (training.max_consecutive_skips=2) at step {FAILS_AT}" in capsys.readouterr().err
    assert (out / "checkpoints" / f"step-{FAILS_AT}" / "trainer_state.json").read_text() == saved
    tally.write_text("1")

    # Stopped while flat_from's constant batches are counted, then killed in the step of the collapse.
    assert main([*_args(model, out, tally, steps=constant - 1), *resume]) == 0
    env = {**os.environ, "MAXENT_GRPO_LOG": "WARNING", "MAXENT_GRPO_KILL_AT": f"step.after_backward@{collapse}",
           "PYTHONPATH": os.pathsep.join([str(TESTS), *os.environ.get("PYTHONPATH", "").split(os.pathsep)])}
    proc = subprocess.run([sys.executable, "-m", "maxent_grpo.cli", *_args(model, out, tally), "--resume"], env=env,
                          stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, timeout=900)
    assert proc.returncode == -signal.SIGKILL, proc.stderr[-3000:]
    assert find_latest_checkpoint(out).name == f"step-{collapse - 1}"
    assert main([*_args(model, out, tally), "--resume"]) == 0

    assert _comparable(read_metrics(out / "metrics.jsonl")) == expected
    states = _states(out)
    assert sorted(states) == sorted(expected_states) == list(range(1, STEPS + 1))
    # step-2 is the stopped run's (after the first skip), every other one the state of the same step.
    assert states.pop(FAILS_AT)["skips_in_a_row"] == 1 and expected_states.pop(FAILS_AT)["skips_in_a_row"] == 0
    for step, state in states.items():
        assert state == expected_states[step], step
    assert states[STEPS]["skips"] == expected_states[STEPS]["skips"] and states[STEPS]["last_skip"][1].endswith("(failure 2)")
    assert _warnings(out) == expected_warnings
    final = Path("checkpoints") / f"step-{STEPS}" / "model.safetensors"
    assert (out / final).read_bytes() == (full / final).read_bytes()
    assert json.loads(tally.read_text()) == 2
