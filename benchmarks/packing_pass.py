"""The policy pass alone on one real batch: positions and seconds of the padded, shared-prompt,
packed, packed-behind-shared-prompt (KV cache) and one-pass (prompt and completions in one row)
forwards and backwards (``training.packing``, ``training.inline_prompts``).

    python benchmarks/packing_pass.py --completions RUN/completions/step-1.jsonl --reps 3 --threads 1

The batch is rebuilt from a run's completion table (prompt text, tokenised as the run did, and
each completion's text cut to its logged length), padded as the trainer pads a step, and split
into micro-batches of ``--micro-batch-size`` rows. Every variant calls ``Scoring.logps`` as the
trainer does (entropies on) and backpropagates a loss over the completion tokens; the variants
alternate within each repetition (A B C D E A B C D E), so a busy machine slows them alike.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch

if __package__ in (None, ""):  # run as a script: make `benchmarks` importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def build_batch(rows: list[dict], tokenizer) -> tuple[torch.Tensor, torch.Tensor, int]:
    """``(input_ids, attention_mask, prompt_length)``: prompts left-padded, completions right-padded."""
    prompts = [tokenizer(r["prompt"], add_special_tokens=False)["input_ids"] for r in rows]
    completions = []
    for r in rows:
        ids = tokenizer(r["completion"], add_special_tokens=False)["input_ids"][: r["length"]]
        completions.append(ids + [tokenizer.eos_token_id] * (r["length"] - len(ids)))  # the stop token(s)
    p, t = max(map(len, prompts)), max(map(len, completions))
    ids = torch.full((len(rows), p + t), tokenizer.pad_token_id, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for i, (prompt, completion) in enumerate(zip(prompts, completions)):
        ids[i, p - len(prompt) : p] = torch.tensor(prompt)
        mask[i, p - len(prompt) : p] = 1
        ids[i, p : p + len(completion)] = torch.tensor(completion, dtype=torch.long)
        mask[i, p : p + len(completion)] = 1
    return ids, mask, p


def main(argv: list[str] | None = None) -> int:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from benchmarks.model_paths import resolve_model
    from maxent_grpo.core.logprobs import Scoring

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--completions", type=Path, required=True, help="a run's completions/step-N.jsonl")
    parser.add_argument("--model", default="smollm2-135m-instruct", help="a model name benchmarks/model_paths.py "
                        "knows, or a folder")
    parser.add_argument("--micro-batch-size", type=int, default=8)
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    model_dir = resolve_model(args.model)
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    rows = [json.loads(line) for line in args.completions.read_text().splitlines()]
    ids, mask, p = build_batch(rows, tokenizer)
    mb = args.micro_batch_size
    variants = {
        "shared prompts": Scoring(share_prompts=True),
        "packed behind shared prompts": Scoring(share_prompts=True, packing=True),
        "prompt and completions in one pass": Scoring(share_prompts=True, packing=True, inline_prompts=True),
        "padded": Scoring(share_prompts=False),
        "packed rows": Scoring(share_prompts=False, packing=True),
    }
    times: dict[str, list[float]] = {name: [] for name in variants}
    for _ in range(args.reps):
        for name, scoring in variants.items():
            t0 = time.perf_counter()
            for s in range(0, ids.shape[0], mb):
                logp, ent = scoring.logps(model, ids[s : s + mb], mask[s : s + mb], p, with_entropy=True)
                cmask = mask[s : s + mb, p:].to(logp.dtype)
                ((logp * cmask).sum() + 0.01 * (ent * cmask).sum()).backward()
            model.zero_grad(set_to_none=True)
            times[name].append(time.perf_counter() - t0)
    print(f"{len(rows)} rows, real tokens {int(mask.sum())}, prompt width {p}, completion width {ids.shape[1] - p}")
    print("| variant | positions | seconds (median) | each repetition |\n|---|---|---|---|")
    for name, scoring in variants.items():
        positions = sum(scoring.forward_positions(model, ids[s : s + mb], mask[s : s + mb], p) for s in range(0, ids.shape[0], mb))
        print(f"| {name} | {positions} | {statistics.median(times[name]):.2f} | "
              + ", ".join(f"{t:.2f}" for t in times[name]) + " |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
