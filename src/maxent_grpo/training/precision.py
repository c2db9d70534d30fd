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
    inline_prompts: bool = False  # shared and packed: each prompt in its completions' forward, no KV cache


@dataclass(frozen=True)
class PrecisionAsked:
    """What the config asks (each ``auto`` still to resolve) and the facts about the run that decide it."""

    compute_dtype: str  # model.dtype
    master: str  # the dtype the trained weights are kept in
    sample_dtype: str | None  # generation.dtype
    autocast_bf16: bool | str
    share_prompts: bool | str
    packing: bool | str
    rollout_correction: str
    compile_decoding: bool | str  # generation.compile
    inline_prompts: bool | str
    gradient_checkpointing: bool
    samples_itself: bool  # a LoRA or sharded policy sampled by HF (no copy to make)
    engine_owns_weights: bool  # the backend samples from its own copy of the weights (vLLM)
    max_staleness: int
    hf_sampler: bool
    sharded: bool  # every forward gathers weights from the other processes


def precision_for(machine: Machine, a: PrecisionAsked) -> Precision:
    """The device-dependent ``auto`` settings: the sampling copy's dtype (bf16 when the machine multiplies
    it natively and the policy is not its own sampler), bf16 autocast (also whenever ``compute_dtype`` is
    bfloat16), the rollout correction that follows from them (:func:`sampler_is_trainer`), shared
    prompts (on the CPU only, and never with activation checkpointing) and packing (with shared prompts).

    Compiled decoding (``compile_decoding`` auto): on where HF samples on CUDA from a policy that is not
    sharded.
    """
    notes = []
    # The one-pass layout (prompt and completions in one forward) where it was measured: the CPU.
    inline_wanted = a.inline_prompts is True or (a.inline_prompts == "auto" and not machine.cuda)
    share = a.share_prompts
    if a.share_prompts == "auto":
        # On an H100 the shared prompt's KV-cache forward and backward took 1.75x one plain forward
        # over every row (benchmarks/update_profile.py, 0.5B, 8 x 168-token prompts x 8 completions).
        # Activation checkpointing cannot recompute a KV cache; the one-pass layout has none.
        share = not machine.cuda and (not a.gradient_checkpointing or inline_wanted)
        notes.append(f"share_prompts auto: {share} (" + (
            "CUDA" if machine.cuda else "activation checkpointing" if a.gradient_checkpointing and not share
            else "the CPU") + ")")
    pack = a.packing
    if a.packing == "auto":
        pack = share is True
        notes.append(f"packing auto: {pack} (" + ("completions packed behind the shared prompts" if pack
                                                 else "share_prompts is off") + ")")
    inline = inline_wanted and share is True and pack is True
    if a.inline_prompts == "auto" and share is True and pack is True:
        notes.append(f"inline_prompts auto: {inline} (" + (
            "the CPU: each prompt in its completions' forward" if inline
            else "CUDA: not measured there; the prompt runs once through its KV cache") + ")")
    autocast = a.autocast_bf16
    if a.autocast_bf16 == "auto":
        autocast = machine.fast_bf16 or a.compute_dtype == "bfloat16"
    dtype = a.sample_dtype
    if a.sample_dtype == "auto":
        # A bf16 sampling copy where the trainer computes in bf16 too: a trainer told to compute in
        # float32 (training.autocast_bf16: false; TRL's bf16: false) samples in its own dtype.
        dtype = "bfloat16" if machine.fast_bf16 and autocast is True and not a.samples_itself else None
    if "auto" in (a.sample_dtype, a.autocast_bf16):
        notes.append(f"precision auto ({'native' if machine.fast_bf16 else 'no native'} bf16): "
                     f"generation.dtype={dtype}, training.autocast_bf16={autocast}")
    correction = a.rollout_correction
    if a.rollout_correction == "auto":
        own = sampler_is_trainer(engine_owns_weights=a.engine_owns_weights, max_staleness=a.max_staleness,
                                 sample_dtype=dtype, master=a.master)
        # ALGORITHMS.md §15's default: token-level truncated importance sampling (TIS).
        correction = "none" if own else "token_truncate"
        notes.append(f"rollout correction auto: {correction} (" + (
            "the policy samples its own rollouts" if own
            else "the sampler is not the trained weights: its own copy, or earlier weights") + ")")
    compiled = a.compile_decoding
    if a.compile_decoding == "auto":
        compiled = a.hf_sampler and machine.cuda and not a.sharded
        if a.hf_sampler:
            notes.append(f"generation.compile auto: {compiled} (" + (
                "sharded forwards gather weights" if a.sharded
                else "CUDA: static KV cache, CUDA graphs" if machine.cuda
                else "the CPU: compiling each shape costs more than it saves") + ")")
    return Precision(sample_dtype=dtype, autocast_bf16=autocast is True, share_prompts=share is True,
                     packing=pack is True, rollout_correction=correction, compile_decoding=compiled is True,
                     notes=tuple(notes), inline_prompts=inline)


def sampler_is_trainer(*, engine_owns_weights: bool, max_staleness: int, sample_dtype: str | None,
                       master: str) -> bool:
    """Whether the rollouts come from the trained weights themselves: no engine with its own weights
    (vLLM), no sampling copy in another dtype (``sample_dtype``, resolved), no earlier version of them
    (``max_staleness``)."""
    if engine_owns_weights or max_staleness > 0:
        return False
    return sample_dtype is None or sample_dtype == master
