"""Resuming an asynchronous run (``rollout.max_staleness: 2``, the in-process sampler, tiny model, fp32):
killed mid-step with two batches in flight, and resumed with a smaller ``max_staleness``, so that the
batches it restores are too stale and are dropped.

The failures these guard against were reported by peers in 2026: a dropped batch froze the saved data
position for the rest of the run (trl#7274), and version counters that did not come back with the
in-flight batches let staleness climb past its bound after recovery (AReaL#1388).
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys

import pytest

from maxent_grpo.cli import main
from maxent_grpo.training.checkpoint import find_latest_checkpoint
from maxent_grpo.training.metrics import read_metrics
from tiny_runs import read_jsonl, tiny_overrides

STEPS = 6


def _args(model_dir, out, *extra, steps=STEPS):
    return ["train", "--seed", "5", *tiny_overrides(
        model_dir, out, rewards="[{name: length, kwargs: {max_length: 100}}]", steps=steps,
        extra=["data.size=64", "checkpoint.save_steps=1", "checkpoint.keep_last=10", "training.learning_rate=0.01",
               "loss.beta=0.04", *extra],
    )]


def _comparable(out):
    rows = read_metrics(out / "metrics.jsonl")
    return [{k: v for k, v in r.items() if not k.startswith("time/") and not k.endswith("_time")} for r in rows]


def _state(out, step):
    return json.loads((out / "checkpoints" / f"step-{step}" / "trainer_state.json").read_text())


def _killed(model_dir, out, point, *extra):
    env = {**os.environ, "MAXENT_GRPO_LOG": "WARNING", "MAXENT_GRPO_KILL_AT": point}
    proc = subprocess.run([sys.executable, "-m", "maxent_grpo.cli", *_args(model_dir, out, *extra)], env=env,
                          stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, timeout=600)
    assert proc.returncode == -signal.SIGKILL, proc.stderr[-3000:]


def _trained_prompts(out, step):
    return {row["prompt"] for row in read_jsonl(out / "completions" / f"step-{step}.jsonl")}


@pytest.fixture(scope="module")
def k2_run(tiny_model_dir, tmp_path_factory):
    out = tmp_path_factory.mktemp("k2") / "run"
    assert main(_args(tiny_model_dir, out, "rollout.max_staleness=2")) == 0
    return out, _comparable(out)


@pytest.fixture(scope="module")
def k2_then_k1(tiny_model_dir, tmp_path_factory):
    """Three steps at k = 2, then resumed with k = 1 to the end: the uninterrupted counterpart of the
    same change made twice over a kill."""
    out = tmp_path_factory.mktemp("k2k1") / "run"
    assert main(_args(tiny_model_dir, out, "rollout.max_staleness=2", steps=3)) == 0
    assert main([*_args(tiny_model_dir, out, "rollout.max_staleness=1"), "--resume", "--allow-config-change"]) == 0
    return out, _comparable(out)


def test_k2_keeps_two_batches_in_flight_each_from_two_versions_back(k2_run):
    out, rows = k2_run
    assert [r["async/version"] for r in rows] == [0, 0, 0, 1, 2, 3]
    assert [r["async/staleness_max"] for r in rows] == [0, 1, 2, 2, 2, 2]
    held = _state(out, 3)["rollouts_in_flight"][0]
    assert [(r["step"], r["version"]) for r in held] == [(3, 1), (4, 2)]


def test_killed_mid_step_with_two_batches_in_flight_resumes_as_if_never_stopped(tiny_model_dir, k2_run, tmp_path):
    _, expected = k2_run
    out = tmp_path / "run"
    _killed(tiny_model_dir, out, "step.after_backward@4", "rollout.max_staleness=2")
    assert find_latest_checkpoint(out).name == "step-3"
    assert main([*_args(tiny_model_dir, out, "rollout.max_staleness=2"), "--resume"]) == 0
    assert _comparable(out) == expected  # metrics, logged versions and staleness, every step


def test_a_smaller_bound_on_resume_drops_what_is_too_stale_and_never_trains_past_it(k2_run, k2_then_k1):
    (k2_out, k2_rows), (out, rows) = k2_run, k2_then_k1
    assert rows[:3] == k2_rows[:3]
    # Restored batches 3 (version 1) and 4 (version 2) are two versions old by their step: both are
    # dropped and sampled again by the current weights; batch 5 is the first sampled one step ahead.
    assert [r["async/version"] for r in rows[3:]] == [3, 4, 4]
    assert [r["async/staleness_max"] for r in rows[3:]] == [0, 0, 1]
    assert [r["async/dropped_stale"] for r in rows] == [0, 0, 0, 1, 2, 2]
    # The data position moves on through the drops (trl#7274): each checkpoint's is past the last one's,
    # and no prompt is trained twice in the epoch (the dropped batches' prompts are not trained at all).
    positions = [_state(out, s)["sampler"]["position"] for s in range(1, STEPS + 1)]
    assert positions == sorted(positions) and len(set(positions)) == STEPS
    trained = [_trained_prompts(out, s) for s in range(1, STEPS + 1)]
    assert len(set().union(*trained)) == sum(len(p) for p in trained)
    # After the change a checkpoint holds only the next batch, with the version that sampled it: the
    # version logged when it is trained (AReaL#1388), unless it is too stale and dropped (batch 4).
    held = {s: _state(out, s)["rollouts_in_flight"][0] for s in range(4, STEPS)}
    assert {s: [r["step"] for r in h] for s, h in held.items()} == {4: [4], 5: [5]}
    assert held[4][0]["version"] == 2 and held[5][0]["version"] == rows[5]["async/version"]

def test_a_kill_after_the_smaller_bound_resumes_as_the_uninterrupted_change(tiny_model_dir, k2_then_k1, tmp_path):
    _, expected = k2_then_k1
    out = tmp_path / "run"
    assert main(_args(tiny_model_dir, out, "rollout.max_staleness=2", steps=3)) == 0
    env = {**os.environ, "MAXENT_GRPO_LOG": "WARNING", "MAXENT_GRPO_KILL_AT": "step.after_backward@5"}
    proc = subprocess.run(
        [sys.executable, "-m", "maxent_grpo.cli", *_args(tiny_model_dir, out, "rollout.max_staleness=1"),
         "--resume", "--allow-config-change"],
        env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, timeout=600)
    assert proc.returncode == -signal.SIGKILL, proc.stderr[-3000:]
    assert find_latest_checkpoint(out).name == "step-4"
    assert _state(out, 4)["rollouts_dropped_stale"] == 1
    assert main([*_args(tiny_model_dir, out, "rollout.max_staleness=1"), "--resume"]) == 0
    assert _comparable(out) == expected
