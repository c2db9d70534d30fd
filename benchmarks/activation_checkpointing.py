"""Activation checkpointing (``training.gradient_checkpointing``): peak memory and step time, off vs on.

    python benchmarks/activation_checkpointing.py [--steps 2] [--micro-batch-size 16] [--max-new-tokens 128]

Runs the built-in default (SmolLM2-135M-Instruct on chain_sum) twice from the same
seed, each in its own process (its peak RSS measured alone, ``children.run_child``):
checkpointing off and on, both with ``training.share_prompts: false`` (which
checkpointing needs) so that it is the only difference. Prints a table: peak RSS,
the policy phase (forward + backward) per step, and step 1's loss, which must
agree (the same samples, the gradient unchanged up to rounding).
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path

if __package__ in (None, ""):  # run as a script: make `benchmarks` importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.children import child_env, python_module_cmd, run_child  # noqa: E402


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=2)
    parser.add_argument("--micro-batch-size", type=int, default=16)
    parser.add_argument("--max-new-tokens", type=int, default=128)
    parser.add_argument("--threads", type=int, default=None)
    parser.add_argument("--work-dir", type=Path, default=None)
    args = parser.parse_args()
    work = args.work_dir or Path(tempfile.mkdtemp(prefix="ckpt-bench-"))
    rows = []
    for name, on in (("off", False), ("on", True)):
        out = work / name
        sets = [f"training.micro_batch_size={args.micro_batch_size}", "training.share_prompts=false",
                f"generation.max_new_tokens={args.max_new_tokens}", f"training.gradient_checkpointing={str(on).lower()}",
                "logging.progress_bar=false", "checkpoint.save_steps=0", "checkpoint.save_minutes=0"]
        cmd = python_module_cmd("maxent_grpo.cli", "train", "--output-dir", str(out), "--max-steps", str(args.steps),
                                "--overwrite", *[a for s in sets for a in ("--set", s)])
        child = run_child(cmd, work / f"{name}.log", child_env(args.threads))
        metrics = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
        policy = [m["time/policy"] for m in metrics]
        rows.append((name, child.peak_rss_bytes / 2**30, sum(policy) / len(policy), metrics[0]["loss"],
                     metrics[0]["completions/mean_length"]))
    print(f"SmolLM2-135M-Instruct, micro-batch {args.micro_batch_size}, max_new_tokens {args.max_new_tokens}, "
          f"{args.steps} steps, share_prompts false; work dir {work}")
    print("| checkpointing | peak RSS GiB | policy s/step | step-1 loss | step-1 mean length |")
    print("|---|---|---|---|---|")
    for name, rss, policy, loss, length in rows:
        print(f"| {name} | {rss:.2f} | {policy:.1f} | {loss:.6g} | {length:.1f} |")
    (off_rss, on_rss) = rows[0][1], rows[1][1]
    print(f"peak RSS on / off: {on_rss / off_rss:.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
