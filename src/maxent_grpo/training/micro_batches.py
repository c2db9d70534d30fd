"""How many completions each forward/backward holds: ``training.micro_batch_size``.

A number is a fixed count. ``auto`` resolves against the machine (:func:`auto_rows`, at compile
time): on the CPU a fixed count of about 8 (its memory is not what limits a step there); on CUDA a
memory budget (:class:`MicroBatchBudget`) sized once the models are loaded, from the device's free
memory, less what the first optimizer step will still allocate (gradients and AdamW's moments) and
5% of the device for the allocator's fragmentation. Each step then fits as many whole groups in a
micro-batch as that budget holds at the step's own lengths (:meth:`MicroBatchBudget.rows`), so short
steps run fewer, fuller micro-batches and long ones more.

Micro-batches are always equal: the rows per micro-batch divide the step's rows. Whatever the
split, the step's gradient is the same, except under ``loss.loss_type: bnpo``, whose token mean is
taken per micro-batch (``core/losses.py``), as with a fixed count.

The bytes a micro-batch takes are the memory plan's estimate (``benchmarks/memory_plan.py``):
per token, the values autograd keeps (:meth:`Shape.saved_values_per_token`) in the compute dtype;
per completion position, one float32 row of logits over the vocabulary.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from maxent_grpo.errors import ConfigError
from maxent_grpo.training.distributed import Dist
from maxent_grpo.training.model_shape import Shape

GIB = 2**30
DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float64": 8}
MARGIN = 0.05  # of the device's memory: fragmentation and the CUDA context's growth
CPU_ROWS = 8  # auto on the CPU


def auto_rows(total: int, num_generations: int) -> int:
    """The fixed rows ``auto`` gives where memory does not size them (the CPU), and the rows of the
    no-grad passes under a budget: the most whole groups that divide ``total`` (a step's completions
    per process) in at most max(``CPU_ROWS``, one group)."""
    groups = total // num_generations
    per = max(1, CPU_ROWS // num_generations)
    return num_generations * max(k for k in range(1, groups + 1) if groups % k == 0 and k <= per)


@dataclass(frozen=True)
class MicroBatchBudget:
    """The bytes one micro-batch's forward/backward may take, and what a row costs.

    ``budget_bytes``: for a micro-batch's saved activations and logits; ``token_bytes``: the bytes
    autograd keeps per token (all layers, compute dtype); ``logit_bytes``: one completion
    position's float32 logits; ``num_generations``: micro-batches hold whole groups.
    """

    budget_bytes: int
    token_bytes: int
    logit_bytes: int
    num_generations: int

    def row_bytes(self, seq_len: int, completion_len: int) -> int:
        return seq_len * self.token_bytes + completion_len * self.logit_bytes

    def rows(self, total: int, seq_len: int, completion_len: int) -> int:
        """Rows per micro-batch for a step of ``total`` rows padded to ``seq_len`` (``completion_len``
        completion positions): the most whole groups dividing ``total`` whose bytes fit the budget;
        one group when not even that fits (it is the smallest micro-batch there is)."""
        g = self.num_generations
        groups = total // g
        fit = self.budget_bytes // max(self.row_bytes(seq_len, completion_len), 1)
        best = 1
        for k in range(1, groups + 1):
            if groups % k == 0 and k * g <= fit:
                best = k
        return best * g

    def describe(self) -> str:
        return (f"{self.budget_bytes / GIB:.1f} GiB per micro-batch, {self.token_bytes} B per token and "
                f"{self.logit_bytes} B per completion position")


def trained_bytes(model: torch.nn.Module) -> int:
    """This process's bytes of trained parameters (an FSDP2 shard counts its local part)."""
    from torch.distributed.tensor import DTensor

    total = 0
    for p in model.parameters():
        if p.requires_grad:
            local = p.to_local() if isinstance(p, DTensor) else p
            total += local.numel() * local.element_size()
    return total


def size_budget(*, free_bytes: int, device_bytes: int, trained: int, shape: Shape, compute_bytes: int,
                gradient_checkpointing: bool, num_generations: int) -> MicroBatchBudget:
    """The budget left by ``free_bytes`` (the device's free memory with every model loaded) once
    the gradients (1x the trained bytes) and AdamW's two moments (2x) are allocated, less
    ``MARGIN`` of ``device_bytes``. A ``ValueError`` when nothing is left."""
    budget = int(free_bytes - 3 * trained - MARGIN * device_bytes)
    if budget <= 0:
        raise ValueError(f"no memory left for a micro-batch: {free_bytes / GIB:.1f} GiB free with the models loaded, "
                         f"{3 * trained / GIB:.1f} GiB still to come for gradients and AdamW state")
    return MicroBatchBudget(
        budget_bytes=budget, token_bytes=compute_bytes * shape.saved_values_per_token(gradient_checkpointing),
        logit_bytes=4 * shape.vocab, num_generations=num_generations,
    )


def device_budget(model: torch.nn.Module, shape: Shape, dist: Dist, *, compute_bytes: int,
                  gradient_checkpointing: bool, num_generations: int) -> MicroBatchBudget:
    """:func:`size_budget` from this CUDA device as it is now (every model loaded): its free memory
    plus what torch's allocator holds unused, the smallest over ranks (every rank must split its
    step alike). A ConfigError naming the setting when nothing is left."""
    free, device_bytes = torch.cuda.mem_get_info(dist.device)
    free += torch.cuda.memory_reserved(dist.device) - torch.cuda.memory_allocated(dist.device)
    free = -dist.max_over_ranks([-free])[0]
    try:
        return size_budget(free_bytes=free, device_bytes=device_bytes, trained=trained_bytes(model), shape=shape,
                           compute_bytes=compute_bytes, gradient_checkpointing=gradient_checkpointing,
                           num_generations=num_generations)
    except ValueError as err:
        raise ConfigError(f"training.micro_batch_size: auto: {err}") from None
