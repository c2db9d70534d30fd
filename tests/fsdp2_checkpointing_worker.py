"""Activation checkpointing under FSDP2 (run with torchrun): the same step with it off and on.

``python -m torch.distributed.run --standalone --nproc_per_node 2 fsdp2_checkpointing_worker.py MODEL_DIR OUT``
shards the tiny model (checkpointing enabled before ``fully_shard``, as the trainer does), runs one
``grpo_step`` (SGD, lr=1) each way and writes rank 0's full updates and the number of times the
first layer's MLP ran to ``OUT``.
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from ddp_step_worker import all_reduce_sum, build_rows, rank_micro_batches, step  # noqa: E402
from fsdp2_step_worker import load_model  # noqa: E402


def main(model_dir: str, out_path: str) -> None:
    import torch.distributed as dist

    from maxent_grpo.core.step import Comm
    from maxent_grpo.models import enable_activation_checkpointing
    from maxent_grpo.training.sharding import fsdp2_gradient_sync, full_state_dict, shard_model

    rank, world = dist.get_rank(), dist.get_world_size()

    saved = {}
    for name in ("off", "on"):
        model = load_model(model_dir).eval()  # as the trainer loads it
        rows = build_rows(model)
        if name == "on":
            enable_activation_checkpointing(model)
        calls: list = []
        model.model.layers[0].mlp.register_forward_pre_hook(lambda *_, calls=calls: calls.append(1))
        shard_model(model)
        before = full_state_dict(model)
        mine = rank_micro_batches(rows, rank, world)
        step(model, torch.optim.SGD(model.parameters(), lr=1.0), mine, beta=0.05, loss_type="dapo",
             share_prompts=False, comm=Comm(world, all_reduce_sum, fsdp2_gradient_sync(model)))
        after = full_state_dict(model)
        saved[name] = {"grads": {k: before[k] - after[k] for k in before}, "mlp_calls": len(calls)}
    if rank == 0:
        torch.save(saved, out_path)


if __name__ == "__main__":
    from maxent_grpo.training.distributed import process_group

    # The group ends after main's objects are gone (process_group's docstring: a gloo group
    # destroyed while a model still holds it can abort or hang a rank at exit).
    with process_group(timeout_minutes=5):
        main(sys.argv[1], sys.argv[2])
