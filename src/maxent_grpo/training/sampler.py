"""The run's sampler: which backend, in which dtype, with which options; built the same way by
``maxent-grpo train`` and ``maxent-grpo eval``.

:class:`SamplerPlan` is what ``compile_run`` gives the sampler (every ``auto`` resolved);
:func:`build_sampler` builds the backend from it and :func:`describe_sampling` is the line both
commands print at start.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from maxent_grpo.data.prompts import FewShotExample, longest_prompt_tokens
from maxent_grpo.models import parse_dtype
from maxent_grpo.rollout.backend import GenerationBackend, SamplingParams
from maxent_grpo.rollout.backends import BACKENDS, BackendInputs
from maxent_grpo.rollout.settings import VllmConfig


@dataclass(frozen=True)
class SamplerPlan:
    backend: str  # a name rollout/backends.py registers
    sample_dtype: str | None  # a sampling copy in this dtype; None: the policy samples itself
    batch_size: int | None  # hf: most sequences per decoding call
    share_prompts: bool  # hf: prefill each distinct prompt once
    compile: bool  # hf: static KV cache and a compiled decoding step
    vllm: VllmConfig
    # The engine's LM head in float32 (model.lm_head_fp32): vllm gets hf_overrides head_dtype float32. The
    # hf backend samples through the policy's own head (or its copy's), already a Float32Head then.
    lm_head_fp32: bool
    # A colocated engine with no vllm.max_model_len plans its KV cache from the data's prompts; an
    # episode's context grows past its prompt (tool descriptions, turns): the engine keeps the model's length.
    size_from_prompts: bool
    params: SamplingParams
    system_prompt: str | None
    few_shot: tuple[FewShotExample, ...]


@dataclass(frozen=True)
class SamplerProcess:
    """The process a sampler is built in: how many train together (``world_size``), whether it is the main
    one, how the processes agree on a flag (``any_rank``: True on every rank when it is on any), and
    whether every forward is a collective (``synced_gpus``: a sharded policy, whose forwards gather weights
    from the other ranks, so every rank generates to the longest row of any rank)."""

    world_size: int = 1
    is_main: bool = True
    any_rank: Callable[[bool], bool] | None = None
    synced_gpus: bool = False


def build_sampler(
    s: SamplerPlan, model, tokenizer, model_path: str, *, seed: int, sync_dir: Path,
    prompts: Callable[[], list], process: SamplerProcess = SamplerProcess(),
) -> GenerationBackend:
    """The backend ``s`` names, over ``model``; ``prompts`` are read only when the engine sizes its
    context from them. ``process``: the processes it is built in (one process alone by default)."""
    p = process
    return BACKENDS[s.backend].build(BackendInputs(
        model=model, tokenizer=tokenizer, model_path=model_path,
        sample_dtype=None if s.sample_dtype is None else parse_dtype(s.sample_dtype), batch_size=s.batch_size,
        share_prompts=s.share_prompts, compile=s.compile, vllm=s.vllm, lm_head_fp32=s.lm_head_fp32, seed=seed,
        world_size=p.world_size, is_main=p.is_main, any_rank=p.any_rank, synced_gpus=p.synced_gpus,
        default_sync_dir=sync_dir,
        max_prompt_tokens=longest_prompt_tokens(
            tokenizer, prompts(), system_prompt=s.system_prompt, few_shot=s.few_shot,
        ) if s.size_from_prompts else None,
        max_new_tokens=s.params.max_new_tokens,
    ))


def describe_sampling(s: SamplerPlan) -> str:
    """One line for the start of ``train`` and ``eval``: how completions are sampled."""
    p = s.params
    copy = "the policy itself" if s.sample_dtype is None else f"a {s.sample_dtype} copy"
    compiled = " (compiled decoding)" if s.compile else ""
    if s.lm_head_fp32:
        copy += ", float32 LM head"
    return (f"sampling: {s.backend}{compiled} from {copy}, temperature {p.temperature:g}, top_p {p.top_p:g}, top_k {p.top_k}, "
            f"max_new_tokens {p.max_new_tokens}, stop {list(p.stop)}")
