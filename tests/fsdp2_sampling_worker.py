"""HF sampling on an FSDP2-sharded policy, 2 processes (run with torchrun).

``python -m torch.distributed.run --standalone --nproc_per_node 2 fsdp2_sampling_worker.py MODEL_DIR OUT``
shards the tiny model (``training.sharding``) and samples on each rank with ``synced_gpus``:
rank 0 asks for 2 new tokens, rank 1 for 7, so rank 0's rows all end first and it must keep
running forwards (one placeholder row) while rank 1 decodes. Each rank writes its completions
and the number of forwards its model ran to ``OUT/rank{R}.json``.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from fsdp2_step_worker import load_model  # noqa: E402

PROMPTS = ["What is 3 + 4?", "Name a colour."]
NEW_TOKENS = (2, 7)  # per rank
SEEDS = (11, 12)


def sample(model, tokenizer, rank: int, synced: bool) -> list[dict]:
    from maxent_grpo.rollout.backend import SamplingParams
    from maxent_grpo.rollout.hf import HFGenerationBackend

    backend = HFGenerationBackend(model, tokenizer, seed=SEEDS[rank], synced_gpus=synced)
    groups = backend.generate(PROMPTS, 2, SamplingParams(max_new_tokens=NEW_TOKENS[rank]))
    return [{"ids": c.token_ids, "logps": c.logps, "reason": c.finish_reason} for g in groups for c in g.completions]


def main(model_dir: str, out_dir: str) -> None:
    import torch.distributed as dist
    from transformers import AutoTokenizer

    from maxent_grpo.training.sharding import shard_model

    rank = dist.get_rank()
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    model = shard_model(load_model(model_dir))
    forwards = [0]
    model.register_forward_hook(lambda *_: forwards.__setitem__(0, forwards[0] + 1))
    completions = sample(model, tokenizer, rank, synced=True)
    Path(out_dir, f"rank{rank}.json").write_text(json.dumps({"completions": completions, "forwards": forwards[0]}))


if __name__ == "__main__":
    import torch.distributed as dist

    dist.init_process_group("gloo")
    try:
        torch.manual_seed(0)
        main(sys.argv[1], sys.argv[2])
    finally:
        dist.destroy_process_group()
