"""Choosing the generation backend: config checks before any model loads, the serve command, mismatch metrics in runs."""

from __future__ import annotations

import importlib.util

import pytest

from maxent_grpo.cli import main
from maxent_grpo.training.config import ConfigError, load_config
from maxent_grpo.training.metrics import read_metrics
from tiny_runs import tiny_overrides

REWARDS = "[{name: boxed_accuracy}, {name: length, kwargs: {max_length: 100}}]"


@pytest.mark.parametrize("override, key", [
    ("generation.backend=sglang", "generation.backend"),
    ("generation.vllm.gpu_memory_utilization=1.5", "generation.vllm.gpu_memory_utilization"),
    ("generation.vllm.server_url=localhost:8000", "generation.vllm.server_url"),
    ("generation.vllm.max_model_len=10", "generation.vllm.max_model_len"),
    ("loss.rollout_correction=token", "loss.rollout_correction"),
    ("loss.rollout_correction_cap=0.5", "loss.rollout_correction_cap"),
    ("loss.seq_logprob_error_threshold=1.0", "loss.seq_logprob_error_threshold"),
])
def test_bad_backend_settings_name_their_key(override, key):
    with pytest.raises(ConfigError, match=key.replace(".", r"\.")):
        load_config(None, [override])


def test_lora_with_a_vllm_backend_is_refused():
    with pytest.raises(ConfigError, match="generation.backend"):
        load_config(None, ["generation.backend=vllm", "model.lora.enabled=true", "generation.dtype=null"])


@pytest.mark.skipif(importlib.util.find_spec("vllm") is not None, reason="vLLM is installed here")
def test_missing_vllm_is_one_line_before_the_model_loads(tiny_model_dir, tmp_path, capsys):
    args = tiny_overrides(tiny_model_dir, tmp_path / "run", rewards=REWARDS, extra=["generation.backend=vllm"])
    assert main(["train", *args]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "setup_vllm.sh" in err[0], err


def test_serve_prints_the_server_command(tiny_model_dir, capsys):
    assert main(["serve", str(tiny_model_dir), "--port", "8123", "--print-command", "--",
                 "--max-num-seqs", "16"]) == 0
    line = capsys.readouterr().out.strip()
    assert line.startswith("VLLM_SERVER_DEV_MODE=1 ")
    for part in ("-m vllm.entrypoints.openai.api_server", f"--model {tiny_model_dir}", "--port 8123",
                 "--logprobs-mode processed_logprobs", "--max-num-seqs 16"):
        assert part in line


def test_passthrough_arguments_belong_to_serve_only(tiny_model_dir):
    with pytest.raises(SystemExit):
        main(["train", "--", "--max-num-seqs", "16"])


def test_hf_runs_log_the_sampler_mismatch(tiny_model_dir, tmp_path):
    """The HF backend's behaviour log-probs feed the mismatch metrics; an fp32 sampler is the policy itself."""
    out = tmp_path / "run"
    assert main(["train", *tiny_overrides(tiny_model_dir, out, rewards=REWARDS,
                                          extra=["loss.rollout_correction=token_truncate"])]) == 0
    rows = read_metrics(out / "metrics.jsonl")
    for r in rows:
        assert r["sampling/sampling_logp_difference/max"] < 1e-4
        assert r["token_mult_prob_error"] == pytest.approx(1.0, abs=1e-4)
        assert r["sampling/importance_sampling_ratio/min"] > 0.999


def test_bf16_sampling_copy_shows_a_mismatch(tiny_model_dir, tmp_path):
    """A bf16 generation copy against the fp32 trainer: the gap is measured (ALGORITHMS.md §9)."""
    out = tmp_path / "run"
    assert main(["train", *tiny_overrides(tiny_model_dir, out, rewards=REWARDS, steps=1,
                                          extra=["generation.dtype=bfloat16"])]) == 0
    (row,) = read_metrics(out / "metrics.jsonl")
    assert row["sampling/sampling_logp_difference/max"] > 1e-3
    assert row["token_mult_prob_error"] > 1 + 1e-5
