"""Exact resume and crash safety of whole training runs (tiny model, CPU, same seed)."""

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


@pytest.mark.slow
def test_sigkill_at_named_points_then_resume(tiny_model_dir, reference_run, tmp_path):
    """The run kills itself (kill_points) mid-step after the backward, inside a save between two
    files, halfway through a metrics line, and with a complete save not yet renamed; it is resumed
    each time and ends where the unbroken run ends, with the same metrics."""
    _, expected = reference_run
    out = tmp_path / "run"
    points = ["step.after_backward", "save.between_files", "metrics.mid_line", "save.before_rename"]
    for attempt, point in enumerate(points):
        start = _latest_step(out)
        target = start + 2  # the step after `start + 1`, which completes with its checkpoint
        env = {**os.environ, "MAXENT_GRPO_LOG": "WARNING", "MAXENT_GRPO_KILL_AT": f"{point}@{target}"}
        args = _args(tiny_model_dir, out, 6) + (["--resume"] if attempt else [])
        proc = subprocess.run([sys.executable, "-m", "maxent_grpo.cli", *args], env=env,
                              stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, timeout=600)
        assert proc.returncode == -signal.SIGKILL, f"{point}@{target}: {proc.stderr[-3000:]}"
        assert _latest_step(out) == target - 1, point
    assert main([*_args(tiny_model_dir, out, 6), "--resume"]) == 0
    assert _comparable(read_metrics(out / "metrics.jsonl")) == expected
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


@pytest.mark.multiprocess
@pytest.mark.slow
@pytest.mark.parametrize("max_staleness", [0, 1])
def test_two_process_run_resumes_exactly(tiny_model_dir, tmp_path, max_staleness):
    """Two gloo processes (torchrun): one record per step, and stop+resume equals an uninterrupted run
    (asynchronous too: each process's batch in flight is restored from the checkpoint)."""
    full, part = tmp_path / "full", tmp_path / "part"
    staleness = f"rollout.max_staleness={max_staleness}"
    proc = _torchrun(_args(tiny_model_dir, full, 4, staleness))
    assert proc.returncode == 0, _rank_errors(proc)
    proc = _torchrun(_args(tiny_model_dir, part, 2, staleness))
    assert proc.returncode == 0, _rank_errors(proc)
    if max_staleness:
        state = json.loads((part / "checkpoints" / "step-2" / "trainer_state.json").read_text())
        assert [[(r["step"], r["version"]) for r in rank] for rank in state["rollouts_in_flight"]] == [[(2, 1)]] * 2
    proc = _torchrun([*_args(tiny_model_dir, part, 4, staleness), "--resume"])
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


@pytest.mark.parametrize("optimizer", ["adamw_fused", "adamw_8bit"])
def test_each_optimizer_checkpoints_and_resumes_exactly(optimizer, tiny_model_dir, reference_run, tmp_path):
    """training.optimizer: a stop-and-resume matches the unbroken run; each optimizer trains its own way
    (the 8-bit one keeps its moments in 8 bits, saved as such)."""
    import torch

    _, adamw = reference_run
    opt = (f"training.optimizer={optimizer}",)
    full, resumed = tmp_path / "full", tmp_path / "resumed"
    assert main(_args(tiny_model_dir, full, 4, *opt)) == 0
    assert main(_args(tiny_model_dir, resumed, 2, *opt)) == 0
    assert main([*_args(tiny_model_dir, resumed, 4, *opt), "--resume"]) == 0
    expected = _comparable(read_metrics(full / "metrics.jsonl"))
    assert _comparable(read_metrics(resumed / "metrics.jsonl"))[2:] == expected[2:]
    state = torch.load(find_latest_checkpoint(full) / "optimizer.pt", weights_only=False)["state"]
    # bitsandbytes saves each parameter's moments under one nested entry (state1/state2 and their scales).
    flat = [v for s in state.values() for v in s.get("__bnb_optimizer_quant_state__", s).values()]
    dtypes = {t.dtype for t in flat if isinstance(t, torch.Tensor) and t.dim() > 0}
    if optimizer == "adamw_8bit":
        assert torch.uint8 in dtypes
        # The first update is sign(g) * lr whatever the moments' precision, so the 8-bit moments show from
        # step 3 on (step 2's loss can equal AdamW's where the CPU kernel quantises step 1 exactly).
        assert [r["loss"] for r in expected[2:]] != [r["loss"] for r in adamw[2:4]]
    else:
        assert dtypes == {torch.float32}
