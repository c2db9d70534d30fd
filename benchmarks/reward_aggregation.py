"""GDPO (``loss.multi_objective_aggregation: normalize_then_sum``) against the weighted sum, on the
built-in default task, whose two rewards are the pair GDPO was made for: a sparse correctness reward
(``boxed_accuracy``, weight 1) beside a dense format reward (``format``, weight 0.5).

    python benchmarks/reward_aggregation.py --seeds 0 1 2 --out runs/aggregation          # train, then report
    python benchmarks/reward_aggregation.py --seeds 0 1 2 --out runs/aggregation --report  # report only

Each seed trains both arms with ``method: grpo`` and everything else the default's (15 steps, 4 prompts
x 8 completions, SmolLM2-135M-Instruct), in that order, seed by seed. The report reads each run's
``metrics.jsonl`` (or, in ``benchmarks/results/``, its gzipped form): the mean correctness and format rewards over the first and the last three steps,
the mean correctness over all steps (the area under its curve: "which learns correctness faster"),
and the first step at which a step's mean correctness reached 0.5.
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
from pathlib import Path

if __package__ in (None, ""):  # run as a script: the repository root on the path, for benchmarks.*
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks import result_files  # noqa: E402

ARMS = ("sum_then_normalize", "normalize_then_sum")
ACC, FMT = "rewards/boxed_accuracy/mean", "rewards/format/mean"


def train(out: Path, arm: str, seed: int) -> None:
    subprocess.run([sys.executable, "-m", "maxent_grpo.cli", "train", "--seed", str(seed), "--output-dir",
                    str(out / arm / f"seed-{seed}"), "--set", "logging.progress_bar=false", "--set", "method=grpo",
                    "--set", f"loss.multi_objective_aggregation={arm}"], check=True)


def summary(rows: list[dict]) -> dict:
    acc = [r[ACC] for r in rows]
    fmt = [r[FMT] for r in rows]
    reached = next((i + 1 for i, a in enumerate(acc) if a >= 0.5), None)
    return {"steps": len(rows), "acc_first3": statistics.fmean(acc[:3]), "acc_last3": statistics.fmean(acc[-3:]),
            "acc_mean": statistics.fmean(acc), "fmt_first3": statistics.fmean(fmt[:3]),
            "fmt_last3": statistics.fmean(fmt[-3:]), "first_step_acc_ge_0.5": reached}


def report(out: Path, seeds: list[int]) -> str:
    lines = ["| aggregation | seed | steps | correct, first 3 | correct, last 3 | correct, all steps | "
             "format, first 3 | format, last 3 | first step >= 0.5 correct |",
             "|---|---|---|---|---|---|---|---|---|"]
    per_arm: dict[str, list[dict]] = {arm: [] for arm in ARMS}
    for arm in ARMS:
        for seed in seeds:
            path = out / arm / f"seed-{seed}" / "metrics.jsonl"
            if not result_files.exists(path):
                continue
            s = summary(result_files.read_jsonl(path))
            per_arm[arm].append(s)
            lines.append(f"| {arm} | {seed} | {s['steps']} | {s['acc_first3']:.3f} | {s['acc_last3']:.3f} | "
                         f"{s['acc_mean']:.3f} | {s['fmt_first3']:.3f} | {s['fmt_last3']:.3f} | "
                         f"{s['first_step_acc_ge_0.5'] or '-'} |")
    for arm, runs in per_arm.items():
        if runs:
            mean = {k: statistics.fmean(r[k] for r in runs) for k in ("acc_first3", "acc_last3", "acc_mean",
                                                                       "fmt_first3", "fmt_last3")}
            lines.append(f"| {arm} | mean of {len(runs)} | | {mean['acc_first3']:.3f} | {mean['acc_last3']:.3f} | "
                         f"{mean['acc_mean']:.3f} | {mean['fmt_first3']:.3f} | {mean['fmt_last3']:.3f} | |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--report", action="store_true", help="only read the runs already in --out")
    args = p.parse_args(argv)
    if not args.report:
        for seed in args.seeds:
            for arm in ARMS:
                train(args.out, arm, seed)
    print(report(args.out, args.seeds))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
