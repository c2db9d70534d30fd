"""DDP against FSDP2 with bf16 compute, one step on the same rows (run with torchrun; the GPU tier).

``python -m torch.distributed.run --standalone --nproc_per_node N bf16_parallel_worker.py MODEL_DIR OUT``
(N = 2 with two GPUs, 1 with one: FSDP2 over one process still gathers in bf16 and reduces in
float32). Each side trains the float32 tiny model as the trainer does with ``model.dtype:
bfloat16`` on a GPU: DDP with bf16 autocast over float32 weights; FSDP2 with
``MixedPrecisionPolicy(param_dtype=bf16, reduce_dtype=fp32)`` and autocast. One ``grpo_step`` (SGD,
lr=1, so the update is minus the gradient) each; rank 0 writes both full updates to ``OUT``. NCCL
on CUDA, gloo elsewhere (the worker also runs on a CPU, slowly).
"""

from __future__ import annotations

import copy
import gc
import os
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from ddp_step_worker import build_rows, rank_micro_batches, spec  # noqa: E402
from fsdp2_step_worker import load_model  # noqa: E402


def main(model_dir: str, out_path: str) -> None:
    import torch.distributed as dist

    from maxent_grpo.training.distributed import Dist

    cuda = torch.cuda.is_available()
    device = torch.device("cuda", int(os.environ["LOCAL_RANK"])) if cuda else torch.device("cpu")
    if cuda:
        torch.cuda.set_device(device)
    dist.init_process_group("nccl" if cuda else "gloo")  # also with one process: FSDP2 needs a group
    try:
        _compare(Dist.current(), device, model_dir, out_path)
    finally:
        gc.collect()  # the models go before the group (training.distributed.process_group says why)
        dist.destroy_process_group()


def _compare(d, device: torch.device, model_dir: str, out_path: str) -> None:
    from maxent_grpo.core.logprobs import Scoring
    from maxent_grpo.core.step import Comm, grpo_step
    from maxent_grpo.training.distributed import DataParallelPolicy, ddp_gradient_sync
    from maxent_grpo.training.sharding import fsdp2_gradient_sync, full_state_dict, shard_model

    cuda = device.type == "cuda"
    base = load_model(model_dir)
    rows = {k: v.to(device) for k, v in build_rows(base).items()}
    mine = rank_micro_batches(rows, d.rank, d.world_size)
    scoring = Scoring(share_prompts=True, autocast_bf16=True)

    def train(model, train_model, gradient_sync) -> None:
        grpo_step(train_model, torch.optim.SGD(model.parameters(), lr=1.0), mine, spec(beta=0.05, loss_type="dapo"),
                  scoring, comm=Comm(d.world_size, d.all_reduce_sum, gradient_sync))

    plain = copy.deepcopy(base).to(device)
    before = {k: v.detach().cpu().clone() for k, v in plain.state_dict().items()}
    ddp = DataParallelPolicy(plain, device_ids=[device.index] if cuda else None, gradient_as_bucket_view=True)
    train(plain, ddp, ddp_gradient_sync(ddp))
    ddp_update = {k: before[k] - v.detach().cpu() for k, v in plain.state_dict().items()}

    sharded = shard_model(copy.deepcopy(base).to(device), mixed_precision=True)
    # A copy: in one process full_state_dict can hand back the live tensors, which the step then moves.
    start = {k: v.detach().clone() for k, v in full_state_dict(sharded).items()}
    train(sharded, sharded, fsdp2_gradient_sync(sharded))
    after = full_state_dict(sharded)
    if d.is_main:
        torch.save({"ddp": ddp_update, "fsdp2": {k: start[k] - after[k] for k in start}, "world_size": d.world_size,
                    "param_dtypes": sorted({str(p.dtype) for p in sharded.parameters()})}, out_path)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
