"""Activation checkpointing (``training.gradient_checkpointing``): peak memory and time of one
policy update, off vs on.

    python benchmarks/activation_checkpointing.py [--micro-batch-size 16] [--prompt 64] [--completion 448]

SmolLM2-135M-Instruct (the packaged model, float32), one ``grpo_step`` on one
micro-batch of random token rows (every completion token kept: the default task's
completions are ~12 tokens, too short for activations to matter). Each setting runs
in its own process, whose peak RSS is measured alone (``children.run_child``).
Prints a table: peak RSS, the step's wall time, and the loss and gradient norm,
which must agree (the gradient is unchanged up to rounding).
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

if __package__ in (None, ""):  # run as a script: make `benchmarks` importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.children import child_env, run_child  # noqa: E402


def worker(checkpointing: bool, rows: int, prompt: int, completion: int, out: Path) -> None:
    import torch

    from maxent_grpo.core.logprobs import Scoring
    from maxent_grpo.core.step import LossSpec, MicroBatch, grpo_step
    from maxent_grpo.models import SMOLLM2_ALIAS, enable_activation_checkpointing, load_model_and_tokenizer

    model, _ = load_model_and_tokenizer(SMOLLM2_ALIAS, dtype="float32")
    model.train()
    if checkpointing:
        enable_activation_checkpointing(model)
    gen = torch.Generator().manual_seed(0)
    ids = torch.randint(10, model.config.vocab_size, (rows, prompt + completion), generator=gen)
    mask = torch.ones_like(ids)
    batch = MicroBatch(
        input_ids=ids, attention_mask=mask, prompt_length=prompt, num_generations=rows, completion_mask=mask[:, prompt:].float(),
        advantages=torch.randn(rows, generator=gen),
    )
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-6)
    start = time.perf_counter()
    result = grpo_step(model, optimizer, [batch], LossSpec(loss_type="dapo"), Scoring(share_prompts=False))
    out.write_text(json.dumps({"seconds": time.perf_counter() - start, "loss": result.loss,
                               "grad_norm": result.grad_norm}))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--micro-batch-size", type=int, default=16)
    parser.add_argument("--prompt", type=int, default=64)
    parser.add_argument("--completion", type=int, default=448)
    parser.add_argument("--threads", type=int, default=None)
    parser.add_argument("--work-dir", type=Path, default=None)
    parser.add_argument("--worker", choices=["off", "on"], help=argparse.SUPPRESS)
    parser.add_argument("--out", type=Path, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        worker(args.worker == "on", args.micro_batch_size, args.prompt, args.completion, args.out)
        return 0
    work = args.work_dir or Path(tempfile.mkdtemp(prefix="ckpt-bench-"))
    work.mkdir(parents=True, exist_ok=True)
    rows = []
    for name in ("off", "on"):
        out = work / f"{name}.json"
        cmd = [sys.executable, str(Path(__file__).resolve()), "--worker", name, "--out", str(out),
               "--micro-batch-size", str(args.micro_batch_size), "--prompt", str(args.prompt),
               "--completion", str(args.completion)]
        child = run_child(cmd, work / f"{name}.log", child_env(args.threads))
        rows.append((name, child.peak_rss_bytes / 2**30, json.loads(out.read_text())))
    print(f"SmolLM2-135M-Instruct fp32, one micro-batch of {args.micro_batch_size} rows x "
          f"({args.prompt} prompt + {args.completion} completion) tokens, share_prompts false")
    print("| checkpointing | peak RSS GiB | step s | loss | grad norm |")
    print("|---|---|---|---|---|")
    for name, rss, r in rows:
        print(f"| {name} | {rss:.2f} | {r['seconds']:.1f} | {r['loss']:.9g} | {r['grad_norm']:.9g} |")
    print(f"peak RSS on / off: {rows[1][1] / rows[0][1]:.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
