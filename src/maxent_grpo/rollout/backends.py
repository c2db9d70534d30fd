"""The generation backends by name: ``BACKENDS[name]`` checks and builds one.

Training (``training/setup.py``) and evaluation (``eval_command.py``) both build
their sampler here, so a new backend is one entry: what it needs before any
model loads (``check``), how it is built (``build``), and the facts the config
checks and the precision choices read (``owns_weights``, ``supports_lora``).

``owns_weights``: the backend samples from its own copy of the weights (a vLLM
engine or server), refreshed by ``sync_weights`` after each optimizer step, so
the sampler is never bit-for-bit the trainer; ``hf`` samples from the policy
itself unless ``generation.dtype`` asks for a copy in another dtype.
"""

from __future__ import annotations

import importlib.util
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch

from maxent_grpo.errors import ConfigError
from maxent_grpo.rollout.backend import GenerationBackend
from maxent_grpo.rollout.hf import HFGenerationBackend
from maxent_grpo.rollout.settings import VllmConfig


@dataclass(frozen=True)
class BackendInputs:
    """What building a sampler takes: the policy, where its files are, and the run's plain options."""

    model: torch.nn.Module
    tokenizer: object
    model_path: str
    sample_dtype: torch.dtype | None  # a sampling copy in this dtype; None: the policy's own
    batch_size: int | None  # hf: most sequences per generate call
    share_prompts: bool  # hf: prefill each distinct prompt once
    vllm: VllmConfig
    seed: int
    world_size: int = 1
    is_main: bool = True
    barrier: Callable[[], None] | None = None
    # hf under FSDP2: every forward is a collective, so all ranks generate to the longest row.
    synced_gpus: bool = False
    # vllm_server: where the disk weight sync writes when vllm.sync_dir is null.
    default_sync_dir: Path | None = None


@dataclass(frozen=True)
class Backend:
    name: str
    check: Callable[[VllmConfig], None]  # before any model loads: the package, the server, the options
    build: Callable[[BackendInputs], GenerationBackend]
    owns_weights: bool
    supports_lora: bool
    # Has ``generate_ids``: a multi-turn episode's next turn is sampled from its exact token ids (envs/).
    continues_from_ids: bool = False


def _check_hf(vllm: VllmConfig) -> None:
    return None


def _build_hf(i: BackendInputs) -> GenerationBackend:
    return HFGenerationBackend(
        i.model, i.tokenizer, batch_size=i.batch_size, dtype=i.sample_dtype, share_prompts=i.share_prompts,
        synced_gpus=i.synced_gpus,
    )


def _check_vllm(vllm: VllmConfig) -> None:
    if importlib.util.find_spec("vllm") is None:
        raise ConfigError(
            "generation.backend: vllm needs the vllm package: pip install 'maxent-grpo[vllm]' on a GPU machine, "
            "or bash scripts/setup_vllm.sh for vLLM's CPU build"
        )


def _build_vllm(i: BackendInputs) -> GenerationBackend:
    from maxent_grpo.rollout.vllm_colocate import VLLMColocateBackend  # vllm is optional

    v = i.vllm
    return VLLMColocateBackend(
        i.model_path, i.tokenizer, model_dtype=i.model.dtype, sample_dtype=i.sample_dtype,
        gpu_memory_utilization=v.gpu_memory_utilization, max_model_len=v.max_model_len,
        enable_sleep_mode=v.enable_sleep_mode, enforce_eager=v.enforce_eager, world_size=i.world_size, seed=i.seed,
    )


def _check_vllm_server(vllm: VllmConfig) -> None:
    from maxent_grpo.rollout.vllm_server import served_model

    if vllm.weight_sync == "nccl":
        raise ConfigError("generation.vllm.weight_sync: nccl is not implemented in this version (docs/VLLM.md); "
                          "use disk")
    served_model(vllm.server_url, timeout_s=vllm.request_timeout_s)  # reachable, one model


def _build_vllm_server(i: BackendInputs) -> GenerationBackend:
    from maxent_grpo.rollout.vllm_server import VLLMServerBackend

    v = i.vllm
    if v.sync_dir is None and i.default_sync_dir is None:
        raise ValueError("vllm_server needs vllm.sync_dir or default_sync_dir: where the weight push writes")
    backend = VLLMServerBackend(
        v.server_url, i.tokenizer, sync_dir=v.sync_dir if v.sync_dir is not None else i.default_sync_dir,
        is_main=i.is_main, barrier=i.barrier, timeout_s=v.request_timeout_s,
    )
    # The server may still hold another run's weights: start it from this policy.
    backend.sync_weights(i.model)
    return backend


BACKENDS: dict[str, Backend] = {
    b.name: b for b in (
        Backend("hf", _check_hf, _build_hf, owns_weights=False, supports_lora=True, continues_from_ids=True),
        Backend("vllm", _check_vllm, _build_vllm, owns_weights=True, supports_lora=False),
        Backend("vllm_server", _check_vllm_server, _build_vllm_server, owns_weights=True, supports_lora=False),
    )
}
