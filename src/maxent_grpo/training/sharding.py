"""FSDP2 (``training.strategy: fsdp2``): shard a model over the processes, gather its full weights back.

Each decoder layer (the model's ``_no_split_modules``) becomes one FSDP2 unit,
then the root takes what is left (embeddings, final norm, LM head; a tied LM
head is the embedding's parameter, so it lives in the root unit once). The
model stays the same ``nn.Module`` with the same parameter names, now DTensors
holding ``1/world_size`` of each tensor; a unit's full weights exist only while
its forward or backward runs. Gradients are reduce-scattered and averaged over
ranks as DDP averages them, so ``grpo_step``'s ``world_size`` factor is the same.

Every function here except :func:`shard_model` is a collective: all ranks call
it, in the same order.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager, contextmanager

import torch
import torch.distributed as dist
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    set_model_state_dict,
)
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard


def _layer_class_names(model: torch.nn.Module) -> set[str]:
    base = model.get_base_model() if hasattr(model, "peft_config") else model
    names = base._no_split_modules
    if not names:
        raise ValueError(f"{type(base).__name__} declares no _no_split_modules: cannot find its decoder layers")
    return set(names)


def shard_model(model: torch.nn.Module, *, mixed_precision: bool = False) -> torch.nn.Module:
    """``fully_shard`` each decoder layer, then the root; returns ``model`` (changed in place).

    ``mixed_precision``: gather weights in bfloat16 for the forward and backward and
    reduce gradients in float32 (``MixedPrecisionPolicy``), the parameters and the
    optimizer staying float32. Meant for GPUs; it ran in the CUDA test tier, one process on one GPU
    (docs/SCALING.md).
    """
    policy = (
        MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
        if mixed_precision else MixedPrecisionPolicy()
    )
    names = _layer_class_names(model)
    layers = [m for m in model.modules() if type(m).__name__ in names]
    if not layers:
        raise ValueError(f"no module of {type(model).__name__} is one of its decoder layer classes {sorted(names)}")
    for layer in layers:
        fully_shard(layer, mp_policy=policy)
    fully_shard(model, mp_policy=policy)
    return model


def fsdp2_gradient_sync(model: torch.nn.Module) -> Callable[[bool], AbstractContextManager]:
    """``grpo_step``'s ``gradient_sync`` for FSDP2: gradients are reduce-scattered only in the last
    micro-batch's backward (``set_requires_gradient_sync``). The price: until then each rank holds
    the unsharded gradients of the micro-batches before it."""

    @contextmanager
    def sync(is_last: bool) -> Iterator[None]:
        model.set_requires_gradient_sync(is_last)
        yield

    return sync


def full_state_dict(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """The whole model's state dict on rank 0, on the CPU (the other ranks get an empty dict).

    Names are the Hugging Face names (no wrapper prefixes); a tied ``lm_head.weight`` is included.
    """
    return get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))


def load_full_state_dict(model: torch.nn.Module, state: dict[str, torch.Tensor], *, strict: bool = False) -> None:
    """Load full (unsharded) tensors, given on rank 0 alone (the others pass ``{}``), into the
    sharded ``model``: rank 0 broadcasts each tensor and every rank keeps its shard. Not strict
    by default: a checkpoint written by ``save_pretrained`` holds a tied head once."""
    set_model_state_dict(model, state, options=StateDictOptions(
        full_state_dict=True, broadcast_from_rank0=True, strict=strict))


def materialize(model: torch.nn.Module, source: torch.nn.Module | None, device: torch.device) -> None:
    """Allocate a ``model`` sharded on the meta device (:func:`shard_model` of ``empty_model``) on
    ``device`` and fill it from ``source``, the whole model, which rank 0 alone holds (None on the
    others): no rank but 0 ever holds more than its shard.

    The state dict carries the parameters and persistent buffers. The non-persistent ones (a
    rotary embedding's ``inv_freq``) are computed at construction, which the meta device skips, and
    no state dict holds them: ``to_empty`` leaves them uninitialised memory on every rank, a model
    that runs and computes nonsense. They are broadcast from ``source`` as well. A tied head stays
    the embedding's parameter: FSDP2 shards a parameter shared by two modules once.
    """
    model.to_empty(device=device)
    state = {} if source is None else source.state_dict()
    persistent = set(model.state_dict())
    for name, buffer in model.named_buffers():
        if name not in persistent:
            if source is not None:
                buffer.copy_(source.get_buffer(name))
            dist.broadcast(buffer, src=0)
    load_full_state_dict(model, state, strict=True)
