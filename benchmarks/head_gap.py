"""The sampler/trainer log-prob gap under bf16 compute, with and without the float32 LM head.

    python benchmarks/head_gap.py [--steps 4] [--out outputs/bench-head-gap] [-- extra train args]

Runs ``maxent-grpo train`` (the built-in default: SmolLM2-135M on chain_sum) in bf16 twice from the
same seed: the trainer under bf16 autocast over float32 master weights (``model.dtype: bfloat16``),
the sampler a bf16 copy of the policy (``generation.dtype: bfloat16``), once with
``model.lm_head_fp32: false`` and once ``true``. Each step logs the gap between the sampler's
log-prob of every sampled token and the trainer's pre-update log-prob of it
(``sampling/sampling_logp_difference/{mean,rms,max}``, ``token_mult_prob_error``,
``sampling/importance_sampling_ratio/{min,max}``); the table gives them per step and their mean.
On a CPU without native bf16 (AVX2 only) bf16 matmuls are slow: the default 4 steps take minutes.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from benchmarks.determinism import _cpu  # noqa: E402

GAP = (("sampling/sampling_logp_difference/mean", "mean |d|"), ("sampling/sampling_logp_difference/rms", "rms d"),
       ("sampling/sampling_logp_difference/max", "max |d|"), ("token_mult_prob_error", "mean exp|d|"),
       ("sampling/importance_sampling_ratio/min", "ratio min"), ("sampling/importance_sampling_ratio/max", "ratio max"))


def _run(out: Path, steps: int, fp32: bool, extra: list[str]) -> list[dict]:
    cmd = [sys.executable, "-m", "maxent_grpo.cli", "train", "--output-dir", str(out), "--max-steps", str(steps),
           "--overwrite", "--set", "logging.progress_bar=false", "--set", "model.dtype=bfloat16",
           "--set", "generation.dtype=bfloat16", "--set", f"model.lm_head_fp32={str(fp32).lower()}", *extra]
    subprocess.run(cmd, check=True, cwd=ROOT)
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines() if line.strip()]


def table(runs: dict[str, list[dict]]) -> str:
    lines = ["| LM head | step | " + " | ".join(name for _, name in GAP) + " |",
             "|---|---|" + "---|" * len(GAP)]
    for head, rows in runs.items():
        for r in rows:
            lines.append(f"| {head} | {r['step']} | " + " | ".join(f"{r[k]:.4f}" for k, _ in GAP) + " |")
        means = [sum(r[k] for r in rows) / len(rows) for k, _ in GAP]
        lines.append(f"| {head} | mean | " + " | ".join(f"**{v:.4f}**" for v in means) + " |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--out", type=Path, default=ROOT / "outputs" / "bench-head-gap")
    parser.add_argument("extra", nargs="*", help="after --: more train arguments, the same for both runs")
    args = parser.parse_args(argv)
    runs = {head: _run(args.out / head, args.steps, head == "float32", args.extra) for head in ("bf16", "float32")}
    print(f"CPU: {_cpu()}")
    print(table(runs))
    return 0


if __name__ == "__main__":
    sys.exit(main())
