"""TRL scripts run with only their import line changed (tests/front/scripts/): TRL's quick start, a longer script with a LoraConfig, a closure reward, a
conversational dataset and an environment class, and that script under a 2-process torchrun."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

SCRIPTS = Path(__file__).parent / "scripts"
pytestmark = pytest.mark.slow  # each runs a whole (tiny) training in a fresh interpreter


def _env(tmp_path: Path) -> dict:
    return {**os.environ, "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1", "TRL_EXPERIMENTAL_SILENCE": "1",
            "MAXENT_GRPO_LOG": "WARNING"}


def _run(cmd: list[str], cwd: Path, timeout: int = 600) -> subprocess.CompletedProcess:
    done = subprocess.run(cmd, cwd=cwd, env=_env(cwd), capture_output=True, text=True, timeout=timeout)
    assert done.returncode == 0, f"{cmd} failed:\n{done.stdout[-3000:]}\n{done.stderr[-5000:]}"
    return done


def _read_jsonl(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def test_trl_quickstart(tiny_model_dir, tmp_path):
    # TRL's quick start as its documentation writes it (GRPOTrainer(model, reward_funcs, train_dataset), no
    # args): TRL's defaults decide the run. (TRL itself refuses this script on a CPU: its default bf16 needs
    # a GPU or use_cpu.)
    assert "from maxent_grpo import GRPOTrainer" in (SCRIPTS / "trl_quickstart.py").read_text()
    _run([sys.executable, str(SCRIPTS / "trl_quickstart.py"), str(tiny_model_dir)], tmp_path)
    # output_dir "<model>-GRPO"; 3 epochs of 1 prompt x 8 completions (per_device_train_batch_size 8,
    # num_generations 8) over 2 rows; completions up to 512 tokens (max_completion_length).
    out = tmp_path / f"{tiny_model_dir.name}-GRPO"
    rows = _read_jsonl(out / "metrics.jsonl")
    assert [r["step"] for r in rows] == [1, 2, 3, 4, 5, 6]
    assert all(r["rewards/reward_len/mean"] <= 0 for r in rows)
    config = (out / "config.yaml").read_text()
    for line in ("name: python:reward_len", "source: python:train_dataset", "num_generations: 8",
                 "max_new_tokens: 512", "learning_rate: 1.0e-06", "num_epochs: 3"):
        assert line in config, line


def _check_longer_run(out: Path, stdout: str, world_size: int) -> None:
    history = json.loads(next(line for line in stdout.splitlines() if line.startswith("LOG_HISTORY "))[12:])
    rows = _read_jsonl(out / "metrics.jsonl")
    assert [r["step"] for r in rows] == [1, 2]
    # log_history: each step's metrics as TRL names them, with epoch and step, then the run's totals.
    assert [h["step"] for h in history] == [1, 2, 2]
    for h, r in zip(history, rows):
        assert h["rewards/correct/mean"] == pytest.approx(r["rewards/correct/mean"])
        assert h["loss"] == pytest.approx(r["loss"]) and "kl" in h and "learning_rate" in h
    assert history[0]["epoch"] == pytest.approx(2 * world_size / 16)  # 2 prompts a process per step, 16 rows
    assert set(history[-1]) >= {"train_runtime", "train_loss", "step"}
    # The closure's name, the environment's reward column, a reward's log_metric.
    assert {"rewards/token_length/mean", "rewards/environment/mean", "seen_step"} <= set(rows[0])
    assert [r["seen_step"] for r in rows] == [0.0, 1.0]  # trainer_state.global_step before each update
    info = json.loads((out / "run_info.json").read_text())
    assert info["world_size"] == world_size and info["method"] == "grpo"
    config = (out / "config.yaml").read_text()
    for line in ("loss_type: dr_grpo", "beta: 0.04", "enabled: true", "r: 8", "prompts_per_step: 2",
                 "Scratchpad: python:Scratchpad", "weight: 0.5", "lr_scheduler: cosine"):
        assert line in config, line
    assert (out / "checkpoints" / "step-1").is_dir()  # save_steps 1
    final = out / "final"
    assert (final / "adapter_config.json").is_file() and (final / "tokenizer_config.json").is_file()
    assert not (final / "optimizer.pt").exists()
    # evaluate(): this library's evaluation of the trained adapter on 3 of the rows, named as TRL names metrics.
    evaluated = json.loads(next(line for line in stdout.splitlines() if line.startswith("EVAL "))[5:])
    assert {"eval_pass@1", "eval_greedy_pass@1", "eval_rewards/correct/mean", "eval_num_prompts"} <= set(evaluated)
    assert evaluated["eval_num_prompts"] == 3.0
    assert (out / "eval" / "trainer-step-2" / "summary.json").is_file()


def test_longer_trl_script(tiny_model_dir, tmp_path):
    out = tmp_path / "run"
    done = _run([sys.executable, str(SCRIPTS / "trl_longer.py"), str(tiny_model_dir), str(out)], tmp_path)
    _check_longer_run(out, done.stdout, world_size=1)


@pytest.mark.multiprocess
def test_longer_trl_script_under_torchrun(tiny_model_dir, tmp_path):
    out = tmp_path / "run"
    torchrun = Path(sys.executable).parent / "torchrun"
    done = _run([str(torchrun), "--standalone", "--nproc_per_node", "2", str(SCRIPTS / "trl_longer.py"),
                 str(tiny_model_dir), str(out)], tmp_path)
    _check_longer_run(out, done.stdout, world_size=2)
