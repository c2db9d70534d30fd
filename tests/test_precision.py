"""`auto` precision: bf16 only where the device multiplies it natively."""

from __future__ import annotations

import os

import pytest
import torch

from maxent_grpo.training.config import ConfigError, load_config
from maxent_grpo.training.precision import bf16_is_fast, resolve_precision


def _cfg(**sets):
    return load_config(None, [f"{k}={v}" for k, v in sets.items()])


def test_auto_resolves_to_bf16_only_on_fast_hardware():
    cfg = _cfg(**{"generation.dtype": "auto", "training.autocast_bf16": "auto"})
    fast, slow = resolve_precision(cfg, True), resolve_precision(cfg, False)
    assert (fast.generation.dtype, fast.training.autocast_bf16) == ("bfloat16", True)
    assert (slow.generation.dtype, slow.training.autocast_bf16) == (None, False)
    assert cfg.generation.dtype == "auto"  # the input is not changed


def test_explicit_settings_are_kept_on_any_hardware():
    cfg = _cfg(**{"generation.dtype": "bfloat16", "training.autocast_bf16": "true"})
    for fast in (True, False):
        out = resolve_precision(cfg, fast)
        assert (out.generation.dtype, out.training.autocast_bf16) == ("bfloat16", True)
    cfg = _cfg(**{"generation.dtype": "null", "training.autocast_bf16": "false"})
    assert resolve_precision(cfg, True) is cfg


def test_auto_gives_a_lora_policy_no_sampling_copy():
    cfg = _cfg(**{"generation.dtype": "auto", "model.lora.enabled": "true"})
    assert resolve_precision(cfg, True).generation.dtype is None


def test_the_default_recipe_asks_for_auto_and_bad_values_are_named():
    cfg = load_config()
    assert (cfg.generation.dtype, cfg.training.autocast_bf16) == ("auto", "auto")
    with pytest.raises(ConfigError, match="training.autocast_bf16"):
        _cfg(**{"training.autocast_bf16": "sometimes"})


def test_cpu_answer_matches_the_cpu_flags():
    if not os.path.exists("/proc/cpuinfo"):
        pytest.skip("no /proc/cpuinfo")
    flags = open("/proc/cpuinfo").read()
    native = " avx512_bf16" in flags or " amx_bf16" in flags
    assert bf16_is_fast(torch.device("cpu")) == native
