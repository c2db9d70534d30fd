"""Precision: float32 master weights under bf16 compute; `auto` bf16 only where the device multiplies it natively."""

from __future__ import annotations

import os

import pytest
import torch

from maxent_grpo.config.load import ConfigError, load_config
from maxent_grpo.config.compile import compile_run
from maxent_grpo.training.precision import Machine, bf16_is_fast
from tiny_runs import compiled


def _plan(fast: bool = False, cuda: bool = False, **sets):
    return compiled(None, [f"{k}={v}" for k, v in sets.items()], fast_bf16=fast, cuda=cuda)


def _precision(plan):
    return plan.sampler.sample_dtype, plan.model.autocast_bf16


def test_auto_resolves_to_bf16_only_on_fast_hardware():
    sets = {"generation.dtype": "auto", "training.autocast_bf16": "auto"}
    assert _precision(_plan(True, **sets)) == ("bfloat16", True)
    assert _precision(_plan(False, **sets)) == (None, False)
    assert _plan(False, **sets).scoring.autocast_bf16 is False
    # Compute told to stay float32: the sampler follows it, on any hardware (TRL's bf16: false samples in fp32).
    assert _precision(_plan(True, **{**sets, "training.autocast_bf16": "false"})) == (None, False)


def test_auto_is_resolved_by_the_compiler_and_the_config_stays_as_written():
    cfg = load_config(None, ["generation.dtype=auto"])
    plan = compile_run(cfg, Machine(fast_bf16=True, cuda=False))
    assert plan.sampler.sample_dtype == "bfloat16" and cfg.generation.dtype == "auto"
    assert plan.source["generation"]["dtype"] == "auto"  # what is saved: the config as written
    assert any(note.startswith("precision auto (native bf16)") for note in plan.notes)


def test_explicit_settings_are_kept_on_any_hardware():
    for fast in (True, False):
        plan = _plan(fast, **{"generation.dtype": "bfloat16", "training.autocast_bf16": "true"})
        assert _precision(plan) == ("bfloat16", True)
    sets = {"generation.dtype": "null", "training.autocast_bf16": "false", "loss.rollout_correction": "none",
            "training.share_prompts": "true", "training.packing": "false", "generation.compile": "false"}
    for cuda in (False, True):  # an explicit share_prompts: kept on CUDA too
        plan = _plan(True, cuda, **sets)
        assert (*_precision(plan), plan.scoring.share_prompts, plan.notes) == (None, False, True, ())


@pytest.mark.parametrize("sets, cuda, expected", [
    ({}, False, True),  # the CPU: each distinct prompt runs once
    ({}, True, False),  # CUDA: the KV-cache forward and backward measured 1.75x a plain one (H100)
    # A shared prompt's KV cache cannot be recomputed; the one-pass layout (the CPU's inline_prompts) can.
    ({"training.gradient_checkpointing": "true"}, False, True),
    ({"training.gradient_checkpointing": "true", "training.inline_prompts": "false"}, False, False),
    ({"training.gradient_checkpointing": "true"}, True, False),
    ({"training.share_prompts": "false"}, False, False),
    ({"training.share_prompts": "true"}, True, True),
])
def test_share_prompts_auto_is_on_for_the_cpu_only(sets, cuda, expected):
    plan = _plan(False, cuda, **sets)
    assert plan.scoring.share_prompts is expected and plan.sampler.share_prompts is expected


@pytest.mark.parametrize("sets, cuda, expected", [
    ({}, False, True),  # the CPU: completions packed behind the shared prompts
    ({}, True, False),  # CUDA: no shared prompts, and packed rows alone not timed on a GPU
    ({"training.gradient_checkpointing": "true", "training.inline_prompts": "false"}, False, False),  # no sharing
    ({"training.share_prompts": "true"}, True, True),
    ({"training.packing": "true"}, True, True),
    ({"training.packing": "false"}, False, False),
])
def test_packing_auto_follows_share_prompts(sets, cuda, expected):
    plan = _plan(False, cuda, **sets)
    assert plan.scoring.packing is expected
    if "training.packing" not in sets:
        assert f"packing auto: {expected}" in " ".join(plan.notes)


@pytest.mark.parametrize("sets, cuda, expected", [
    ({}, True, True),  # CUDA: static KV cache and CUDA graphs
    ({}, False, False),  # the CPU: each shape's compile costs more than the step saves
    ({"model.lora.enabled": "true"}, True, True),  # the adapters are traced like any other module
    ({"training.strategy": "fsdp2"}, True, False),  # each sharded forward gathers weights from the others
    ({"generation.compile": "true"}, False, True),  # forced on the CPU (how the tests reach it)
    ({"generation.compile": "false"}, True, False),
])
def test_compile_auto_is_on_for_cuda(sets, cuda, expected):
    plan = _plan(False, cuda, **sets)
    assert plan.sampler.compile is expected
    noted = [n for n in plan.notes if n.startswith("generation.compile auto")]
    if "generation.compile" in sets:
        assert noted == []  # explicit: kept, nothing to say
    else:
        assert len(noted) == 1 and noted[0].startswith(f"generation.compile auto: {expected} (")


def test_nccl_weight_sync_is_not_accepted_and_the_error_names_disk():
    with pytest.raises(ConfigError, match=r"^generation.vllm.weight_sync: 'nccl' is not one of disk"):
        _plan(**{"generation.vllm.weight_sync": "nccl"})


def test_compile_auto_is_off_for_vllm_and_true_is_refused_there():
    plan = _plan(False, True, **{"generation.backend": "vllm"})
    assert plan.sampler.compile is False and not any("generation.compile" in n for n in plan.notes)
    with pytest.raises(ConfigError, match=r"^generation.compile: applies to generation.backend hf"):
        _plan(False, True, **{"generation.backend": "vllm", "generation.compile": "true"})
    with pytest.raises(ConfigError, match=r"^generation.compile: true is not supported with training.strategy fsdp2"):
        _plan(False, True, **{"training.strategy": "fsdp2", "generation.compile": "true"})


def test_share_prompts_true_with_gradient_checkpointing_needs_the_one_pass_layout():
    for off in ({"training.inline_prompts": "false"}, {"training.packing": "false"}):
        with pytest.raises(ConfigError, match="^training.gradient_checkpointing: .*inline_prompts"):
            _plan(**{"training.gradient_checkpointing": "true", "training.share_prompts": "true", **off})
    plan = _plan(**{"training.gradient_checkpointing": "true", "training.share_prompts": "true"})
    assert plan.scoring.share_prompts and plan.scoring.packing and plan.scoring.inline_prompts


@pytest.mark.parametrize("sets, cuda, expected", [
    ({}, False, True),  # the CPU: each prompt in its completions' forward
    ({}, True, False),  # CUDA: not measured there (share_prompts is off too)
    ({"training.share_prompts": "true"}, True, False),  # CUDA, shared: the KV cache, as measured
    ({"training.share_prompts": "true", "training.inline_prompts": "true"}, True, True),
    ({"training.packing": "false"}, False, False),  # needs the completions packed
    ({"training.inline_prompts": "false"}, False, False),
])
def test_inline_prompts_auto_is_on_where_prompts_are_shared_and_packed_on_the_cpu(sets, cuda, expected):
    plan = _plan(False, cuda, **sets)
    assert plan.scoring.inline_prompts is expected


@pytest.mark.parametrize("sets, fast, expected", [
    ({}, False, "none"),  # AVX2 / no native bf16: the policy samples its own rollouts
    ({}, True, "token_truncate"),  # a bf16 sampling copy
    ({"generation.dtype": "float32"}, True, "none"),  # a copy in the master dtype is no copy
    ({"model.lora.enabled": "true"}, True, "none"),  # a LoRA policy samples from itself
    ({"model.lora.enabled": "true", "generation.backend": "vllm"}, False, "token_truncate"),  # merged, in an engine
    ({"generation.backend": "vllm"}, False, "token_truncate"),  # an engine with its own weights
    ({"generation.backend": "vllm_server"}, False, "token_truncate"),
    ({"loss.rollout_correction": "sequence_mask"}, True, "sequence_mask"),  # explicit: kept
    ({"loss.rollout_correction": "none", "generation.backend": "vllm"}, False, "none"),
])
def test_rollout_correction_auto_turns_on_when_the_sampler_is_not_the_trainer(sets, fast, expected):
    loss = _plan(fast, **sets).method.loss
    assert loss.rollout_correction == expected
    assert loss.rollout_correction_cap == 2.0  # ALGORITHMS.md §15's default C


def test_auto_gives_a_lora_policy_no_sampling_copy():
    assert _plan(True, **{"generation.dtype": "auto", "model.lora.enabled": "true"}).sampler.sample_dtype is None
    # A vLLM engine holds its own copy of the merged weights: auto picks bf16 where it is native.
    plan = _plan(True, **{"generation.dtype": "auto", "model.lora.enabled": "true", "generation.backend": "vllm"})
    assert plan.sampler.sample_dtype == "bfloat16"


def test_the_default_recipe_asks_for_auto_and_bad_values_are_named():
    cfg = load_config()
    assert (cfg.generation.dtype, cfg.training.autocast_bf16) == ("auto", "auto")
    with pytest.raises(ConfigError, match="training.autocast_bf16"):
        _plan(**{"training.autocast_bf16": "sometimes"})


def test_cpu_answer_matches_the_cpu_flags():
    if not os.path.exists("/proc/cpuinfo"):
        pytest.skip("no /proc/cpuinfo")
    flags = open("/proc/cpuinfo").read()
    native = " avx512_bf16" in flags or " amx_bf16" in flags
    assert bf16_is_fast(torch.device("cpu")) == native


def test_bf16_compute_keeps_float32_master_weights_so_a_small_update_lands(tiny_model_dir, tmp_path):
    """model.dtype: bfloat16 is the compute dtype: one AdamW step at lr 1e-6 moves nearly every
    weight (on bf16 weights 2% moved: the rest rounded away), and the checkpoint holds the
    float32 weights that were trained."""
    from safetensors.torch import load_file

    from maxent_grpo.cli import main
    from tiny_runs import tiny_overrides

    out = tmp_path / "run"
    args = tiny_overrides(tiny_model_dir, out, rewards="[{name: length, kwargs: {max_length: 100}}]", steps=1,
                          extra=["model.dtype=bfloat16", "training.autocast_bf16=auto", "training.learning_rate=1e-6",
                                 "training.warmup_steps=0", "loss.beta=0.0", "checkpoint.save_steps=1"])
    assert main(["train", *args]) == 0
    start = load_file(tiny_model_dir / "model.safetensors")
    trained = load_file(out / "checkpoints" / "step-1" / "model.safetensors")
    assert {t.dtype for t in trained.values()} == {torch.float32}
    changed = sum(int((trained[k] != start[k].float()).sum()) for k in start)
    total = sum(t.numel() for t in start.values())
    assert changed / total >= 0.9, f"only {changed / total:.1%} of the weights moved"


def test_bf16_compute_without_autocast_is_refused_naming_the_key():
    with pytest.raises(ConfigError, match="^training.autocast_bf16: false contradicts model.dtype: bfloat16"):
        _plan(**{"model.dtype": "bfloat16", "training.autocast_bf16": "false"})
    assert _plan(False, **{"model.dtype": "bfloat16"}).model.autocast_bf16 is True


def test_a_lora_base_is_stored_in_the_compute_dtype_and_its_adapters_train_in_float32(tiny_model_dir):
    from maxent_grpo.models import apply_lora, load_model_and_tokenizer
    from maxent_grpo.models import master_dtype

    full, _ = load_model_and_tokenizer(str(tiny_model_dir), dtype=master_dtype("bfloat16", lora=False))
    assert {p.dtype for p in full.parameters()} == {torch.float32}
    base, _ = load_model_and_tokenizer(str(tiny_model_dir), dtype=master_dtype("bfloat16", lora=True))
    lora = apply_lora(base, r=4)
    assert {p.dtype for p in lora.parameters() if p.requires_grad} == {torch.float32}
    assert {p.dtype for p in lora.parameters() if not p.requires_grad} == {torch.bfloat16}


@pytest.mark.parametrize("sets, cuda, fused", [
    ({}, True, True),  # torch's fused AdamW kernel on CUDA (TRL's adamw_torch_fused)
    ({}, False, False),  # the CPU: torch's default (foreach)
    ({"training.strategy": "fsdp2"}, True, False),  # sharded (DTensor) parameters keep the default
])
def test_adamw_is_fused_on_cuda_for_unsharded_parameters(sets, cuda, fused):
    assert _plan(False, cuda, **sets).optimizer.fused is fused


@pytest.mark.parametrize("optimizer, cuda, fused", [
    ("adamw_fused", False, True),  # torch's fused kernel on the CPU too, when asked for
    ("adamw_8bit", True, False),  # bitsandbytes' own kernel
])
def test_the_optimizer_setting_names_the_optimizer(optimizer, cuda, fused):
    plan = _plan(False, cuda, **{"training.optimizer": optimizer})
    assert (plan.optimizer.name, plan.optimizer.fused) == (optimizer, fused)


def test_a_non_default_optimizer_with_sharded_parameters_is_refused_in_one_line():
    with pytest.raises(ConfigError, match="^training.optimizer: adamw_8bit is not supported with training.strategy fsdp2"):
        _plan(False, True, **{"training.strategy": "fsdp2", "training.optimizer": "adamw_8bit"})
