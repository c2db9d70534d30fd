"""Exact resume and crash safety of whole training runs (tiny model, CPU, same seed)."""

from __future__ import annotations

import json
import os
import random
import signal
import subprocess
import sys
import time

import pytest

from maxent_grpo.cli import main
from maxent_grpo.training.checkpoint import find_latest_checkpoint
from maxent_grpo.training.metrics import read_metrics


def _args(model_dir, out, steps, *extra):
    sets = [
        f"model.name_or_path={model_dir}", "data.source=reasoning_gym:chain_sum", "data.size=64",
        "generation.num_generations=4", "generation.max_new_tokens=8", "training.prompts_per_step=2",
        "training.micro_batch_size=4", "logging.progress_bar=false", "checkpoint.save_steps=1",
        "generation.dtype=null", "training.autocast_bf16=false", "data.task_kwargs={}",
        "checkpoint.keep_last=2", "training.learning_rate=0.01", "loss.beta=0.04",
        "rewards=[{name: length, kwargs: {max_length: 100}}]", *extra,
    ]
    return ["train", "--output-dir", str(out), "--max-steps", str(steps), "--seed", "3",
            *[a for s in sets for a in ("--set", s)]]


def _comparable(rows):
    """Metrics without wall-clock timings."""
    return [{k: v for k, v in r.items() if not k.startswith("time/") and not k.endswith("_time")} for r in rows]


@pytest.fixture(scope="module")
def reference_run(tiny_model_dir, tmp_path_factory):
    out = tmp_path_factory.mktemp("ref") / "run"
    assert main(_args(tiny_model_dir, out, 6)) == 0
    return out, _comparable(read_metrics(out / "metrics.jsonl"))


@pytest.mark.parametrize("method", ["maxent_listwise"])
def test_stop_and_resume_writes_the_same_metrics(method, tiny_model_dir, reference_run, tmp_path):
    _, expected = reference_run
    out = tmp_path / "run"
    assert main(_args(tiny_model_dir, out, 3)) == 0
    assert main([*_args(tiny_model_dir, out, 6), "--resume"]) == 0
    got = _comparable(read_metrics(out / "metrics.jsonl"))
    assert [r["step"] for r in got] == [1, 2, 3, 4, 5, 6]
    assert got[3:] == expected[3:]


def test_resume_is_exact_with_the_default_bf16_sampling_copy_and_autocast(tiny_model_dir, tmp_path):
    """The packaged default samples from a bf16 copy and trains under bf16 autocast:
    a repeat of the run and a stop-and-resume both match the unbroken run exactly."""
    bf16 = ("generation.dtype=bfloat16", "training.autocast_bf16=true")
    full, again, resumed = tmp_path / "full", tmp_path / "again", tmp_path / "resumed"
    assert main(_args(tiny_model_dir, full, 4, *bf16)) == 0
    assert main(_args(tiny_model_dir, again, 4, *bf16)) == 0
    assert main(_args(tiny_model_dir, resumed, 2, *bf16)) == 0
    assert main([*_args(tiny_model_dir, resumed, 4, *bf16), "--resume"]) == 0
    expected = _comparable(read_metrics(full / "metrics.jsonl"))
    assert _comparable(read_metrics(again / "metrics.jsonl")) == expected
    assert _comparable(read_metrics(resumed / "metrics.jsonl"))[2:] == expected[2:]


def _latest_step(out) -> int:
    latest = find_latest_checkpoint(out)
    return int(latest.name.split("-")[1]) if latest is not None else 0


def _kill_when(proc, ready, delay: float = 0.0) -> bool:
    """SIGKILL ``proc`` ``delay`` seconds after ``ready()`` first holds; False if it exited first."""
    while proc.poll() is None:
        if ready():
            time.sleep(delay)
            if proc.poll() is None:
                proc.kill()
                return True
            return False
        time.sleep(0.002)
    return False


@pytest.mark.slow
def test_sigkill_at_random_moments_then_resume(tiny_model_dir, reference_run, tmp_path):
    """Kill the run at moments chosen by what it is doing, not by the clock (a fast machine
    finishes before any fixed delay): at a random point of the step after a checkpoint
    (generation, backward, metrics), and while a checkpoint is being written. Resume each time."""
    ref_dir, expected = reference_run
    step_time = max(r["step_time"] for r in read_metrics(ref_dir / "metrics.jsonl"))
    out, ckpts = tmp_path / "run", tmp_path / "run" / "checkpoints"
    rng = random.Random(0)
    env = {**os.environ, "MAXENT_GRPO_LOG": "WARNING"}
    plans = ["mid-step", "mid-save", "mid-step", "mid-save"]
    kills = 0
    for attempt in range(len(plans) + 1):
        args = _args(tiny_model_dir, out, 6) + (["--resume"] if attempt else [])
        start = _latest_step(out)
        proc = subprocess.Popen([sys.executable, "-m", "maxent_grpo.cli", *args], env=env,
                                stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
        if attempt < len(plans) and plans[attempt] == "mid-step":
            kills += _kill_when(proc, lambda: (ckpts / f"step-{start + 1}").is_dir(), rng.uniform(0, step_time))
        elif attempt < len(plans):
            # The folder a save is being written into carries the writer's pid.
            kills += _kill_when(proc, lambda: any(ckpts.glob(f".tmp-step-*-{proc.pid}")))
        _, err = proc.communicate(timeout=600)
        if proc.returncode == 0:
            break
        assert proc.returncode == -signal.SIGKILL, err
    else:
        pytest.fail("the run never completed")
    assert kills >= 3, f"only {kills} of the kills landed before the run finished"
    got = _comparable(read_metrics(out / "metrics.jsonl"))
    assert got == expected
    assert find_latest_checkpoint(out).name == "step-6"


def _torchrun(args, timeout=600):
    env = {**os.environ, "MAXENT_GRPO_LOG": "WARNING", "OMP_NUM_THREADS": "1"}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
           "-m", "maxent_grpo.cli", *args]
    return subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=timeout)


def _rank_errors(proc) -> str:
    """The workers' own error lines: torchrun's summary at the end of stderr hides them."""
    lines = [ln for ln in proc.stderr.splitlines() if "Error" in ln or "error:" in ln]
    return "\n".join(lines[:20]) or proc.stderr[-2000:]


@pytest.mark.slow
def test_two_process_run_resumes_exactly(tiny_model_dir, tmp_path):
    """Two gloo processes (torchrun): one record per step, and stop+resume equals an uninterrupted run."""
    full, part = tmp_path / "full", tmp_path / "part"
    proc = _torchrun(_args(tiny_model_dir, full, 4))
    assert proc.returncode == 0, _rank_errors(proc)
    proc = _torchrun(_args(tiny_model_dir, part, 2))
    assert proc.returncode == 0, _rank_errors(proc)
    proc = _torchrun([*_args(tiny_model_dir, part, 4), "--resume"])
    assert proc.returncode == 0, _rank_errors(proc)
    expected = _comparable(read_metrics(full / "metrics.jsonl"))
    assert [r["step"] for r in expected] == [1, 2, 3, 4]
    assert _comparable(read_metrics(part / "metrics.jsonl")) == expected
    assert '"world_size": 2' in (full / "run_info.json").read_text()
    # Every process's completions reach the table (2 prompts x 4 completions each); the end
    # of the run is announced once.
    for step in (1, 4):
        rows = [json.loads(line) for line in (full / "completions" / f"step-{step}.jsonl").read_text().splitlines()]
        assert [r["rank"] for r in rows] == [0] * 8 + [1] * 8
    assert proc.stdout.count("done: 4 steps") == 1


def test_reference_run_actually_trains(reference_run):
    """Guards the resume tests against comparing runs in which nothing moves."""
    _, rows = reference_run
    assert all(r["grad_norm"] > 0 for r in rows)
    assert all(r["frac_reward_zero_std"] < 1 for r in rows)
