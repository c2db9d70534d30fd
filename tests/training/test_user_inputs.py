"""Bad input gives one line and a non-zero exit; a user's own rewards and data work first try."""

from __future__ import annotations

import asyncio
import json
import os
import shutil
import subprocess
import sys
import threading
from pathlib import Path

import pytest

from maxent_grpo.cli import main
from maxent_grpo.rewards.registry import RewardFunctionError, build_reward_spec, evaluate_rewards
from maxent_grpo.config.load import load_config
from maxent_grpo.config.schema import TrainConfig
from maxent_grpo.training.metrics import read_metrics

REPO = Path(__file__).resolve().parents[2]
TINY = ["--set", "generation.max_new_tokens=4", "--set", "generation.num_generations=2",
        "--set", "training.prompts_per_step=1", "--set", "training.micro_batch_size=2",
        "--set", "logging.progress_bar=false"]


def _one_line_exit(capsys, argv, code=None) -> str:
    got = main(argv)
    err = capsys.readouterr().err.strip()
    assert got != 0, err
    if code is not None:
        assert got == code
    last = err.splitlines()[-1]
    assert last.startswith("maxent-grpo: ") and "Traceback" not in err, err
    return last


@pytest.fixture
def bad_inputs(tmp_path, tiny_model_dir):
    (tmp_path / "tab.yaml").write_text("method: grpo\ndata:\n\tsource: x\n")
    (tmp_path / "bad.jsonl").write_text('{"prompt": "a", "answer": "1"}\n{"prompt": "b", "answer": \n')
    (tmp_path / "wizard.jsonl").write_text('{"prompt": [{"role": "wizard", "content": "hi"}], "answer": "1"}\n' * 4)
    (tmp_path / "ok.jsonl").write_text("".join(f'{{"prompt": "q{i}", "answer": "{i}"}}\n' for i in range(4)))
    (tmp_path / "a_file").write_text("in the way")
    envs = ["calculator", None, "nope", "calculator"]
    (tmp_path / "envs.jsonl").write_text("".join(
        f'{{"prompt": "q{i}", "answer": "{i}", "environment": {json.dumps(e)}}}\n' for i, e in enumerate(envs)))
    broken = tmp_path / "broken-model"
    shutil.copytree(tiny_model_dir, broken)
    weights = broken / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[: weights.stat().st_size // 2])
    return tmp_path


CASES = {
    "yaml-tab": (["--config", "{d}/tab.yaml"], r"tab.yaml line 3: invalid YAML: found character '\t'"),
    "jsonl-line": (["--set", "data.source={d}/bad.jsonl"], "bad.jsonl line 2: invalid JSON"),
    "chat-role": (["--set", "data.source={d}/wizard.jsonl"], "row 0 has a message with role 'wizard'"),
    "output-is-a-file": (["--output-dir", "{d}/a_file"], "a_file is a file, not a folder"),
    "truncated-weights": (
        ["--set", "data.source={d}/ok.jsonl", "--set", "model.name_or_path={d}/broken-model"],
        "broken-model/model.safetensors): Error while deserializing header",
    ),
    "unknown-reward-module": (["--set", "rewards=[no_such_rewards:f]"], "no module 'no_such_rewards'"),
    "missing-reward-file": (["--set", "rewards=[{d}/none.py:f]"], "none.py not found"),
    "more-prompts-than-rows": (
        ["--set", "data.source={d}/ok.jsonl", "--set", "training.prompts_per_step=8"],
        "training.prompts_per_step: 8 prompts x 1 process(es) per step is more than the 4 training rows",
    ),
    "row-environment": (["--set", "data.source={d}/envs.jsonl", "--set", "environment.name=calculator"],
                        "row 2: column 'environment' names 'nope', which is no environment; registered: calculator"),
    "environment-column-unset": (["--set", "data.source={d}/envs.jsonl"],
                                 "environment.name: the dataset {d}/envs.jsonl has an 'environment' column"),
    "unknown-environment": (["--set", "environment.name=calculatr"],
                            "environment.name: no environment 'calculatr' (did you mean 'calculator'?)"),
    "episode-tokens": (["--set", "environment.name=calculator", "--set", "environment.max_episode_tokens=2"],
                       "environment.max_episode_tokens: must be >= the model's tokens over all turns"),
    "negative-timeout": (["--set", "rewards=[{{name: format, timeout_s: -1}}]"], "rewards[0].timeout_s: must be > 0"),
    # A bound of the listwise losses' own record names the maxent: key it comes from.
    "listwise-clip": (["--set", "maxent.listwise_clip_coef=-1"], "maxent.listwise_clip_coef: must be >= 0, got -1.0"),
    "max-steps-null": (["--set", "training.max_steps=null"],
                       "training.max_steps: null counts the run in passes over the data: set data.num_epochs"),
    "two-warm-ups": (["--set", "training.warmup_steps=2", "--set", "training.warmup_ratio=0.1"],
                     "training.warmup_ratio: give warmup_steps or warmup_ratio, not both"),
    "adapter-sync-without-lora": (["--set", "generation.vllm.lora_sync=adapter"],
                                  "generation.vllm.lora_sync: adapter sends a LoRA policy's adapter to a vLLM backend; "
                                  "it needs model.lora.enabled and generation.backend vllm or vllm_server, got backend "
                                  "hf with model.lora.enabled=False"),
    "adapter-sync-rank": (["--set", "model.lora.enabled=true", "--set", "model.lora.r=1024",
                           "--set", "generation.backend=vllm", "--set", "generation.vllm.lora_sync=adapter"],
                          "model.lora.r: 1024 is above the largest rank vLLM's LoRA engine takes (512)"),
    "ray-address-on-the-local-plane": (
        ["--set", "rollout.transferqueue_ray_address=127.0.0.1:6379"],
        "rollout.transferqueue_ray_address: joins a Ray cluster for the TransferQueue plane; it needs "
        "rollout.data_plane: transferqueue, got local"),
    "ray-address-without-ray": (
        ["--set", "rollout.data_plane=transferqueue", "--set", "rollout.transferqueue_ray=false",
         "--set", "rollout.transferqueue_ray_address=auto"],
        "rollout.transferqueue_ray_address: joins a Ray cluster for TransferQueue's Ray actors; it needs "
        "rollout.transferqueue_ray: true"),
    "ray-address-without-port": (["--set", "rollout.transferqueue_ray_address=headnode"],
                                 "rollout.transferqueue_ray_address: must be HOST:PORT"),
    "fp32-head-under-lora": (["--set", "model.lora.enabled=true", "--set", "model.lm_head_fp32=true",
                              "--set", "model.lora.target_modules=[q_proj,lm_head]"],
                             "model.lm_head_fp32: the float32 head cannot be a LoRA-wrapped head"),
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_bad_input_is_one_line_and_a_non_zero_exit(case, bad_inputs, capsys):
    args, message = CASES[case]
    argv = ["train", "--output-dir", str(bad_inputs / "out"), *TINY,
            *[a.format(d=bad_inputs) for a in args]]
    assert message.format(d=bad_inputs) in _one_line_exit(capsys, argv)
    assert not (bad_inputs / "out" / "metrics.jsonl").exists()


@pytest.mark.skipif(os.geteuid() == 0, reason="root writes into read-only folders")
def test_a_read_only_output_folder_is_one_line(tmp_path, capsys):
    folder = tmp_path / "ro"
    folder.mkdir(mode=0o555)
    assert "is not writable" in _one_line_exit(capsys, ["train", "--output-dir", str(folder)])


def test_an_internal_bug_keeps_its_traceback(tmp_path):
    """A ValueError from inside the code is a bug, not bad input: it is not shortened to one line."""
    code = (
        "import sys; import maxent_grpo.training.loop as loop\n"
        "def broken(*a, **k): raise ValueError('internal invariant')\n"
        "loop.build_run = broken\n"
        "from maxent_grpo.cli import main; sys.exit(main(['train', '--output-dir', sys.argv[1]]))\n"
    )
    proc = subprocess.run([sys.executable, "-c", code, str(tmp_path / "o")], capture_output=True, text=True)
    assert proc.returncode == 1 and "Traceback" in proc.stderr and "ValueError: internal invariant" in proc.stderr


# ---------------------------------------------------------------- configs start from the default run


def test_a_config_file_starts_from_the_default_run_and_the_few_shot_stays_with_the_default_task(tmp_path):
    default = load_config()
    assert default == TrainConfig()  # the schema's defaults are the built-in run, nothing layered on top
    assert default.data.few_shot and default.data.task_kwargs  # the default task's own
    (tmp_path / "mine.yaml").write_text("data:\n  source: mine.jsonl\nrewards: [format]\n")
    mine = load_config(tmp_path / "mine.yaml")
    assert mine.generation == default.generation and mine.maxent == default.maxent and mine.loss == default.loss
    assert mine.training == default.training
    assert mine.data.few_shot == [] and mine.data.task_kwargs == {}
    assert load_config(overrides=["data.source=other.jsonl"]).data.few_shot == []
    kept = load_config(overrides=["data.source=other.jsonl", "data.few_shot=[{prompt: a, completion: b}]"])
    assert [(e.prompt, e.completion) for e in kept.data.few_shot] == [("a", "b")]


def test_help_shows_the_default_runs_values(capsys):
    with pytest.raises(SystemExit):
        main(["train", "--help"])
    out = capsys.readouterr().out
    assert f"generation.max_new_tokens  [int, default {TrainConfig().generation.max_new_tokens}]" in out
    assert "maxent.listwise_loss  [cross_entropy|weighted_mle|centered_mle, default 'centered_mle']" in out
    assert "7 + 1 = \\\\boxed{8}" in out


# ---------------------------------------------------------------- the user's own reward functions


def test_a_reward_module_beside_the_config_imports_from_any_folder(tmp_path, monkeypatch):
    project = tmp_path / "project"
    project.mkdir()
    (project / "judge_rewards.py").write_text("def one(completions, **kw):\n    return [1.0] * len(completions)\n")
    (project / "run.yaml").write_text("rewards: [{name: 'judge_rewards:one'}, {name: 'judge_rewards.py:one'}]\n")
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    monkeypatch.chdir(elsewhere)
    cfg = load_config(project / "run.yaml")
    assert [r.name for r in cfg.rewards] == [f"{project / 'judge_rewards.py'}:one"] * 2
    # Two entries of one function: the spec refuses the duplicate, under the names metrics use.
    with pytest.raises(ValueError, match="judge_rewards.py:one"):
        build_reward_spec(cfg.rewards)
    spec = build_reward_spec(cfg.rewards[:1])
    assert spec.names == ("judge_rewards.py:one",)
    assert evaluate_rewards(spec, ["p"], ["c"], {}).tolist() == [[1.0]]


def test_a_reward_module_in_the_current_folder_imports(tmp_path, monkeypatch):
    (tmp_path / "cwd_rewards_mod.py").write_text("def two(completions, **kw):\n    return [2.0] * len(completions)\n")
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(sys, "path", [p for p in sys.path if p not in ("", str(tmp_path))])
    spec = build_reward_spec(["cwd_rewards_mod:two"])
    assert evaluate_rewards(spec, ["p"], ["c"], {}).tolist() == [[2.0]]


def test_async_rewards_are_awaited_concurrently_and_timeouts_fail_the_batch(tmp_path):
    # Each waits for the other: this returns only if both run at the same time.
    both = {"a": asyncio.Event, "b": asyncio.Event}
    events: dict = {}

    def waiter(me, other):
        async def reward(completions, **kw):
            events.setdefault(me, both[me]()).set()
            while other not in events:
                await asyncio.sleep(0.001)
            await events[other].wait()
            return [1.0] * len(completions)
        return reward

    from maxent_grpo.rewards.registry import RewardSpec

    spec = RewardSpec(("a", "b"), (waiter("a", "b"), waiter("b", "a")), (1.0, 1.0), (5.0, 5.0))
    assert evaluate_rewards(spec, ["p"], ["c"], {}).tolist() == [[1.0, 1.0]]

    released = threading.Event()

    def hangs(completions, **kw):
        released.wait()
        return [0.0]

    slow = RewardSpec(("hangs",), (hangs,), (1.0,), (0.2,))
    with pytest.raises(RewardFunctionError, match=r"reward function 'hangs': did not return within timeout_s=0.2 s"):
        evaluate_rewards(slow, ["p"], ["c"], {})
    released.set()


def test_the_answer_column_reaches_rewards_under_its_own_name(tmp_path, tiny_model_dir, capsys):
    (tmp_path / "rows.jsonl").write_text("".join(f'{{"question": "q{i}", "solution": {i}}}\n' for i in range(4)))
    (tmp_path / "sol_rewards.py").write_text(
        "def needs_solution(completions, solution, answer, **kw):\n"
        "    assert [str(s) for s in solution] == answer\n"
        "    return [float(s) + len(c) / 100 for s, c in zip(solution, completions)]\n"
    )
    (tmp_path / "run.yaml").write_text(
        f"model: {{name_or_path: {tiny_model_dir}}}\n"
        "data: {source: rows.jsonl, prompt_column: question, answer_column: solution}\n"
        "rewards: ['sol_rewards:needs_solution']\n"
    )
    out = tmp_path / "out"
    assert main(["train", "--config", str(tmp_path / "run.yaml"), "--output-dir", str(out), "--max-steps", "1",
                 "--set", "generation.max_new_tokens=4", "--set", "generation.num_generations=2",
                 "--set", "training.prompts_per_step=2", "--set", "training.micro_batch_size=2",
                 "--set", "logging.progress_bar=false"]) == 0
    assert read_metrics(out / "metrics.jsonl")[0]["step"] == 1


@pytest.mark.slow
def test_the_worked_example_runs_from_another_folder(tmp_path, tiny_model_dir):
    """examples/: a reward file, a JSONL and a YAML, run as the README says (with the tiny model)."""
    env = {**os.environ, "MAXENT_GRPO_LOG": "WARNING"}
    proc = subprocess.run(
        [sys.executable, "-m", "maxent_grpo.cli", "train", "--config", str(REPO / "examples" / "my_run.yaml"),
         "--output-dir", str(tmp_path / "out"), "--max-steps", "2",
         "--set", f"model.name_or_path={tiny_model_dir}", "--set", "generation.max_new_tokens=8",
         "--set", "logging.progress_bar=false"],
        cwd=tmp_path, env=env, capture_output=True, text=True, timeout=600,
    )
    assert proc.returncode == 0, proc.stderr
    assert "done: 2 steps" in proc.stdout and "maxent-grpo eval" in proc.stdout
    rows = read_metrics(tmp_path / "out" / "metrics.jsonl")
    assert [r["step"] for r in rows] == [1, 2]
    assert "rewards/my_rewards.py:exact_solution/mean" in rows[0]
