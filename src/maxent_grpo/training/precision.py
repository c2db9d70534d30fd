"""Precision: the dtype the trained weights live in, and ``auto`` resolved against the machine.

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

Every function here is pure: ``config/compile.py`` calls them while it compiles the run, with the
:class:`Machine` the run is on, and keeps the lines that say what each ``auto`` became.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch

from maxent_grpo.training.distributed import Dist


def bf16_is_fast(device: torch.device) -> bool:
    """Whether ``device`` runs bfloat16 matmuls natively."""
    if device.type == "cuda":
        return torch.cuda.is_bf16_supported()
    if device.type == "cpu":
        return torch.cpu._is_avx512_bf16_supported() or torch.cpu._is_amx_tile_supported()
    return False


@dataclass(frozen=True)
class Machine:
    """What the ``auto`` settings and the process-count rule are resolved against.

    ``processes``: the processes that train together (torchrun's WORLD_SIZE); None for a
    command that trains nothing (``maxent-grpo eval``), which no process-count rule concerns.
    """

    fast_bf16: bool
    cuda: bool
    processes: int | None = 1

    @classmethod
    def here(cls, *, training: bool = True) -> "Machine":
        """This process's machine: the device a run trains on (the GPU when torch has one)."""
        device = Dist().device
        return cls(fast_bf16=bf16_is_fast(device), cuda=device.type == "cuda",
                   processes=int(os.environ.get("WORLD_SIZE", "1")) if training else None)


@dataclass(frozen=True)
class Precision:
    """Every setting that ``auto`` leaves to the machine, resolved; ``notes`` say what each became."""

    sample_dtype: str | None  # the sampling copy's dtype; None: the policy samples itself
    autocast_bf16: bool
    share_prompts: bool
    packing: bool
    rollout_correction: str
    compile_decoding: bool
    notes: tuple[str, ...]


def resolve_precision(
    *, machine: Machine, compute_dtype: str, master: str, sample_dtype: str | None, autocast_bf16: bool | str,
    share_prompts: bool | str, packing: bool | str, rollout_correction: str, gradient_checkpointing: bool,
    samples_itself: bool, engine_owns_weights: bool, max_staleness: int, compile_decoding: bool | str,
    hf_sampler: bool, sharded: bool,
) -> Precision:
    """The device-dependent ``auto`` settings: the sampling copy's dtype (bf16 when the machine multiplies
    it natively and the policy is not its own sampler), bf16 autocast (also whenever ``compute_dtype`` is
    bfloat16), the rollout correction that follows from them (:func:`sampler_is_trainer`), shared
    prompts (on the CPU only, and never with activation checkpointing) and packing (with shared prompts).

    ``samples_itself``: a LoRA or sharded policy sampled by HF (no copy to make).
    Compiled decoding (``compile_decoding`` auto): on where HF samples on CUDA from a policy that is not
    sharded (``sharded``: every forward gathers weights from the other processes).
    """
    notes = []
    share = share_prompts
    if share_prompts == "auto":
        # On an H100 the shared prompt's KV-cache forward and backward took 1.75x one plain forward
        # over every row (benchmarks/update_profile.py, 0.5B, 8 x 168-token prompts x 8 completions).
        share = not machine.cuda and not gradient_checkpointing
        notes.append(f"share_prompts auto: {share} (" + (
            "CUDA" if machine.cuda else "activation checkpointing" if gradient_checkpointing else "the CPU") + ")")
    pack = packing
    if packing == "auto":
        pack = share is True
        notes.append(f"packing auto: {pack} (" + ("completions packed behind the shared prompts" if pack
                                                 else "share_prompts is off") + ")")
    dtype = sample_dtype
    if sample_dtype == "auto":
        dtype = "bfloat16" if machine.fast_bf16 and not samples_itself else None
    autocast = autocast_bf16
    if autocast_bf16 == "auto":
        autocast = machine.fast_bf16 or compute_dtype == "bfloat16"
    if "auto" in (sample_dtype, autocast_bf16):
        notes.append(f"precision auto ({'native' if machine.fast_bf16 else 'no native'} bf16): "
                     f"generation.dtype={dtype}, training.autocast_bf16={autocast}")
    correction = rollout_correction
    if rollout_correction == "auto":
        own = sampler_is_trainer(engine_owns_weights=engine_owns_weights, max_staleness=max_staleness,
                                 sample_dtype=dtype, master=master)
        # ALGORITHMS.md §15's default: token-level truncated importance sampling (TIS).
        correction = "none" if own else "token_truncate"
        notes.append(f"rollout correction auto: {correction} (" + (
            "the policy samples its own rollouts" if own
            else "the sampler is not the trained weights: its own copy, or earlier weights") + ")")
    compiled = compile_decoding
    if compile_decoding == "auto":
        compiled = hf_sampler and machine.cuda and not sharded
        if hf_sampler:
            notes.append(f"generation.compile auto: {compiled} (" + (
                "sharded forwards gather weights" if sharded
                else "CUDA: static KV cache, CUDA graphs" if machine.cuda
                else "the CPU: compiling each shape costs more than it saves") + ")")
    return Precision(sample_dtype=dtype, autocast_bf16=autocast is True, share_prompts=share is True,
                     packing=pack is True, rollout_correction=correction, compile_decoding=compiled is True,
                     notes=tuple(notes))


def sampler_is_trainer(*, engine_owns_weights: bool, max_staleness: int, sample_dtype: str | None,
                       master: str) -> bool:
    """Whether the rollouts come from the trained weights themselves: no engine with its own weights
    (vLLM), no sampling copy in another dtype (``sample_dtype``, resolved), no earlier version of them
    (``max_staleness``)."""
    if engine_owns_weights or max_staleness > 0:
        return False
    return sample_dtype is None or sample_dtype == master
