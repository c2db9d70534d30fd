"""Checkpoints of an FSDP2 run: the folder of ``checkpoint.py``, written by every rank.

The model is gathered to rank 0 and saved in Hugging Face format, so
``from_pretrained`` and ``maxent-grpo eval`` read it without torch.distributed.
The optimizer state stays sharded: every rank writes its part with
``torch.distributed.checkpoint`` (DCP) into a staging folder that rank 0 then
moves into the checkpoint as ``optimizer/`` before writing the manifest, so the
checkpoint is still published by one atomic rename. The folder must be on a
file system every rank sees (one machine, or a shared one across nodes).

Both functions are collectives: every rank calls them. A save that fails (a full
disk, on any rank) fails on every rank alike, with a ``CheckpointError`` naming
the latest complete checkpoint, and leaves no staging folder behind.
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from safetensors import SafetensorError
from torch.distributed.checkpoint import CheckpointException
from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict, set_optimizer_state_dict

from maxent_grpo.training.checkpoint import (
    CheckpointError,
    CHECKPOINTS_DIRNAME,
    SHARDED_OPTIMIZER_DIR,
    describe_write_error,
    read_full_weights,
    restore_run_state,
    CheckpointContents,
    save_checkpoint,
    save_failed,
    verify_checkpoint,
)
from maxent_grpo.training.sharding import full_state_dict, load_full_state_dict


def save_sharded_checkpoint(
    output_dir: str | Path,
    step: int,
    *,
    model: torch.nn.Module,
    tokenizer: Any | None,
    optimizer: torch.optim.Optimizer,
    lr_scheduler: Any | None,
    trainer_state: dict,
    keep_last: int | None,
) -> Path | None:
    """Write ``OUTPUT_DIR/checkpoints/step-{step}`` from a sharded model (see the module notes);
    return the folder on rank 0, None elsewhere."""
    weights = full_state_dict(model)
    for name in _tied_copies(model):
        # save_pretrained drops these for an unsharded model; the gathered dict holds them as copies
        weights.pop(name, None)
    optim_state = get_optimizer_state_dict(model, optimizer)
    # Rank 0 names the staging folder (its pid marks it as its own, as for checkpoint.py's
    # .tmp folders, so an interrupted save is cleaned up the same way).
    name = [str(Path(output_dir) / CHECKPOINTS_DIRNAME / f".tmp-optimizer-step-{step}-{os.getpid()}")]
    dist.broadcast_object_list(name, src=0)
    staging = Path(name[0])
    failure = None
    try:
        dcp.save(optim_state, checkpoint_id=staging)
    except CheckpointException as err:
        # DCP gathers every rank's write error and raises them on all ranks, once all are done writing.
        failure = "; ".join(f"rank {rank}: {describe_write_error(exc, output_dir)}"
                            for rank, (exc, _) in sorted(err.failures.items()))
    path = None
    if dist.get_rank() == 0:
        if failure is None:
            try:
                path = save_checkpoint(output_dir, step, CheckpointContents(
                    model=model, tokenizer=tokenizer, optimizer=None, lr_scheduler=lr_scheduler,
                    trainer_state=trainer_state, model_state_dict=weights, sharded_optimizer=staging,
                ), keep_last=keep_last)
            except (OSError, SafetensorError) as err:  # its .tmp folder is removed, the older checkpoints kept
                failure = describe_write_error(err, output_dir)
        if failure is not None:
            # The shards written before the failure (save_checkpoint removes them once it has moved them).
            shutil.rmtree(staging, ignore_errors=True)
    # Instead of a barrier, which would hang the other ranks if rank 0 had failed: every rank
    # learns of a failure on any rank, and all raise the same error.
    # The all-gather is also the save's closing synchronisation: no rank goes on before rank 0
    # has published the checkpoint.
    failure = _first_failure(failure)
    if failure is not None:
        raise save_failed(output_dir, step, failure)
    return path


def _first_failure(failure: str | None) -> str | None:
    """The first rank's failure (None on every rank when no rank failed); a collective."""
    failures: list[str | None] = [None] * dist.get_world_size()
    dist.all_gather_object(failures, failure)
    return next((f for f in failures if f is not None), None)


def _tied_copies(model: torch.nn.Module) -> list[str]:
    """Names under which an already-named parameter appears again (a tied ``lm_head.weight``)."""
    first: dict[int, str] = {}
    copies = []
    for name, param in model.named_parameters(remove_duplicate=False):
        if id(param) in first:
            copies.append(name)
        first.setdefault(id(param), name)
    return copies


def load_sharded_checkpoint(
    path: str | Path, *, model: torch.nn.Module, optimizer: torch.optim.Optimizer, lr_scheduler: Any | None,
) -> dict:
    """Restore a checkpoint of an FSDP2 run into the sharded ``model`` and ``optimizer``; return trainer_state.

    Rank 0 reads the full weights and broadcasts them, each rank keeping its shard; DCP reads
    each rank's optimizer shard (it reshards when the number of processes has changed).
    """
    path = Path(path)
    if not verify_checkpoint(path):
        raise CheckpointError(f"{path} is not a valid checkpoint")
    if not (path / SHARDED_OPTIMIZER_DIR).is_dir():
        raise CheckpointError(f"checkpoint {path} holds an unsharded optimizer state (a DDP run): "
                         "resume it with training.strategy=ddp")
    load_full_state_dict(model, read_full_weights(path) if dist.get_rank() == 0 else {})
    # A template with this rank's shard shapes (DCP fills it in place); on a fresh
    # optimizer this creates its zero state first.
    optim_state = get_optimizer_state_dict(model, optimizer)
    dcp.load(optim_state, checkpoint_id=path / SHARDED_OPTIMIZER_DIR)
    set_optimizer_state_dict(model, optimizer, optim_state)
    return restore_run_state(path, lr_scheduler)
