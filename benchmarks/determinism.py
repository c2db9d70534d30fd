"""Is the built-in default bitwise repeatable here? Two identical runs, compared metric by metric.

    python benchmarks/determinism.py [--steps 4] [--out outputs/bench-determinism] [--in-process] [-- extra train args]

Runs ``maxent-grpo train`` (the default: SmolLM2-135M on chain_sum) twice with the same seed,
in two processes (or, with ``--in-process``, one after the other in one process: the case of
a test suite or a notebook), and prints the first step and metric where the two differ
(timings aside), or that every metric of every step is equal. Metrics are what the run logs
(loss, grad norm, rewards, entropies, KL, weights...), so a difference in the last bit of any
gradient shows up at the next step's rewards or loss. Prints the CPU model and whether it has
fast bf16 (the default's precision follows it).
"""

from __future__ import annotations

import argparse
import json
import platform
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
TIMING = ("time", "per_s", "seconds", "_at")


def _cpu() -> str:
    """The CPU's model and whether it has fast bf16 (AVX-512 bf16, AMX), which the default's precision follows."""
    info = Path("/proc/cpuinfo").read_text() if Path("/proc/cpuinfo").exists() else ""
    model = next((line.split(":", 1)[1].strip() for line in info.splitlines() if line.startswith("model name")),
                 platform.processor() or "unknown")
    flags = next((line.split(":", 1)[1].split() for line in info.splitlines() if line.startswith("flags")), [])
    fast = [f for f in ("avx512_bf16", "amx_bf16") if f in flags]
    return f"{model} ({', '.join(fast) if fast else 'no avx512_bf16/amx'})"


def _train_args(out: Path, steps: int, extra: list[str]) -> list[str]:
    return ["train", "--output-dir", str(out), "--max-steps", str(steps), "--overwrite",
            "--set", "logging.progress_bar=false", *extra]


def _metrics(run: Path) -> list[dict]:
    return [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines() if line.strip()]


def first_difference(a: list[dict], b: list[dict]) -> tuple[int, str, float, float] | None:
    """(step, metric, value a, value b) of the first differing non-timing number, or None."""
    for x, y in zip(a, b):
        for key in sorted(set(x) & set(y)):
            if any(t in key for t in TIMING) or isinstance(x[key], bool) or not isinstance(x[key], (int, float)):
                continue
            if x[key] != y[key]:
                return x.get("step", -1), key, x[key], y[key]
    return None


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--out", type=Path, default=ROOT / "outputs" / "bench-determinism")
    parser.add_argument("--in-process", action="store_true", help="both runs in this process, one after the other")
    args, extra = parser.parse_known_args(argv)
    extra = [a for a in extra if a != "--"]
    runs = [args.out / "a", args.out / "b"]
    if args.in_process:
        from maxent_grpo.cli import main as cli

        for run in runs:
            code = cli(_train_args(run, args.steps, extra))
            if code:
                return code
    else:
        for run in runs:
            subprocess.run([sys.executable, "-m", "maxent_grpo.cli", *_train_args(run, args.steps, extra)], check=True)
    a, b = (_metrics(r) for r in runs)
    print(f"cpu: {_cpu()}; {'one process' if args.in_process else 'two processes'}; {len(a)} steps")
    diff = first_difference(a, b)
    if diff is None:
        print(f"every metric of every step is equal ({sum(len(m) for m in a)} values)")
    else:
        print(f"first difference: step {diff[0]}, {diff[1]}: {diff[2]!r} vs {diff[3]!r}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
