"""Run the built-in default training for several seeds and print how the reward moved.

    python benchmarks/default_learning.py --seeds 0 1 2 [--out outputs/default] [-- extra train args]

For each seed: wall time, and the mean reward (and per-reward means; tool calls and turns
per episode for a multi-turn run) over the first and the last fifth of the optimizer steps,
read from the run's metrics.jsonl.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path


def fifths(rows: list[dict], key: str) -> tuple[float, float]:
    n = max(1, len(rows) // 5)
    vals = [r[key] for r in rows if r.get(key) is not None]
    return sum(vals[:n]) / len(vals[:n]), sum(vals[-n:]) / len(vals[-n:])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    parser.add_argument("--out", default="outputs/default")
    parser.add_argument("extra", nargs="*", help="arguments passed to maxent-grpo train (after --)")
    args = parser.parse_args()
    table = []
    for seed in args.seeds:
        out = Path(args.out) / f"seed-{seed}"
        t0 = time.perf_counter()
        subprocess.run(
            [sys.executable, "-m", "maxent_grpo.cli", "train", "--seed", str(seed), "--output-dir", str(out),
             "--set", "logging.progress_bar=false", *args.extra],
            check=True,
        )
        wall = time.perf_counter() - t0
        rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines() if line.strip()]
        names = [k for k in rows[0] if k.startswith("rewards/") and k.endswith("/mean")]
        names += [k for k in ("env/tool_calls", "env/turns") if k in rows[0]]  # multi-turn runs
        table.append((seed, wall, len(rows), fifths(rows, "reward"), {k: fifths(rows, k) for k in names}))
    print("\n| seed | wall (s) | steps | reward first 1/5 | reward last 1/5 | " +
          " | ".join(f"{k.split('/')[1]} first -> last" for k in table[0][4]) + " |")
    print("|---|---|---|---|---|" + "---|" * len(table[0][4]))
    for seed, wall, steps, (a, b), per in table:
        cells = " | ".join(f"{x:.3f} -> {y:.3f}" for x, y in per.values())
        print(f"| {seed} | {wall:.0f} | {steps} | {a:.3f} | {b:.3f} | {cells} |")


if __name__ == "__main__":
    main()
