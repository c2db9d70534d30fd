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
    optimizer staying float32. Meant for GPUs; it was not run here (docs/SCALING.md).
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


def load_full_state_dict(model: torch.nn.Module, state: dict[str, torch.Tensor]) -> None:
    """Load full (unsharded) tensors, given on every rank, into the sharded ``model``."""
    set_model_state_dict(model, state, options=StateDictOptions(full_state_dict=True, strict=False))
