"""A float32 LM head under bf16 compute (``model.lm_head_fp32``; TRL's ``cast_lm_head_to_fp32``).

Under bf16 compute (autocast, a bf16 sampling copy) the LM head's matmul returns bf16 logits:
each logit is rounded to 8 significant bits, an error of about ``|z| * 2**-9`` nats that the
sampler and the trainer make differently (different kernels, different shapes), so the two
disagree on every token's log-prob. ScaleRL (arXiv:2510.13786) computes the head in float32;
TRL offers it as ``cast_lm_head_to_fp32``; it is one of the known remedies for the
sampler/trainer log-prob gap (ALGORITHMS.md §15).

:func:`use_fp32_head` makes the model's output embedding a :class:`Float32Head`: the same
``nn.Linear`` (same object, same parameters, same state dict), whose forward runs
``h W^T + b`` in float32 with autocast off. The log-softmax after it already runs in float32
(``chunked_softmax``, the samplers). The fused head of the trainer (``fused_lm_head``) reads
:func:`is_fp32_head` and builds its chunks of logits the same way. The weights keep their
dtype: float32 master weights are already float32, a bf16 frozen reference is upcast exactly.
:func:`keep_head_float32` is for a sampling copy in bf16: its head stays float32, so it computes
the trainer's head logits from the trainer's head weights.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


class Float32Head(torch.nn.Linear):
    """An ``nn.Linear`` LM head whose forward computes ``x W^T + b`` in float32, autocast off.

    Made by changing an existing head's class (:func:`use_fp32_head`), not by building a new
    module: wrappers that hold the module (DDP, FSDP2, peft) and tied embeddings keep theirs.
    """

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        with torch.autocast(x.device.type, enabled=False):
            bias = None if self.bias is None else self.bias.float()
            return F.linear(x.float(), self.weight.float(), bias)


def is_fp32_head(head: torch.nn.Module) -> bool:
    """Whether ``head`` computes its logits in float32 (:class:`Float32Head`)."""
    return isinstance(head, Float32Head)


def has_linear_head(model: torch.nn.Module) -> bool:
    """Whether ``model``'s LM head is a plain ``nn.Linear`` (peft wraps a targeted head in its LoRA layer)."""
    return type(model.get_output_embeddings()) in (torch.nn.Linear, Float32Head)


def _output_embeddings(model: torch.nn.Module) -> torch.nn.Module:
    if not has_linear_head(model):
        raise ValueError(f"the LM head must be a plain nn.Linear, got {type(model.get_output_embeddings()).__name__}")
    return model.get_output_embeddings()


def use_fp32_head(model: torch.nn.Module) -> torch.nn.Module:
    """Make ``model``'s LM head a :class:`Float32Head` in place; returns ``model``."""
    _output_embeddings(model).__class__ = Float32Head
    return model


def keep_head_float32(model: torch.nn.Module) -> None:
    """Store a bf16 copy's LM head in float32 (its input embeddings too, when tied to it), casting
    the embeddings' output back to the rest of the model's dtype. For a sampling copy whose head
    is a :class:`Float32Head`; the trainer's float32 head weights then reach it unrounded."""
    head = _output_embeddings(model)
    embed = model.get_input_embeddings()
    dtype = embed.weight.dtype
    head.float()
    if embed.weight is head.weight and dtype != torch.float32:
        embed.register_forward_hook(lambda _module, _inputs, out: out.to(dtype))
