"""The weights a vLLM engine takes from the policy: ``(name, tensor)`` in the engine's dtype, under the names
of the base model's checkpoint (what vLLM's ``load_weights`` expects).

* Every tensor of ``state_dict()``, not of ``named_parameters()``: a tied
  ``lm_head.weight`` is only there, and an engine that is not sent it keeps
  its old head.
* Each tensor is cast to the engine's dtype *before* it is gathered: under
  FSDP2 the local shard is cast and the gather moves bf16, not fp32. A tied
  head is cast and gathered once (the second name reuses the first tensor,
  which is therefore held until then).
* A LoRA policy (peft) is pushed merged: for each adapted layer the base
  weight plus ``scaling * B @ A`` (peft's ``get_delta_weight``), summed in
  float32 and then cast, under the base layer's own name; the adapter tensors
  themselves are not sent. The trained peft model is not changed (no
  ``merge_adapter``): the push reads it only.
* With ``generation.vllm.lora_sync: adapter`` the engine keeps the base weights
  it loaded and takes the adapter alone (:func:`write_adapter`): peft's
  ``adapter_model.safetensors`` (its ``lora_A`` / ``lora_B`` under peft's names,
  in the engine's dtype) and ``adapter_config.json``, which vLLM's LoRA loader
  reads, ``use_rslora`` included. Each push is a new folder under a new name, so
  no cache of vLLM's that is keyed by the adapter serves an older version.
"""

from __future__ import annotations

import shutil
from collections import Counter
from collections.abc import Iterator
from pathlib import Path

import torch
from torch.distributed.tensor import DTensor

_BASE_LAYER = ".base_layer."


def full_state_items(policy: torch.nn.Module, dtype: torch.dtype | None = None, *,
                     merge_lora: bool = True) -> Iterator[tuple[str, torch.Tensor]]:
    """``(name, tensor)`` of every weight the engine needs, cast to ``dtype`` (None: as stored), gathered whole.
    ``merge_lora=False``: a LoRA policy's base weights alone (for an engine that takes the adapter apart)."""
    from peft import PeftModel  # a dependency of the package; imported here to keep this module light
    from peft.tuners.lora import LoraLayer

    if not isinstance(policy, PeftModel):
        return _items(list(policy.state_dict(keep_vars=True).items()), {}, dtype)
    base = policy.get_base_model()
    adapted = {name: m for name, m in base.named_modules() if isinstance(m, LoraLayer)} if merge_lora else {}
    named = [(name.replace(_BASE_LAYER, "."), t) for name, t in base.state_dict(keep_vars=True).items()
             if ".lora_" not in name]  # lora_A / lora_B / lora_embedding_*: folded into their base weight, or apart
    return _items(named, adapted, dtype)


def _items(named: list, adapted: dict, dtype: torch.dtype | None) -> Iterator[tuple[str, torch.Tensor]]:
    """In ``state_dict`` order (vLLM reloads layer by layer). A tied weight is the same parameter object
    under two names (``keep_vars=True``): gathered once, held until its last name."""
    left = Counter(id(t) for _, t in named)
    done: dict[int, torch.Tensor] = {}
    for name, tensor in named:
        key = id(tensor)
        if key not in done:
            module_name, _, leaf = name.rpartition(".")
            layer = adapted.get(module_name) if leaf == "weight" else None
            done[key] = _gathered(tensor, dtype) if layer is None else _merged_weight(layer, tensor, dtype)
        yield name, done[key]
        left[key] -= 1
        if not left[key]:
            del done[key]


def _gathered(tensor: torch.Tensor, dtype: torch.dtype | None) -> torch.Tensor:
    t = tensor.detach()
    if dtype is not None:
        t = t.to(dtype)  # a DTensor stays sharded: only the local shard is cast
    if isinstance(t, DTensor):
        t = t.full_tensor()
    return t


def _merged_weight(layer, weight: torch.Tensor, dtype: torch.dtype | None) -> torch.Tensor:
    """``weight + sum over active adapters of scaling * B @ A`` (peft's ``get_delta_weight``, in the
    adapters' dtype), summed in float32 or wider, then cast."""
    if layer.merged:
        raise RuntimeError("the LoRA adapters are merged into the base weights already; the push expects them apart")
    wide = torch.promote_types(torch.float32, dtype if dtype is not None else weight.dtype)
    merged = weight.detach().to(wide)
    if not layer.disable_adapters:
        for adapter in layer.active_adapters:
            if adapter not in layer.lora_A and adapter not in layer.lora_embedding_A:
                continue
            if layer.use_dora.get(adapter, False):
                raise RuntimeError("DoRA adapters cannot be pushed merged to vLLM")
            merged = merged + layer.get_delta_weight(adapter).to(wide)
    return merged.to(dtype if dtype is not None else weight.dtype)


# The ranks vLLM's LoRA engine can be planned for (vllm.config.lora.MaxLoRARanks).
ENGINE_LORA_RANKS = (1, 8, 16, 32, 64, 128, 256, 320, 512)


def adapter_rank(policy: torch.nn.Module) -> int:
    """The rank of ``policy``'s one LoRA adapter; a one-line error for what vLLM cannot take as an adapter."""
    from peft import PeftModel

    if not isinstance(policy, PeftModel):
        raise ValueError("generation.vllm.lora_sync: adapter needs a LoRA policy (model.lora.enabled)")
    config = policy.peft_config[policy.active_adapter]
    if config.use_dora or config.modules_to_save:
        raise ValueError("generation.vllm.lora_sync: adapter cannot send DoRA or modules_to_save; use merged")
    return int(config.r)


def engine_lora_rank(rank: int) -> int:
    """The smallest rank vLLM's LoRA engine plans for that holds an adapter of ``rank``."""
    fits = [r for r in ENGINE_LORA_RANKS if r >= rank]
    if not fits:
        raise ValueError(f"model.lora.r={rank}: vLLM's LoRA engine takes ranks up to {ENGINE_LORA_RANKS[-1]}")
    return fits[0]


def write_adapter(policy: torch.nn.Module, root: Path, version: int, dtype: torch.dtype | None) -> tuple[Path, int]:
    """Write ``policy``'s adapter for ``version`` into ``root/adapter-<version>`` (renamed into place when
    complete, so vLLM never reads half of it), cast to ``dtype``; remove the folders of older versions.
    Returns the folder and the bytes of its tensors."""
    from peft import get_peft_model_state_dict
    from safetensors.torch import save_file

    final, tmp = root / f"adapter-{version:06d}", root / f".tmp-adapter-{version:06d}"
    for stale in (tmp, final):  # left by an earlier run in this folder
        if stale.exists():
            shutil.rmtree(stale)
    tmp.mkdir(parents=True)
    tensors = {name: _gathered(t, dtype).to("cpu", copy=True).contiguous()
               for name, t in get_peft_model_state_dict(policy).items()}
    save_file(tensors, str(tmp / "adapter_model.safetensors"))
    policy.peft_config[policy.active_adapter].save_pretrained(str(tmp))
    tmp.replace(final)
    for old in root.glob("adapter-*"):
        if old != final:
            shutil.rmtree(old)
    return final, sum(t.numel() * t.element_size() for t in tensors.values())
