"""End-to-end training through the CLI on a tiny model: every recipe, learning, bad inputs."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from maxent_grpo.cli import main
from maxent_grpo.methods import METHODS
from maxent_grpo.config.load import ConfigError, load_config, parse_override
from maxent_grpo.training.metrics import read_metrics
from tiny_runs import compiled
from tiny_runs import tiny_overrides as tiny_run_args

REPO = Path(__file__).resolve().parents[2]
# The *-fsdp2 recipes are for several GPUs (torchrun); test_sharding.py loads them. The *-1gpu ones
# sample with a vLLM engine in sleep mode, which needs CUDA: they run here with HF generation.
RECIPES = sorted(p for p in (REPO / "recipes").glob("*.yaml") if not p.stem.endswith("-fsdp2"))
# One recipe per registered method, named after it.
METHOD_RECIPES = [p for p in RECIPES if p.stem in METHODS]


# A reward that varies on random text, so groups are never all-equal.
REWARDS = "[{name: boxed_accuracy}, {name: length, kwargs: {max_length: 100}}]"


# MaxRL needs 0/1 rewards: its recipe runs on its own reward set (boxed_accuracy alone).
BINARY_REWARDS = "[{name: boxed_accuracy}]"


def tiny_overrides(model_dir, out, *, steps=2, extra=(), rewards=REWARDS):
    return tiny_run_args(model_dir, out, rewards=rewards, steps=steps, extra=extra)


def test_every_method_recipe_is_present():
    assert {p.stem for p in METHOD_RECIPES} == set(METHODS)
    for recipe in METHOD_RECIPES:
        assert load_config(recipe).method == recipe.stem


@pytest.mark.parametrize("recipe", RECIPES, ids=[p.stem for p in RECIPES])
def test_recipe_runs_two_steps(recipe, tiny_model_dir, tmp_path):
    out = tmp_path / "run"
    extra = ["generation.backend=hf"] if recipe.stem.endswith("-1gpu") else []
    cfg = load_config(recipe)
    binary = cfg.loss.advantage_estimator == "maxrl"
    # Replay needs a task whose verifier gives mode keys: the recipe's own ModeBench task.
    source = cfg.data.source if cfg.replay.enabled else "reasoning_gym:chain_sum"
    if cfg.teacher.name_or_path is not None:  # the distillation recipe's teacher: the tiny model (same tokenizer)
        extra.append(f"teacher.name_or_path={tiny_model_dir}")
    assert main(["train", "--config", str(recipe), *tiny_run_args(
        tiny_model_dir, out, extra=extra, rewards=BINARY_REWARDS if binary else REWARDS, steps=2, source=source)]) == 0
    rows = read_metrics(out / "metrics.jsonl")
    assert [r["step"] for r in rows] == [1, 2]
    for key in ("reward", "reward_std", "frac_reward_zero_std", "loss", "entropy", "clip_ratio/low_mean",
                "clip_ratio/high_mean", "completions/mean_length", "completions/clipped_ratio",
                "learning_rate", "grad_norm", "step_time", "time/generate", "time/reward",
                "time/reference", "time/policy", "time/optimizer", "rewards/boxed_accuracy/mean"):
        assert key in rows[-1], key
    info = json.loads((out / "run_info.json").read_text())
    assert info["method"] == json.loads(json.dumps(__import__("yaml").safe_load(recipe.read_text())["method"]))
    assert info["family"] in ("grpo", "maxent") and info["policy_loss"]
    if info["family"] == "maxent":
        assert "tau" in rows[-1] and "beta" in rows[-1]
    if info["weighting"] == "listwise":
        assert "weight_entropy" in rows[-1]
    if info["needs_reference"]:
        assert "kl" in rows[-1]
    if cfg.teacher.name_or_path is not None:
        assert "distill/kl" in rows[-1] and "time/teacher" in rows[-1]
    if binary:
        assert {"maxrl/success_rate", "maxrl/no_success_frac", "maxrl/adv_max"} <= set(rows[-1])
    assert (out / "config.yaml").is_file()
    assert (out / "completions" / "step-2.jsonl").is_file()


def test_maxrl_run_logs_its_metrics_and_skips_non_binary_rewards(tiny_model_dir, tmp_path, capsys):
    """ALGORITHMS.md §16: a binary reward that varies on random text gives MaxRL advantages, logged as
    maxrl/*; a non-binary reward set is refused batch by batch, naming the value and its row."""
    out = tmp_path / "run"
    assert main(["train", *tiny_overrides(tiny_model_dir, out, extra=["method=maxrl"],
                                          rewards="[{name: 'learnable_rewards:parity'}]")]) == 0
    rows = read_metrics(out / "metrics.jsonl")
    for row in rows:
        assert 0 < row["maxrl/success_rate"] < 1 and 0 <= row["maxrl/no_success_frac"] < 1
        # The largest advantage is (G_v - K)/K for some group with 0 < K < G_v = 4: 3, 1 or 1/3.
        assert row["maxrl/adv_max"] in (3.0, 1.0, pytest.approx(1 / 3)), row["maxrl/adv_max"]
    bad = tmp_path / "bad"
    capsys.readouterr()
    assert main(["train", *tiny_overrides(tiny_model_dir, bad, extra=["method=maxrl", "training.max_consecutive_skips=1"],
                                          rewards="[{name: 'learnable_rewards:shortness'}]")]) == 1
    assert re.search(r"maxrl needs binary rewards .*: row \d+ has reward 0\.\d+", capsys.readouterr().err)


def test_meta_controller_steers_tau_and_beta_in_a_run(tiny_model_dir, tmp_path):
    """maxent.meta_lr_*: every step tau <- tau - lr_tau (H - H*) on the logged weight entropy,
    beta <- beta + lr_beta clip(KL - KL*, +-g) on the logged KL (ALGORITHMS.md §8)."""
    out = tmp_path / "run"
    lr_tau, lr_beta, h_star, kl_star, clip = 0.3, 2.0, 0.5, 0.01, 0.05
    assert main(["train", *tiny_overrides(tiny_model_dir, out, steps=3, extra=[
        "method=maxent_listwise", "loss.beta=0.1", "maxent.tau=0.5", f"maxent.tau_target_entropy={h_star}",
        f"maxent.kl_target={kl_star}", f"maxent.meta_lr_tau={lr_tau}", f"maxent.meta_lr_beta={lr_beta}",
        f"maxent.meta_grad_clip={clip}"])]) == 0
    rows = read_metrics(out / "metrics.jsonl")
    tau, beta = 0.5, 0.1
    for row in rows:
        tau = max(0.0, tau - lr_tau * (row["weight_entropy"] - h_star))
        beta = max(0.0, beta + lr_beta * min(max(row["kl"] - kl_star, -clip), clip))
        assert (row["tau"], row["beta"]) == (pytest.approx(tau, rel=1e-6), pytest.approx(beta, rel=1e-6))
    assert rows[-1]["tau"] != 0.5 and rows[-1]["beta"] != 0.1


@pytest.mark.slow
@pytest.mark.parametrize("method", ["grpo", "maxent_listwise"])
def test_tiny_model_learns(method, tiny_model_dir, tmp_path):
    """A reward a random tiny model can learn (end the completion early) rises within a minute."""
    out = tmp_path / "run"
    args = tiny_overrides(tiny_model_dir, out, steps=16, extra=[
        f"method={method}",
        "rewards=[{name: 'learnable_rewards:shortness'}]",
        "generation.max_new_tokens=16",
        "generation.num_generations=8",
        "training.prompts_per_step=4",
        "training.micro_batch_size=8",
        "training.learning_rate=0.01",
        "loss.dynamic_sampling=false",
        # rewards here span [0, 1]: a sharper q gives the listwise target a clear preference.
        "maxent.q_temperature=0.1",
    ])
    assert main(["train", *args]) == 0
    rewards = [r["reward"] for r in read_metrics(out / "metrics.jsonl")]
    first, last = sum(rewards[:4]) / 4, sum(rewards[-4:]) / 4
    assert last > first + 0.3, rewards


def _cli(args, cwd):
    env = {**os.environ, "MAXENT_GRPO_LOG": "WARNING"}
    env.pop("MAXENT_GRPO_DEBUG", None)
    return subprocess.run(
        [sys.executable, "-m", "maxent_grpo.cli", *args], cwd=cwd, env=env,
        capture_output=True, text=True, timeout=300,
    )


def _one_line_error(proc, *needles):
    assert proc.returncode != 0
    assert "Traceback" not in proc.stderr, proc.stderr
    lines = [ln for ln in proc.stderr.splitlines() if ln.startswith("maxent-grpo:")]
    assert len(lines) == 1, proc.stderr
    for n in needles:
        assert n in lines[0], (n, lines[0])


@pytest.mark.parametrize("sets, needles", [
    (["loss.betta=0.1"], ["loss.betta", "loss.beta"]),
    (["loss.beta=lots"], ["loss.beta"]),
    (["method=grpp"], ["method", "grpo"]),
    (["loss.loss_type=dpo"], ["loss.loss_type"]),
    (["generation.num_generations=1"], ["generation.num_generations"]),
    (["training.batch_size=10"], ["training.batch_size", "num_generations"]),
    # Bounds the core checks too, caught here before any model loads (issue 13).
    (["loss.epsilon=1.0"], ["loss.epsilon", "(0, 1)"]),
    (["loss.epsilon_high=0.28", "loss.delta=1.2"], ["loss.delta", "1 + epsilon_high = 1.28"]),
    (["maxent.tau=.inf"], ["maxent.tau", "finite"]),
    # Advantage estimators that are their own scaling (ALGORITHMS.md §2, §16).
    (["method=maxrl", "loss.scale_rewards=group"], ["loss.scale_rewards", "none", "maxrl"]),
    (["loss.advantage_estimator=reinforce_pp"], ["loss.scale_rewards", "none", "reinforce_pp"]),
])
def test_bad_config_one_line_error(sets, needles, tmp_path):
    proc = _cli(["train", "--output-dir", str(tmp_path / "o"), *[a for s in sets for a in ("--set", s)]], tmp_path)
    _one_line_error(proc, *needles)
    assert not (tmp_path / "o" / "metrics.jsonl").exists()


@pytest.mark.parametrize("sets, message", [
    # The core's settings records hold these bounds; the config builds them before any model
    # loads and names the key the user wrote (config/compile.py).
    ({"maxent.tau_lr": -1.0}, "maxent.tau_lr: must be a finite number >= 0"),
    ({"maxent.tau_min": 2.0, "maxent.tau_max": 1.0}, "maxent.tau_min: must be <= the maximum, got 2.0 > 1.0"),
    ({"maxent.tau_target_final": 1.0}, "maxent.tau_target_final: needs a start value, the target entropy"),
    ({"maxent.q_epsilon": 1.0}, "maxent.q_epsilon: must be in [0, 1)"),
    ({"maxent.q_temperature": 0.0}, "maxent.q_temperature: must be a finite number > 0"),
    ({"maxent.kl_target": float("nan")}, "maxent.kl_target: must be finite"),
    ({"maxent.meta_every": 0}, "maxent.meta_every: must be >= 1"),
    ({"maxent.meta_lr_beta": -0.1}, "maxent.meta_lr_beta: must be a finite number >= 0"),
    ({"loss.beta": -0.1}, "loss.beta: must be a finite number >= 0"),
])
def test_maxent_bounds_are_the_core_records_and_name_the_key(sets, message):
    with pytest.raises(ConfigError) as err:
        compiled(None, sets)
    assert str(err.value).startswith(message), str(err.value)


@pytest.mark.parametrize("text, expected", [
    ("loss.beta=0.04", ("loss.beta", 0.04)),
    ("data.task_kwargs={min_terms: 2}", ("data.task_kwargs", {"min_terms": 2})),
    ("rewards=[a, b]", ("rewards", ["a", "b"])),
    ("data.system_prompt=null", ("data.system_prompt", None)),
    # A colon followed by a space would make a YAML block mapping: keep the typed string.
    ("data.instruction=Like this: 2 + 3 = \\boxed{5}", ("data.instruction", "Like this: 2 + 3 = \\boxed{5}")),
    ("data.instruction=a: b: c", ("data.instruction", "a: b: c")),
    ("data.instruction=- item", ("data.instruction", "- item")),
])
def test_set_values_parse_as_yaml_scalars_or_flow_collections(text, expected):
    assert parse_override(text) == expected


def test_set_with_broken_flow_collection_is_a_config_error():
    with pytest.raises(ConfigError, match="data.task_kwargs"):
        parse_override("data.task_kwargs={min_terms: 2")


def test_bad_inputs_one_line_errors(tiny_model_dir, tmp_path):
    base = tiny_overrides(tiny_model_dir, tmp_path / "o")
    empty = tmp_path / "empty.jsonl"
    empty.write_text("")
    nocol = tmp_path / "nocol.jsonl"
    nocol.write_text(json.dumps({"question": "1+1?", "answer": "2"}) + "\n")
    cases = [
        (["data.source=" + str(tmp_path / "missing.jsonl")], ["missing.jsonl"]),
        (["data.source=" + str(nocol)], ["prompt"]),
        (["data.source=" + str(empty)], ["empty"]),
        (["model.name_or_path=" + str(tmp_path / "no-model")], ["no-model"]),
        (["rewards=[{name: acuracy}]"], ["acuracy", "accuracy"]),
    ]
    for sets, needles in cases:
        proc = _cli(["train", *base, *[a for s in sets for a in ("--set", s)]], tmp_path)
        _one_line_error(proc, *needles)


@pytest.mark.parametrize("fn, needles", [
    ("wrong_count", ["wrong_count", "9 values for 8 completions"]),
    ("returns_nan", ["returns_nan"]),
    ("raises", ["raises"]),
])
def test_failing_reward_stops_the_run_when_every_batch_fails(fn, needles, tiny_model_dir, tmp_path):
    base = tiny_overrides(tiny_model_dir, tmp_path / "o", extra=[
        f"rewards=[{{name: 'learnable_rewards:{fn}'}}]", "data.size=16"])
    env_path = str(Path(__file__).resolve().parents[1])
    proc = subprocess.run(
        [sys.executable, "-m", "maxent_grpo.cli", "train", *base], cwd=tmp_path, capture_output=True, text=True,
        env={**os.environ, "PYTHONPATH": env_path, "MAXENT_GRPO_LOG": "WARNING"}, timeout=300,
    )
    _one_line_error(proc, *needles)


def test_trl_style_conversational_reward(tiny_model_dir, tmp_path):
    """A reward function written for TRL (conversational completions, **kwargs) runs unchanged."""
    data = tmp_path / "chat.jsonl"
    rows = [{"prompt": [{"role": "user", "content": f"What is {i} + 1?"}], "answer": str(i + 1)} for i in range(8)]
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    out = tmp_path / "run"
    args = tiny_overrides(tiny_model_dir, out, steps=1, extra=[
        f"data.source={data}", "rewards=[{name: 'learnable_rewards:conversational_length'}]"])
    assert main(["train", *args]) == 0
    row = json.loads((out / "completions" / "step-1.jsonl").read_text().splitlines()[0])
    assert row["rewards"]["learnable_rewards:conversational_length"] == pytest.approx(len(row["completion"]) / 100)


def test_help_explains_every_config_key():
    import dataclasses

    from maxent_grpo.methods.xdr import XdrConfig
    from maxent_grpo.config.help import field_help

    rows = field_help()
    # Every key has its line of help on its own field (metadata["help"]), nowhere else.
    assert all(text for *_, text in rows)
    proc = subprocess.run([sys.executable, "-m", "maxent_grpo.cli", "train", "--help"], capture_output=True, text=True)
    assert proc.returncode == 0
    for key in ("loss.beta", "maxent.tau", "training.packing", "--resume", "--set"):
        assert key in proc.stdout
    # A method's knob is one field in its file: xdr.tau's help, declared beside its default in
    # methods/xdr.py, is what --help prints for it.
    tau = next(f for f in dataclasses.fields(XdrConfig) if f.name == "tau")
    line = next(line for line in proc.stdout.splitlines() if "xdr.tau" in line)
    assert tau.metadata["help"][:40] in " ".join(proc.stdout.split())
    assert repr(tau.default) in line


def test_lora_run_uses_base_model_as_reference(tiny_model_dir, tmp_path):
    out = tmp_path / "run"
    args = tiny_overrides(tiny_model_dir, out, extra=[
        "method=grpo", "loss.beta=0.04", "model.lora.enabled=true", "model.lora.r=4", "training.learning_rate=0.01"])
    assert main(["train", *args]) == 0
    rows = read_metrics(out / "metrics.jsonl")
    # Step 1 samples from the untouched adapters (B = 0): policy == reference, so KL is 0; then it moves.
    assert rows[0]["kl"] == pytest.approx(0.0, abs=1e-6)
    assert rows[1]["kl"] > 0
    saved = sorted(p.name for p in (out / "checkpoints" / "step-2").iterdir())
    assert "adapter_model.safetensors" in saved and "model.safetensors" not in saved


def test_the_configuration_reference_is_generated_from_the_fields():
    from pathlib import Path

    from maxent_grpo.config.help import config_reference

    doc = Path(__file__).resolve().parents[2] / "docs" / "CONFIG.md"
    assert doc.read_text() == config_reference(), (
        "docs/CONFIG.md is out of date: python -m maxent_grpo.config.help --write docs/CONFIG.md")
