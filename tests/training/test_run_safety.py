"""A run a researcher can leave alone: signals, failing stages, one run per folder, resume checks.

Whole runs of the tiny model through the real CLI (in-process, or as a
subprocess where a signal, a second process or a resource limit is the point).
"""

from __future__ import annotations

import os
import resource
import shlex
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from maxent_grpo.cli import main
from maxent_grpo.training.checkpoint import find_latest_checkpoint, list_checkpoints, read_trainer_state, verify_checkpoint
from maxent_grpo.training.metrics import read_metrics

TESTS = Path(__file__).resolve().parents[1]


def _args(model_dir, out, steps, *extra, reward="length, kwargs: {max_length: 100}"):
    sets = [
        f"model.name_or_path={model_dir}", "data.source=reasoning_gym:chain_sum", "data.size=64",
        "generation.num_generations=4", "generation.max_new_tokens=8", "training.prompts_per_step=2",
        "training.micro_batch_size=4", "logging.progress_bar=false", "generation.dtype=null",
        "training.autocast_bf16=false", "data.task_kwargs={}", "training.learning_rate=0.01",
        # The default run's cadence: no step checkpoints, the timer far off (tests must not race it).
        "checkpoint.save_steps=0", "checkpoint.save_minutes=0", "checkpoint.keep_last=3",
        f"rewards=[{{name: {reward}}}]", *extra,
    ]
    return ["train", "--output-dir", str(out), "--max-steps", str(steps), "--seed", "5",
            *[a for s in sets for a in ("--set", s)]]


def _comparable(rows):
    return [{k: v for k, v in r.items() if not k.startswith("time/") and not k.endswith("_time")} for r in rows]


def _env():
    return {**os.environ, "MAXENT_GRPO_LOG": "WARNING", "PYTHONPATH": f"{TESTS}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}


def _spawn(args, **kwargs):
    return subprocess.Popen([sys.executable, "-m", "maxent_grpo.cli", *args], env=_env(), cwd=TESTS,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, **kwargs)


def _lines(path: Path) -> int:
    return len(path.read_text().splitlines()) if path.is_file() else 0


@pytest.fixture(scope="module")
def reference(tiny_model_dir, tmp_path_factory):
    out = tmp_path_factory.mktemp("ref") / "run"
    assert main(_args(tiny_model_dir, out, 5)) == 0
    return _comparable(read_metrics(out / "metrics.jsonl"))


@pytest.mark.slow
@pytest.mark.parametrize("signals", [1, 2], ids=["ctrl-c", "ctrl-c-twice"])
def test_ctrl_c_saves_a_checkpoint_and_resume_equals_the_uninterrupted_run(
    signals, tiny_model_dir, reference, tmp_path, capsys
):
    """With no step checkpoints configured, Ctrl-C still leaves one and prints the resume command;
    twice in a row abandons the step in progress (or finishes it, inside the update)."""
    out = tmp_path / "run"
    proc = _spawn(_args(tiny_model_dir, out, 5))
    while _lines(out / "metrics.jsonl") < 2 and proc.poll() is None:
        time.sleep(0.01)
    for _ in range(signals):
        proc.send_signal(signal.SIGINT)
        time.sleep(0.05)
    _, err = proc.communicate(timeout=300)
    assert proc.returncode == 130, err
    assert "interrupted" in err and "resume with: maxent-grpo train" in err, err
    ckpt = find_latest_checkpoint(out)
    assert ckpt is not None and f"checkpoint {ckpt}" in err
    command = shlex.split(err.split("resume with: ")[1].splitlines()[0])
    assert command[:2] == ["maxent-grpo", "train"] and command[-1] == "--resume"
    assert main(command[1:]) == 0
    assert _comparable(read_metrics(out / "metrics.jsonl")) == reference


def test_a_reward_failing_from_step_3_stops_the_run_with_a_checkpoint(tiny_model_dir, tmp_path, capsys):
    out = tmp_path / "run"
    code = main(_args(
        tiny_model_dir, out, 20, "training.max_consecutive_skips=3",
        reward="learnable_rewards:fails_after, kwargs: {calls: 2}",
    ))
    err = capsys.readouterr().err
    assert code == 1
    assert "3 batches in a row failed" in err and "judge unreachable" in err and "at step 2" in err
    assert [p.name for p in list_checkpoints(out)] == ["step-2"] and f"checkpoint {out}/checkpoints/step-2" in err
    assert [r["step"] for r in read_metrics(out / "metrics.jsonl")] == [1, 2]
    # The run of skips is saved with it: a resumed run goes on counting where this one stopped.
    saved = read_trainer_state(out / "checkpoints" / "step-2")
    assert (saved["skips"], saved["skips_in_a_row"]) == ({"reward": 3}, 3)
    assert saved["last_skip"][0] == "reward" and "judge unreachable (call 5)" in saved["last_skip"][1]


def test_no_values_are_never_logged_as_zero_and_signal_less_batches_are_counted(tiny_model_dir, tmp_path, capsys, caplog):
    out = tmp_path / "run"
    assert main(_args(tiny_model_dir, out, 3, "training.max_consecutive_skips=2", reward="learnable_rewards:always_none")) == 1
    err = capsys.readouterr().err
    assert "every reward function returned None for all 8 completions" in err
    assert read_metrics(out / "metrics.jsonl") == []  # no step was taken, and none logged with reward 0
    # Identical rewards in every group (a constant reward): no learning signal. Counted and warned
    # about, never a failure (a model that has mastered its task gets such batches as well).
    out2 = tmp_path / "constant"
    assert main(_args(tiny_model_dir, out2, 3, "training.max_consecutive_skips=2",
                      reward="learnable_rewards:always_one")) == 0
    rows = read_metrics(out2 / "metrics.jsonl")
    assert [r["skipped/no_signal"] for r in rows] == [1.0, 2.0, 3.0] and [r["reward"] for r in rows] == [1.0] * 3
    assert "no learning signal: every group's completions got the same reward" in caplog.text


def test_a_used_folder_is_refused_unless_resume_or_overwrite(tiny_model_dir, tmp_path, capsys):
    out = tmp_path / "run"
    assert main(_args(tiny_model_dir, out, 1)) == 0
    before = (out / "metrics.jsonl").read_text()
    capsys.readouterr()
    assert main(_args(tiny_model_dir, out, 1)) == 1
    err = capsys.readouterr().err
    assert "holds a previous run (config.yaml, metrics.jsonl, checkpoints)" in err and "--overwrite" in err
    assert (out / "metrics.jsonl").read_text() == before  # untouched
    (out / "checkpoints" / "step-7").mkdir()  # an old run's leftovers
    assert main([*_args(tiny_model_dir, out, 1), "--overwrite"]) == 0
    assert [p.name for p in list_checkpoints(out)] == ["step-1"]


def test_two_runs_cannot_share_a_folder(tiny_model_dir, tmp_path, capsys):
    out = tmp_path / "run"
    holder = subprocess.Popen(
        [sys.executable, "-c", "import sys, time; from pathlib import Path; "
         "from maxent_grpo.training.run_dir import claim_output_dir; "
         "lock = claim_output_dir(Path(sys.argv[1]), resume=False, overwrite=False); print('held', flush=True); time.sleep(3600)",
         str(out)], stdout=subprocess.PIPE, text=True,
    )
    try:
        assert holder.stdout.readline().strip() == "held"
        assert main(_args(tiny_model_dir, out, 1)) == 1
        err = capsys.readouterr().err
        assert f"is in use by pid {holder.pid} on host" in err and ".lock" in err
        assert not (out / "metrics.jsonl").exists()
    finally:
        holder.kill()
        holder.wait()
    assert main(_args(tiny_model_dir, out, 1)) == 0  # the kernel dropped the dead holder's lock


def test_resume_refuses_changes_that_break_it_and_records_allowed_ones(tiny_model_dir, tmp_path, capsys):
    out = tmp_path / "run"
    assert main(_args(tiny_model_dir, out, 2)) == 0
    capsys.readouterr()
    assert main([*_args(tiny_model_dir, out, 4, "generation.num_generations=2"), "--resume"]) == 1
    assert "--resume: generation.num_generations: 4 -> 2 would change" in capsys.readouterr().err
    assert main([*_args(tiny_model_dir, out, 4, "training.learning_rate=0.02"), "--resume"]) == 1
    assert "training.learning_rate: 0.01 -> 0.02 differs" in capsys.readouterr().err
    assert [r["step"] for r in read_metrics(out / "metrics.jsonl")] == [1, 2]  # the refusals changed nothing
    assert main([*_args(tiny_model_dir, out, 4, "training.learning_rate=0.02"), "--resume", "--allow-config-change"]) == 0
    config = (out / "config.yaml").read_text()
    assert config.startswith("# resumed at step 2: training.learning_rate: 0.01 -> 0.02; training.max_steps: 2 -> 4\n")
    assert "learning_rate: 0.02" in config


def test_resume_takes_new_server_addresses_and_waits_without_being_told(tiny_model_dir, tmp_path):
    """Where the run's servers are and how long it waits for them do not change what it learns: a restart
    against a replacement server or a cluster at another address resumes as it is."""
    out = tmp_path / "run"
    assert main(_args(tiny_model_dir, out, 2)) == 0
    free = ["training.dist_timeout_minutes=30", "rollout.wait_timeout_s=600", "generation.vllm.server_wait_s=60",
            "generation.vllm.server_url=http://10.0.0.2:8000", "generation.vllm.request_timeout_s=120"]
    assert main([*_args(tiny_model_dir, out, 3, *free), "--resume"]) == 0
    assert [r["step"] for r in read_metrics(out / "metrics.jsonl")] == [1, 2, 3]


def test_a_failing_save_keeps_the_previous_checkpoint_and_says_which(tiny_model_dir, tmp_path):
    """A file-size limit makes the final save fail as a full disk would (EFBIG instead of ENOSPC)."""
    out = tmp_path / "run"
    assert main(_args(tiny_model_dir, out, 2)) == 0
    previous = find_latest_checkpoint(out)
    limit = (previous / "model.safetensors").stat().st_size // 2

    def small_files():
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # a write past the limit then fails with EFBIG
        resource.setrlimit(resource.RLIMIT_FSIZE, (limit, limit))

    proc = _spawn([*_args(tiny_model_dir, out, 3), "--resume"], preexec_fn=small_files)
    _, err = proc.communicate(timeout=300)
    assert proc.returncode == 1, err
    last = err.strip().splitlines()[-1]
    assert last.startswith("maxent-grpo: error: could not save the checkpoint of step 3: ") and "File too large" in last
    assert f"the latest complete checkpoint is {previous}" in last
    assert verify_checkpoint(previous) and [p.name for p in list_checkpoints(out)] == ["step-2"]


def test_a_hanging_reward_cannot_stop_the_run(tiny_model_dir, tmp_path, capsys):
    """rewards[].timeout_s: each hung call fails its batch; the run stops, bounded, with the reason."""
    out = tmp_path / "run"
    code = main(_args(tiny_model_dir, out, 3, "training.max_consecutive_skips=2",
                      reward="learnable_rewards:hangs, timeout_s: 0.5"))
    err = capsys.readouterr().err
    assert code == 1
    assert "2 batches in a row failed" in err and "reward function 'learnable_rewards:hangs': did not return within timeout_s=0.5 s" in err
