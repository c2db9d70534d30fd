"""rollout.max_staleness with the in-process sampler (hf): which weights sample each batch, the
staleness the run logs, the decoupled objective's reduction, and exact resume of a run whose
checkpoint holds batches not yet trained on (tiny model, CPU, fp32)."""

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
from tiny_runs import tiny_overrides


def _args(model_dir, out, steps, *extra, lr="0.01"):
    return ["train", "--seed", "3", *tiny_overrides(
        model_dir, out, rewards="[{name: length, kwargs: {max_length: 100}}]", steps=steps,
        extra=["data.size=64", "checkpoint.save_steps=1", "checkpoint.keep_last=3", f"training.learning_rate={lr}",
               "loss.beta=0.04", *extra],
    )]


def _comparable(rows):
    return [{k: v for k, v in r.items() if not k.startswith("time/") and not k.endswith("_time")} for r in rows]


def _metrics(out):
    return read_metrics(out / "metrics.jsonl")


@pytest.fixture(scope="module")
def async_run(tiny_model_dir, tmp_path_factory):
    out = tmp_path_factory.mktemp("async") / "run"
    assert main(_args(tiny_model_dir, out, 5, "rollout.max_staleness=1")) == 0
    return out, _comparable(_metrics(out))


def test_each_batch_is_sampled_by_the_weights_k_steps_back(async_run):
    out, rows = async_run
    # Batches 0 and 1 come from the first weights; batch s from version s - 1 after that.
    assert [r["async/version"] for r in rows] == [0, 0, 1, 2, 3]
    assert [r["async/staleness_max"] for r in rows] == [0, 1, 1, 1, 1]
    assert all(r["async/dropped_stale"] == 0 for r in rows)
    # k >= 1: the auto correction weighs the stale samples (the sampler is not the trained weights).
    assert all("sampling/importance_sampling_ratio/mean" in r for r in rows)
    # The final checkpoint (step 5) holds batch 5, sampled by version 4 and not yet trained on.
    state = json.loads((out / "checkpoints" / "step-5" / "trainer_state.json").read_text())
    (held,) = state["rollouts_in_flight"]
    assert [(r["step"], r["version"]) for r in held] == [(5, 4)]


def test_with_frozen_weights_stale_batches_are_the_synchronous_ones(tiny_model_dir, tmp_path):
    """Learning rate 0: every version is the same weights, so k = 0, 1 and 2 train on the very same
    completions (each batch keeps its own seed whenever it is sampled) and, the proximal anchor
    being the sampler, the decoupled loss equals the synchronous one up to the sampler's rounding."""
    runs = {}
    for k in (0, 1, 2):
        out = tmp_path / f"k{k}"
        assert main(_args(tiny_model_dir, out, 4, f"rollout.max_staleness={k}", "loss.beta=0",
                          "loss.rollout_correction=token_truncate", lr="0")) == 0
        runs[k] = _metrics(out)
    for k in (1, 2):
        assert [r["async/staleness_max"] for r in runs[k]] == [min(s, k) for s in range(4)]
        for sync, stale in zip(runs[0], runs[k]):
            assert stale["reward"] == sync["reward"]
            assert stale["completions/mean_length"] == sync["completions/mean_length"]
            assert stale["loss"] == pytest.approx(sync["loss"], rel=1e-4, abs=1e-6)


def test_stop_and_resume_restores_the_batches_in_flight(tiny_model_dir, async_run, tmp_path):
    _, expected = async_run
    out = tmp_path / "run"
    assert main(_args(tiny_model_dir, out, 2, "rollout.max_staleness=1")) == 0
    assert main([*_args(tiny_model_dir, out, 5, "rollout.max_staleness=1"), "--resume"]) == 0
    assert _comparable(_metrics(out)) == expected


def test_sigkill_mid_step_then_resume_matches_the_uninterrupted_run(tiny_model_dir, async_run, tmp_path):
    _, expected = async_run
    out = tmp_path / "run"
    env = {**os.environ, "MAXENT_GRPO_LOG": "WARNING", "MAXENT_GRPO_KILL_AT": "step.after_backward@4"}
    proc = subprocess.run([sys.executable, "-m", "maxent_grpo.cli", *_args(tiny_model_dir, out, 5, "rollout.max_staleness=1")],
                          env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, timeout=600)
    assert proc.returncode == -signal.SIGKILL, proc.stderr[-3000:]
    assert find_latest_checkpoint(out).name == "step-3"
    assert main([*_args(tiny_model_dir, out, 5, "rollout.max_staleness=1"), "--resume"]) == 0
    assert _comparable(_metrics(out)) == expected


def test_uncorrected_stale_samples_are_refused(tiny_model_dir, tmp_path, capsys):
    code = main(_args(tiny_model_dir, tmp_path / "run", 2, "rollout.max_staleness=1", "loss.rollout_correction=none"))
    assert code != 0
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "config error: loss.rollout_correction: none leaves samples" in err[0]


def test_a_sampler_that_never_answers_is_named_with_what_was_awaited():
    """The wait for a batch sampled beside the trainer names, on timeout, the step, its partition on the
    data plane, the weights version sampling it, and whether the sampling thread is still at it (the
    endless wait of verl#7155 is bounded here by rollout.wait_timeout_s; its message must say what hung)."""
    import threading

    from maxent_grpo.training.rollout_queue import RolloutsLost, _Job

    release = threading.Event()
    job = _Job(6, 4, make_draft=None, work=lambda: release.wait())  # no draft: it is never sampled again
    with pytest.raises(RolloutsLost) as err:
        job.wait(0.05)
    release.set()
    message = str(err.value)
    assert message.startswith("no rollouts for step 7 (partition train/6, sampled by weights version 4) after 0 s "
                              "(rollout.wait_timeout_s): the sampling thread is alive")
    assert job.wait(60) is True  # once the work returns, the result is handed over
