"""The optimizers of ``training.optimizer`` on one model's parameters: state bytes and seconds per update.

    python -m benchmarks.optimizers [--model smollm2-135m-instruct] [--rounds 5] [--threads 2]

Each optimizer is the run's own (``training.policy.build_optimizer`` from an :class:`OptimizerPlan`)
over the model's float32 parameters, with fixed random gradients. The optimizers take turns,
one update each per round (A B C A B C ...), so a busy machine slows every one alike; the table
gives the median seconds per update after each one's first, and the bytes of its state (moments,
quantisation scales) after one update, counted from the tensors themselves.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

if __package__ in (None, ""):  # run as a script: make `benchmarks` importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.model_paths import resolve_model  # noqa: E402
from maxent_grpo.training.policy import OptimizerPlan, build_optimizer  # noqa: E402

OPTIMIZERS = {  # name -> (training.optimizer, torch's fused kernel)
    "adamw": ("adamw", False),
    "adamw_fused": ("adamw_fused", True),
    "adamw_8bit": ("adamw_8bit", False),
}


def state_bytes(optimizer: torch.optim.Optimizer) -> int:
    """Bytes of every tensor in the optimizer's state (nested entries included)."""
    def walk(x) -> int:
        if isinstance(x, torch.Tensor):
            return x.numel() * x.element_size()
        if isinstance(x, dict):
            return sum(walk(v) for v in x.values())
        if isinstance(x, (list, tuple)):
            return sum(walk(v) for v in x)
        return 0
    return sum(walk(s) for s in optimizer.state.values())


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="smollm2-135m-instruct")
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--threads", type=int, default=None)
    args = p.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    from transformers import AutoModelForCausalLM

    path = resolve_model(args.model)
    runs = {}
    for name, (kind, fused) in OPTIMIZERS.items():
        model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
        gen = torch.Generator().manual_seed(0)
        for param in model.parameters():
            param.grad = torch.randn(param.shape, generator=gen) * 1e-3
        plan = OptimizerPlan(learning_rate=1e-5, lr_scheduler="constant", warmup_steps=0, warmup_ratio=0.0,
                             weight_decay=0.0, betas=(0.9, 0.999), total_updates=args.rounds, name=kind, fused=fused)
        optimizer, _ = build_optimizer(model, plan)
        runs[name] = (model, optimizer, [])
    n_params = sum(p.numel() for p in next(iter(runs.values()))[0].parameters())
    for _ in range(args.rounds):
        for name, (model, optimizer, times) in runs.items():
            t0 = time.perf_counter()
            optimizer.step()
            times.append(time.perf_counter() - t0)
    print(f"\n{args.model}: {n_params / 1e6:.1f}M float32 parameters, {args.rounds} updates each, taking turns\n")
    print("| optimizer | state (MiB) | bytes per parameter | s per update (median after the first) |")
    print("|---|---|---|---|")
    for name, (_, optimizer, times) in runs.items():
        size = state_bytes(optimizer)
        print(f"| {name} | {size / 2**20:.0f} | {size / n_params:.2f} | {statistics.median(times[1:]):.3f} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
