"""A 2-process FSDP2 step (run with torchrun), the sharded twin of ``ddp_step_worker.py``.

``python -m torch.distributed.run --standalone --nproc_per_node 2 fsdp2_step_worker.py MODEL_DIR OUT``
loads the tiny model in float32, shards it (``training.sharding``), checks that
the gathered state dict and the streamed ``full_state_items`` (the vLLM weight push) equal the
loaded weights, runs one ``grpo_step`` (SGD, lr=1, rows split over the ranks,
two micro-batches each, shared prompts and the fused LM head on: the training
defaults) and writes rank 0's full parameter update (= minus the gradient) to ``OUT``.
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from ddp_step_worker import LENGTHS, build_rows, micro_batches  # noqa: E402


def load_model(model_dir: str) -> torch.nn.Module:
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).train()


def main(model_dir: str, out_path: str) -> None:
    import torch.distributed as dist

    from maxent_grpo.core.step import grpo_step
    from maxent_grpo.rollout.vllm_common import full_state_items
    from maxent_grpo.training.sharding import full_state_dict, shard_model

    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    model = load_model(model_dir)
    loaded = {k: v.detach().clone() for k, v in model.state_dict().items()}
    rows = build_rows(model)
    shard_model(model)
    before = full_state_dict(model)
    streamed = {k: v.cpu() for k, v in full_state_items(model)}  # what a weight push streams
    half = len(LENGTHS) // world
    lo = rank * half
    mine = micro_batches(rows, [(lo, lo + half // 2), (lo + half // 2, lo + half)])

    def all_reduce_sum(t: torch.Tensor) -> torch.Tensor:
        dist.all_reduce(t)
        return t

    result = grpo_step(model, torch.optim.SGD(model.parameters(), lr=1.0), mine, num_generations=4,
                       beta=0.05, loss_type="dapo", all_reduce_sum=all_reduce_sum, world_size=world)
    after = full_state_dict(model)
    if rank == 0:
        torch.save({
            "loaded": loaded, "gathered": before, "streamed": streamed,
            "grads": {k: before[k] - after[k] for k in before},
            "loss": result.loss, "metrics": result.metrics,
        }, out_path)
    dist.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
