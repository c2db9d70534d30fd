"""The user-facing options of the vLLM backends: the ``generation.vllm`` section of the config.

They live with the backends that read them (``rollout/backends.py`` builds an engine
or a server client from this record), and the training config takes the section from here.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal


@dataclass(frozen=True)
class VllmConfig:
    """Options of the vLLM backends (``generation.backend: vllm | vllm_server``); docs/VLLM.md."""

    # Colocated engine (backend vllm): share of GPU memory the engine may take; ignored on CPU.
    gpu_memory_utilization: float = field(default=0.3, metadata={"help": (
        "vllm: share of GPU memory the colocated engine may take")})
    # Longest prompt + completion the engine plans for (null: the data's longest prompt in tokens +
    # generation.max_new_tokens, measured at start; vLLM's default, the model's context, where unknown).
    max_model_len: int | None = field(default=None, metadata={"help": (
        "vllm: longest prompt + completion the engine plans for (null = the data's longest prompt + "
        "max_new_tokens)")})
    # Most sequences the engine runs at once (null: vLLM's default for the device).
    max_num_seqs: int | None = field(default=None, metadata={"help": (
        "vllm: most sequences the engine runs at once (null = vLLM's default)")})
    # Most tokens the engine schedules in one forward (null: vLLM's default for the device); a lower
    # value lowers the engine's peak activation memory, a higher one speeds up prefill.
    max_num_batched_tokens: int | None = field(default=None, metadata={"help": (
        "vllm: most tokens per engine forward; lower = less activation memory (null = vLLM's default)")})
    # GPU only: the engine frees its weights and KV cache (sleep level 2) after each rollout phase
    # and wakes them for the next push and phase (docs/VLLM.md).
    enable_sleep_mode: bool = field(default=False, metadata={"help": (
        "vllm, GPU only: free the engine's weights and KV cache (level 2) after each rollout phase")})
    # Skip graph compilation (torch.compile, CUDA graphs): a fast engine start, slower sampling.
    # How a push writes the colocated engine's weights (vLLM >= 0.34, VLLM_RELOAD_MODE): layer by layer through a
    # staging copy (vLLM's default), or in place on the weights' own storage; both keep the tensors' addresses.
    reload_mode: Literal["layerwise", "direct"] = field(default="layerwise", metadata={"help": (
        "vllm: how a weight push writes the engine's weights: layerwise (vLLM's default, staged layer by layer) "
        "or direct (vLLM >= 0.34: written in place, no staging copy; not with lora_sync: adapter). A server takes "
        "it when started: maxent-grpo serve MODEL --reload-mode direct")})
    enforce_eager: bool = field(default=False, metadata={"help": (
        "vllm: no graph compilation (starts in seconds instead of minutes on CPU; samples slower)")})
    # Server backend: where `maxent-grpo serve` (vLLM's OpenAI-compatible server) listens.
    server_url: str = field(default="http://127.0.0.1:8000", metadata={"help": (
        "vllm_server: base URL of the server (maxent-grpo serve)")})
    # How new weights reach the server: a safetensors folder it reads (works anywhere). A transfer
    # over NCCL would need vLLM's weight-transfer API with CUDA on both ends (docs/VLLM.md).
    weight_sync: Literal["disk"] = field(default="disk", metadata={"help": (
        "vllm_server: disk (a safetensors folder the server reads); the only sync offered: NCCL transfer "
        "needs CUDA on trainer and server and is not offered (docs/VLLM.md)")})
    # Folder the disk sync writes into; the server must read it. null: /dev/shm for a server on this
    # machine (vllm_server.shared_memory_sync_dir), else OUTPUT_DIR/vllm_weights.
    sync_dir: str | None = field(default=None, metadata={"help": (
        "vllm_server disk sync: folder for the weights (null = /dev/shm for a server on this machine, "
        "else OUTPUT_DIR/vllm_weights)")})
    request_timeout_s: float = field(default=600.0, metadata={"help": "vllm_server: seconds to wait for one request"})
    # A server that stops answering (it died, or is being replaced) is waited for this long; then the
    # last pushed weights go to it again and the lost batch is sampled again (docs/VLLM.md).
    server_wait_s: float = field(default=300.0, metadata={"help": (
        "vllm_server: seconds to wait for a server that stopped answering (or a replacement at the same "
        "address) before the run stops with a checkpoint; it then gets the last pushed weights again and "
        "the lost batch is sampled again. 0: stop at once")})
    # How a LoRA policy reaches vLLM after each step: merged into the base weights (the whole model
    # per push, vLLM's plain kernels) or as the adapter itself (a few MB per push, vLLM's LoRA
    # kernels; a server must be started with `maxent-grpo serve --lora-rank R`). docs/VLLM.md.
    lora_sync: Literal["merged", "adapter"] = field(default="merged", metadata={"help": (
        "model.lora.enabled with a vLLM backend: push the adapters merged into the base weights (merged: "
        "the whole model per step) or the adapter alone (adapter: its A and B per step, sampled with "
        "vLLM's LoRA kernels; a server needs maxent-grpo serve --lora-rank R)")})



@dataclass(frozen=True)
class RolloutConfig:
    """How rollouts reach the trainer: the ``rollout`` section (docs/ASYNC.md, ALGORITHMS.md §15)."""

    max_staleness: int = field(default=0, metadata={"help": (
        "optimizer steps a sample may lag the weights it is trained on; 0: each step trains on rollouts of "
        "its own weights (synchronous); k >= 1: the next k steps' rollouts are sampled before (hf, vllm) or "
        "while (vllm_server) this step trains")})
    data_plane: Literal["local", "transferqueue"] = field(default="local", metadata={"help": (
        "where a step's rollouts wait for the trainer: local (in process) or transferqueue "
        "(the TransferQueue library; the transferqueue extra)")})
    transferqueue_ray: bool = field(default=True, metadata={"help": (
        "transferqueue: start its controller and storage as Ray actors (documented), or in this process "
        "without Ray (starts in under a second)")})
    transferqueue_ray_address: str | None = field(default=None, metadata={"help": (
        "transferqueue on Ray: null starts a private Ray instance in each trainer process (never a running "
        "cluster); HOST:PORT (a head node's `ray start --head --port`) or auto (the cluster `ray start` last "
        "started on this machine) joins that cluster, where rank 0 starts one plane that every trainer rank "
        "shares; the cluster is left running (docs/SCALING.md)")})
    wait_timeout_s: float = field(default=1800.0, metadata={"help": (
        "seconds the trainer waits for a step's rollouts before the run stops with a checkpoint")})
