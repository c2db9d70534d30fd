"""A 2-process FSDP2 step (run with torchrun), the sharded twin of ``ddp_step_worker.py``.

``python -m torch.distributed.run --standalone --nproc_per_node 2 fsdp2_step_worker.py MODEL_DIR OUT``
loads the tiny model in float32, shards it (``training.sharding``), checks that
the gathered state dict and the streamed ``full_state_items`` (the vLLM weight push) equal the
loaded weights, runs one ``grpo_step`` (SGD, lr=1, rows split over the ranks,
two micro-batches each, shared prompts and the fused LM head on: the training
defaults), and one more on groups that share their prompts in the one-pass layout
(``inline_prompts``), and writes rank 0's full parameter updates (= minus the gradient) to ``OUT``.
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from ddp_step_worker import all_reduce_sum, build_rows, build_shared_rows, rank_micro_batches, step  # noqa: E402

from maxent_grpo.core.step import Comm  # noqa: E402


def load_model(model_dir: str) -> torch.nn.Module:
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).train()


def main(model_dir: str, out_path: str) -> None:
    import torch.distributed as dist

    from maxent_grpo.rollout.vllm_weights import full_state_items
    from torch.distributed.fsdp import FSDPModule

    from maxent_grpo.training.sharding import fsdp2_gradient_sync, full_state_dict, shard_model

    rank, world = dist.get_rank(), dist.get_world_size()
    model = load_model(model_dir)
    loaded = {k: v.detach().clone() for k, v in model.state_dict().items()}
    rows = build_rows(model)
    shard_model(model)
    before = full_state_dict(model)
    streamed = {k: v.cpu() for k, v in full_state_items(model)}  # what a weight push streams
    mine = rank_micro_batches(rows, rank, world)

    reduce_scatters = _count_reduce_scatters(model)
    result = step(model, torch.optim.SGD(model.parameters(), lr=1.0), mine, beta=0.05, loss_type="dapo",
                  comm=Comm(world, all_reduce_sum, fsdp2_gradient_sync(model)))
    after = full_state_dict(model)
    # The same step reducing after every micro-batch: the reduce-scatters the trainer's sync saves.
    every = load_model(model_dir)
    shard_model(every)
    every_reduce_scatters = _count_reduce_scatters(every)
    step(every, torch.optim.SGD(every.parameters(), lr=1.0), mine, beta=0.05, loss_type="dapo",
         comm=Comm(world, all_reduce_sum))
    every_after = full_state_dict(every)
    # The one-pass layout on groups that share their prompts: each prompt once, in the sharded forward.
    inline = load_model(model_dir)
    shared = build_shared_rows(inline)
    shard_model(inline)
    inline_before = full_state_dict(inline)
    inline_result = step(inline, torch.optim.SGD(inline.parameters(), lr=1.0), rank_micro_batches(shared, rank, world),
                         beta=0.05, loss_type="dapo", inline_prompts=True,
                         comm=Comm(world, all_reduce_sum, fsdp2_gradient_sync(inline)))
    inline_after = full_state_dict(inline)
    if rank == 0:
        torch.save({
            "loaded": loaded, "gathered": before, "streamed": streamed,
            "grads": {k: before[k] - after[k] for k in before},
            "grads_every": {k: before[k] - every_after[k] for k in before},
            "loss": result.loss, "metrics": result.metrics,
            "grads_inline": {k: inline_before[k] - inline_after[k] for k in inline_before},
            "loss_inline": inline_result.loss,
            "reduce_scatters": len(reduce_scatters), "every_reduce_scatters": len(every_reduce_scatters),
            "units": sum(isinstance(m, FSDPModule) for m in model.modules()),
        }, out_path)


def _count_reduce_scatters(model: torch.nn.Module) -> list:
    """Route every FSDP2 unit's gradient reduce-scatter through a counting copy of the default one
    (FSDP2's own hook for a custom reduce-scatter); returns the list it appends to."""
    from torch.distributed.fsdp import FSDPModule
    from torch.distributed.fsdp._fully_shard._fsdp_collectives import DefaultReduceScatter

    calls: list = []

    class Counting(DefaultReduceScatter):
        def __call__(self, *args, **kwargs):
            calls.append(1)
            return super().__call__(*args, **kwargs)

    for module in model.modules():
        if isinstance(module, FSDPModule):
            module.set_custom_reduce_scatter(Counting())
    return calls


if __name__ == "__main__":
    from maxent_grpo.training.distributed import process_group

    # The group ends after main's objects are gone (process_group's docstring: a gloo group
    # destroyed while a model still holds it can abort or hang a rank at exit).
    with process_group(timeout_minutes=5):
        main(sys.argv[1], sys.argv[2])
