"""Precision: the dtype the trained weights live in, and ``auto`` resolved against the device.

``model.dtype`` is the compute dtype. The weights that are trained are kept and
updated in float32 (fp32 master weights, as TRL, verl, NeMo-RL and prime-rl do):
AdamW on bf16 weights loses its updates, since a bf16 weight ``w`` can only move
by steps larger than about ``|w| * 2**-9``, and a first step moves each weight by
about the learning rate (at lr 1e-6, 2% of the tiny model's weights moved at
all). ``model.dtype: bfloat16`` therefore means bf16 compute: autocast under DDP
and on one process, ``MixedPrecisionPolicy(param_dtype=bf16, reduce_dtype=fp32)``
under FSDP2 on a GPU. Frozen weights (a LoRA base, the reference model) are
stored in ``model.dtype``; LoRA adapters stay float32 (peft upcasts them).

bfloat16 sampling (``generation.dtype``) and bf16 autocast
(``training.autocast_bf16``) pay off only where the hardware multiplies bf16
natively: CUDA devices that support it, and CPUs with AVX-512 BF16 or AMX.
Elsewhere (an AVX2-only CPU, for one) PyTorch falls back to a reference bf16
matmul that is many times slower than float32, so ``auto`` means float32 there.
"""

from __future__ import annotations

import dataclasses
import logging

import torch

from maxent_grpo.models import master_dtype
from maxent_grpo.rollout.backends import BACKENDS
from maxent_grpo.training.config import TrainConfig
from maxent_grpo.training.strategy import STRATEGIES

log = logging.getLogger(__name__)


def bf16_is_fast(device: torch.device) -> bool:
    """Whether ``device`` runs bfloat16 matmuls natively."""
    if device.type == "cuda":
        return torch.cuda.is_bf16_supported()
    if device.type == "cpu":
        return torch.cpu._is_avx512_bf16_supported() or torch.cpu._is_amx_tile_supported()
    return False


def resolve_precision(cfg: TrainConfig, fast_bf16: bool, *, cuda: bool = False) -> TrainConfig:
    """``cfg`` with every ``auto`` that depends on the device replaced: the sampling copy's dtype
    (bf16 when ``fast_bf16``, else none), bf16 autocast (whenever ``model.dtype`` is bfloat16, the
    compute dtype), the rollout correction that follows from them (:func:`sampler_is_trainer`), and
    shared prompts (on the CPU only, ``cuda`` False, and never with activation checkpointing)."""
    g, t, lo = cfg.generation, cfg.training, cfg.loss
    if t.share_prompts == "auto":
        # On an H100 the shared prompt's KV-cache forward and backward took 1.75x one plain forward
        # over every row (benchmarks/update_profile.py, 0.5B, 8 x 168-token prompts x 8 completions).
        share = not cuda and not t.gradient_checkpointing
        log.info("share_prompts auto: %s (%s)", share, "CUDA" if cuda else
                 "activation checkpointing" if t.gradient_checkpointing else "the CPU")
        t = dataclasses.replace(t, share_prompts=share)
        cfg = dataclasses.replace(cfg, training=t)
    # A LoRA policy or an FSDP2 policy sampled by HF generate samples from itself
    # (config.validate): no copy to make. A vLLM engine always holds its own weights.
    own = not BACKENDS[g.backend].owns_weights and (cfg.model.lora.enabled or STRATEGIES[t.strategy].collective_forward)
    auto_dtype = "bfloat16" if fast_bf16 and not own else None
    dtype = auto_dtype if g.dtype == "auto" else g.dtype
    autocast = (fast_bf16 or cfg.model.dtype == "bfloat16") if t.autocast_bf16 == "auto" else t.autocast_bf16
    if (dtype, autocast) != (g.dtype, t.autocast_bf16):
        log.info("precision auto (%s bf16): generation.dtype=%s, training.autocast_bf16=%s",
                 "native" if fast_bf16 else "no native", dtype, autocast)
        cfg = dataclasses.replace(cfg, generation=dataclasses.replace(g, dtype=dtype),
                                  training=dataclasses.replace(t, autocast_bf16=autocast))
    if lo.rollout_correction == "auto":
        own_sampler = sampler_is_trainer(cfg)
        # ALGORITHMS.md §15's default: token-level truncated importance sampling (TIS).
        correction = "none" if own_sampler else "token_truncate"
        log.info("rollout correction auto: %s (%s)", correction, "the policy samples its own rollouts"
                 if own_sampler else "the sampler is not the trained weights: its own copy, or earlier weights")
        cfg = dataclasses.replace(cfg, loss=dataclasses.replace(lo, rollout_correction=correction))
    return cfg


def sampler_is_trainer(cfg: TrainConfig) -> bool:
    """Whether the rollouts come from the trained weights themselves: no engine with its own
    weights (vLLM), no sampling copy in another dtype (``generation.dtype``, resolved), no
    earlier version of them (``rollout.max_staleness``)."""
    g = cfg.generation
    if BACKENDS[g.backend].owns_weights or cfg.rollout.max_staleness > 0:
        return False
    return g.dtype is None or g.dtype == master_dtype(cfg.model.dtype, cfg.model.lora.enabled)
