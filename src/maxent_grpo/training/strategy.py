"""How the policy is spread over the processes (``training.strategy``): ``STRATEGIES[name]``.

A strategy owns what differs between whole-model data parallelism and sharding:
loading the policy (before the optimizer exists) and the reference model, wrapping
the policy for training (and ``grpo_step``'s ``gradient_sync``), and saving and
loading checkpoints with their failure protocol. The loop and the setup call it
and never ask which one they hold.

* ``ddp``: every process holds the whole model; one process alone is plain
  training. Rank 0 writes the checkpoint and tells every rank whether it worked.
* ``fsdp2``: ``training/sharding.py`` (every forward is a collective, so all
  ranks sample in lockstep); every rank writes its optimizer shard
  (``training/sharded_checkpoint.py``).

The class attributes are what ``config/load.py`` checks before any model loads.
"""

from __future__ import annotations

import copy
from collections.abc import Callable
from contextlib import AbstractContextManager
from pathlib import Path
from typing import Any, ClassVar

import torch
from safetensors import SafetensorError

from maxent_grpo.errors import UserError
from maxent_grpo.models import empty_model, load_model, load_reference_model, parse_dtype
from maxent_grpo.training.checkpoint import (
    CheckpointContents, describe_write_error, load_checkpoint, save_checkpoint, save_failed,
)
from maxent_grpo.training.distributed import DataParallelPolicy, Dist, ddp_gradient_sync
from maxent_grpo.training.sharded_checkpoint import load_sharded_checkpoint, save_sharded_checkpoint
from maxent_grpo.training.sharding import fsdp2_gradient_sync, materialize, shard_model

GradientSync = Callable[[bool], AbstractContextManager]
Adapt = Callable[[torch.nn.Module], torch.nn.Module]


class Strategy:
    name: ClassVar[str]
    min_processes: ClassVar[int] = 1
    supports_lora: ClassVar[bool] = True
    # A reference that follows the policy (loss.sync_ref_model): mixed parameter by parameter and saved
    # with each checkpoint, which needs it whole on each process.
    supports_reference_sync: ClassVar[bool] = True
    # Every forward of the policy is a collective: HF sampling must run in lockstep on
    # every rank, so nothing may make ranks run different numbers of forwards.
    collective_forward: ClassVar[bool] = False
    # Takes a model given as a Python object (maxent_grpo.train, GRPOTrainer), trained in place.
    adopts_model: ClassVar[bool] = True

    def __init__(self, dist: Dist):
        self.dist = dist

    def adopt_policy(self, model: torch.nn.Module, *, dtype: str | None, adapt: Adapt) -> torch.nn.Module:
        """A policy given as a Python object: moved to this process's device (and to ``dtype``, the master
        dtype of weights trained in full; None leaves a peft model's dtypes as peft made them), in eval
        mode as ``from_pretrained`` leaves a model (no dropout), changed by ``adapt``; trained in place."""
        self._check_device(model)
        model = model.to(self.dist.device) if dtype is None else model.to(device=self.dist.device, dtype=parse_dtype(dtype))
        return adapt(model.eval())

    def adopt_reference(self, model: torch.nn.Module, *, dtype: str) -> torch.nn.Module:
        """The frozen reference of a policy given as an object: a copy of its start weights in ``dtype``."""
        self._check_device(model)
        reference = copy.deepcopy(model).to(device=self.dist.device, dtype=parse_dtype(dtype))
        return reference.eval().requires_grad_(False)

    def _check_device(self, model: torch.nn.Module) -> None:
        here = self.dist.device
        there = next(model.parameters()).device
        if there.type != "cpu" and there != here:
            raise UserError(f"model: the {type(model).__name__} object is on {there}, but this process trains on "
                            f"{here}; give it on the CPU or on {here}")

    def load_policy(self, path: str, *, dtype: str, adapt: Adapt, bf16_compute: bool) -> torch.nn.Module:
        """The trained policy of ``path`` in ``dtype``, changed by ``adapt`` (LoRA, activation
        checkpointing) and placed on this process's device, ready for the optimizer."""
        return adapt(load_model(path, dtype, self.dist.device))

    def load_reference(self, path: str, *, dtype: str) -> torch.nn.Module:
        """The frozen reference model of ``path``, placed like the policy."""
        return load_reference_model(path, dtype, self.dist.device)

    def wrap(self, model: torch.nn.Module) -> tuple[torch.nn.Module, GradientSync | None]:
        """The module the step trains through, and ``grpo_step``'s ``gradient_sync``."""
        return model, None

    def save(self, output_dir: Path, step: int, *, model: torch.nn.Module, tokenizer: Any,
             optimizer: torch.optim.Optimizer, lr_scheduler: Any, trainer_state: dict,
             keep_last: int | None, reference_state: dict | None = None) -> Path | None:
        """Write checkpoint ``step`` (a collective); every rank returns its folder, or raises the same
        error if any write failed. ``reference_state``: a reference that follows the policy (only
        where ``supports_reference_sync``)."""
        raise NotImplementedError

    def load(self, ckpt: Path, *, model: torch.nn.Module, optimizer: torch.optim.Optimizer,
             lr_scheduler: Any) -> dict:
        """Restore ``ckpt`` into the model and optimizer; return its trainer state."""
        raise NotImplementedError


class DDPStrategy(Strategy):
    name = "ddp"

    def wrap(self, model: torch.nn.Module) -> tuple[torch.nn.Module, GradientSync | None]:
        if self.dist.world_size == 1:
            return model, None
        device = self.dist.device
        ddp = DataParallelPolicy(model, device_ids=[device.index] if device.type == "cuda" else None,
                                 gradient_as_bucket_view=True)
        return ddp, ddp_gradient_sync(ddp)

    def save(self, output_dir, step, *, model, tokenizer, optimizer, lr_scheduler, trainer_state, keep_last,
             reference_state=None):
        path, failure = None, None
        if self.dist.is_main:
            try:
                path = save_checkpoint(output_dir, step, CheckpointContents(
                    model=model, tokenizer=tokenizer, optimizer=optimizer, lr_scheduler=lr_scheduler,
                    trainer_state=trainer_state, reference_state=reference_state,
                ), keep_last=keep_last)
            # Disk full, permissions (safetensors reports the same I/O errors as its own): the
            # earlier checkpoints are untouched.
            except (OSError, SafetensorError) as err:
                failure = describe_write_error(err, output_dir)
        # Also the barrier: every rank learns whether the save worked, and where it went (for its messages).
        path, failure = self.dist.broadcast_object((path, failure))
        if failure is not None:
            raise save_failed(output_dir, step, failure)
        return path

    def load(self, ckpt, *, model, optimizer, lr_scheduler):
        return load_checkpoint(ckpt, model=model, optimizer=optimizer, lr_scheduler=lr_scheduler)


class FSDP2Strategy(Strategy):
    name = "fsdp2"
    min_processes = 2
    supports_lora = False
    supports_reference_sync = False  # the reference is sharded like the policy (config_rules refuses the sync)
    collective_forward = True
    adopts_model = False  # rank 0 alone reads the weights; a model object would need broadcasting whole

    # Every rank builds the model on the meta device and shards it; rank 0 alone reads the weights
    # (into host memory) and broadcasts them, so no GPU ever holds the whole model
    # (sharding.materialize). Resuming broadcasts rank 0's read of the checkpoint the same way.
    def load_policy(self, path, *, dtype, adapt, bf16_compute):
        model = adapt(empty_model(path, dtype))
        # bf16 gathers with float32 reduction: meant for GPUs (docs/SCALING.md).
        shard_model(model, mixed_precision=self.dist.device.type == "cuda" and bf16_compute)
        self._fill(model, path, dtype)
        return model

    def load_reference(self, path, *, dtype):
        reference = empty_model(path, dtype).requires_grad_(False)
        shard_model(reference)
        self._fill(reference, path, dtype)
        return reference

    def _fill(self, model: torch.nn.Module, path: str, dtype: str) -> None:
        materialize(model, load_model(path, dtype) if self.dist.is_main else None, self.dist.device)

    def wrap(self, model):
        return model, fsdp2_gradient_sync(model)

    def save(self, output_dir, step, *, model, tokenizer, optimizer, lr_scheduler, trainer_state, keep_last,
             reference_state=None):
        path = save_sharded_checkpoint(
            output_dir, step, model=model, tokenizer=tokenizer, optimizer=optimizer, lr_scheduler=lr_scheduler,
            trainer_state=trainer_state, keep_last=keep_last,
        )
        return self.dist.broadcast_object(path)  # rank 0's folder, for every rank's messages

    def load(self, ckpt, *, model, optimizer, lr_scheduler):
        return load_sharded_checkpoint(ckpt, model=model, optimizer=optimizer, lr_scheduler=lr_scheduler)


STRATEGIES: dict[str, type[Strategy]] = {s.name: s for s in (DDPStrategy, FSDP2Strategy)}
