"""The FSDP2 broadcast load against today's full load (run with torchrun).

``python -m torch.distributed.run --standalone --nproc_per_node 2 fsdp2_load_worker.py MODEL_DIR OUT_DIR``
builds the tiny model (Llama with a tied LM head, as SmolLM2) two ways: every rank reading the
whole model and sharding it (the load before issue 21), and ``FSDP2Strategy.load_policy``
(meta device on every rank, rank 0 reads and broadcasts). Both take one AdamW step on the
same micro-batches. The broadcast-loaded model is then saved as a checkpoint, resumed into a
fresh meta-built model, and both take a second step. Rank 0 writes ``OUT_DIR/result.pt``.
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from ddp_step_worker import all_reduce_sum, build_rows, rank_micro_batches, step  # noqa: E402

from maxent_grpo.core.step import Comm  # noqa: E402


def _buffers(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {name: b.detach().clone() for name, b in model.named_buffers()}


def _tied(model: torch.nn.Module) -> bool:
    return model.lm_head.weight is model.model.embed_tokens.weight


def main(model_dir: str, out_dir: str) -> None:
    import torch.distributed as dist

    from maxent_grpo.models import load_model
    from maxent_grpo.training.distributed import Dist
    from maxent_grpo.training.sharding import fsdp2_gradient_sync, full_state_dict, shard_model
    from maxent_grpo.training.strategy import FSDP2Strategy

    rank, world = dist.get_rank(), dist.get_world_size()
    strategy = FSDP2Strategy(Dist.current())

    def broadcast_load() -> torch.nn.Module:
        return strategy.load_policy(model_dir, dtype="float32", adapt=lambda m: m, bf16_compute=False)

    rows = build_rows(load_model(model_dir, "float32"))
    mine = rank_micro_batches(rows, rank, world)

    def train_step(model: torch.nn.Module, optimizer: torch.optim.Optimizer):
        return step(model, optimizer, mine, beta=0.05, loss_type="dapo", max_grad_norm=1.0,
                    comm=Comm(world, all_reduce_sum, fsdp2_gradient_sync(model)))

    full = shard_model(load_model(model_dir, "float32"))
    loaded = broadcast_load()
    per_rank = {"full_buffers": _buffers(full), "loaded_buffers": _buffers(loaded),
                "tied": (_tied(full), _tied(loaded))}
    result: dict = {"before": {"full": full_state_dict(full), "loaded": full_state_dict(loaded)}}
    optimizers = {"full": torch.optim.AdamW(full.parameters(), lr=1e-3),
                  "loaded": torch.optim.AdamW(loaded.parameters(), lr=1e-3)}
    for name, model in (("full", full), ("loaded", loaded)):
        out = train_step(model, optimizers[name])
        result[name] = {"loss": out.loss, "grad_norm": out.metrics["grad_norm"], "after": full_state_dict(model)}

    ckpt = strategy.save(Path(out_dir) / "run", 1, model=loaded, tokenizer=None, optimizer=optimizers["loaded"],
                         lr_scheduler=None, trainer_state={"step": 1}, keep_last=None)
    ckpt = Path(strategy.dist.broadcast_object(None if ckpt is None else str(ckpt)))
    resumed = broadcast_load()
    resumed_optimizer = torch.optim.AdamW(resumed.parameters(), lr=1e-3)
    state = strategy.load(ckpt, model=resumed, optimizer=resumed_optimizer, lr_scheduler=None)
    per_rank["resumed_buffers"] = _buffers(resumed)
    per_rank["resumed_tied"] = _tied(resumed)
    result["resumed"] = {"step": state["step"], "weights": full_state_dict(resumed)}
    # The second step shows the optimizer state came back as well.
    for name, model, optimizer in (("loaded", loaded, optimizers["loaded"]), ("resumed", resumed, resumed_optimizer)):
        out = train_step(model, optimizer)
        result[name]["second"] = {"loss": out.loss, "after": full_state_dict(model)}

    ranks: list = [None] * world
    dist.all_gather_object(ranks, per_rank)
    if rank == 0:
        torch.save({**result, "ranks": ranks}, Path(out_dir) / "result.pt")


if __name__ == "__main__":
    from maxent_grpo.training.distributed import process_group

    # The group ends after main's objects are gone (process_group's docstring: a gloo group
    # destroyed while a model still holds it can abort or hang a rank at exit).
    with process_group(timeout_minutes=5):
        main(sys.argv[1], sys.argv[2])
