"""Helpers shared by the tests that run whole (tiny) trainings through the CLI."""

from __future__ import annotations

import json
import struct
from pathlib import Path


def tiny_overrides(
    model_dir, out, *, rewards: str, steps: int = 2, num_generations: int = 4, max_new_tokens: int = 8,
    prompts_per_step: int = 2, extra=(), source: str = "reasoning_gym:chain_sum",
) -> list[str]:
    """``maxent-grpo train`` arguments for a fast, exact run of the tiny model on chain_sum.

    ``rewards`` is the YAML list for the ``rewards`` key; ``extra`` holds more ``KEY=VALUE`` overrides;
    ``source`` another generated task (the GPU tier's ``modebench:pair_sum`` needs no reasoning-gym).
    """
    sets = [
        f"model.name_or_path={model_dir}",
        "model.dtype=float32",
        f"data.source={source}",
        "data.size=32",
        "data.prompt_column=prompt",
        "data.answer_column=answer",
        f"generation.num_generations={num_generations}",
        f"generation.max_new_tokens={max_new_tokens}",
        f"training.prompts_per_step={prompts_per_step}",
        "training.micro_batch_size=4",
        "logging.progress_bar=false",
        # fp32 throughout and the task generator's own defaults: these tests compare exact values.
        "generation.dtype=null", "training.autocast_bf16=false", "data.task_kwargs={}",
        f"rewards={rewards}",
        *extra,
    ]
    return ["--output-dir", str(out), "--max-steps", str(steps), *[a for kv in sets for a in ("--set", kv)]]


def read_jsonl(path: Path) -> list[dict]:
    return [json.loads(line) for line in Path(path).read_text().splitlines()]


def wandb_history(run_file) -> list[dict]:
    """History rows from a .wandb file (leveldb-log framing of protobuf records)."""
    from wandb.proto import wandb_internal_pb2 as pb

    data = open(run_file, "rb").read()
    assert data[:4] == b":W&B"
    block, pos, chunk, rows = 32768, 7, b"", []
    while pos + 7 <= len(data):
        left = block - pos % block
        if left < 7:
            pos += left
            continue
        _, length, kind = struct.unpack("<IHB", data[pos : pos + 7])
        if length == 0 and kind == 0:
            pos += left
            continue
        chunk += data[pos + 7 : pos + 7 + length]
        pos += 7 + length
        if kind in (1, 4):  # FULL or LAST
            record = pb.Record()
            record.ParseFromString(chunk)
            chunk = b""
            if record.WhichOneof("record_type") == "history":
                rows.append({i.key or "/".join(i.nested_key): json.loads(i.value_json) for i in record.history.item})
    return rows


def compiled(path=None, overrides=None, *, fast_bf16: bool = False, cuda: bool = False, processes: int | None = None):
    """``load_config`` then ``compile_run`` on a CPU without native bf16 (by default): the plan the CLI builds
    (``processes`` None: no process-count rule, as for ``maxent-grpo eval``)."""
    from maxent_grpo.config.load import load_config
    from maxent_grpo.config.compile import compile_run
    from maxent_grpo.training.precision import Machine

    return compile_run(load_config(path, overrides), Machine(fast_bf16=fast_bf16, cuda=cuda, processes=processes))


def collapsing_model(tiny_model_dir, out):
    """The tiny model with sharper token distributions (its tied embedding x8: long, low-entropy
    completions) and an end-of-sequence row of the same scale, likely in some contexts only: trained with
    test_collapse's settings, its answers fall to one token within a dozen steps, the collapse signature."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tiny_model_dir)
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir)
    with torch.no_grad():
        w = model.get_output_embeddings().weight
        w.mul_(8.0)
        gen = torch.Generator().manual_seed(1)
        w[tok.eos_token_id] = torch.randn(w.shape[1], generator=gen) * 0.02 * 8.0 * 3.0
    model.save_pretrained(out)
    tok.save_pretrained(out)
    return out
