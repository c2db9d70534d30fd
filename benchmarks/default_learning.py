"""Does the built-in default learn on every seed? Arms x seeds of README command 1's training.

    python -m benchmarks.default_learning run [--arms weighted_mle,dr_grpo] [--seeds 0-9] [--results DIR] [-- TRAIN ARGS]
    python -m benchmarks.default_learning table [--results DIR]

BENCHMARKS.md §3. Every arm is the built-in default run (``maxent-grpo train`` with no config:
SmolLM2-135M-Instruct on one-digit chain_sum, 15 steps, hf sampling) with only the keys of
:data:`ARMS` changed, so the arms of one seed start from the same weights and see the same prompts.
Numerics are pinned to float32 (:data:`PINNED`), so that runs made on CPUs with and without native
bf16 are one study. Each (arm, seed) keeps ``<results>/<arm>/seed<s>/metrics.jsonl`` (the columns
of :data:`KEEP`) and last ``done.json`` (wall time, CPU); a folder with ``done.json`` is skipped,
so ``run`` resumes, seed by seed across all arms. Runs go in seed order, every arm of a seed before
the next seed, so a study cut short still compares the arms on the same seeds.

The rules below were fixed before the runs (issue 45); ``table`` applies them.
"""

from __future__ import annotations

import argparse
import json
import math
import platform
import shutil
import statistics
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

from benchmarks import result_files
from benchmarks.modebench import _cli, _run, _sets

REPO = Path(__file__).resolve().parents[1]
RESULTS = REPO / "benchmarks" / "results" / "default_learning"

# arm -> overrides of the built-in default (dotted keys).
ARMS: dict[str, dict] = {
    # (a) the default the study started from: maxent_listwise, weighted MLE on token-mean scores
    "weighted_mle": {"maxent.listwise_loss": "weighted_mle"},
    "cross_entropy": {"maxent.listwise_loss": "cross_entropy"},  # (b) the spec's listwise cross-entropy
    "mle_sum": {"maxent.listwise_score": "sum"},  # (c) weighted MLE on summed (not length-normalised) scores
    "mle_rewarded": {"maxent.zero_weight_unrewarded": True},  # (d) zero weight on zero-reward answers
    "dr_grpo": {"method": "dr_grpo"},  # (e)
    # (f) from the mechanism of ALGORITHMS.md §4: the weights minus their group mean 1/G, so an
    # answer weighted below uniform is pushed down, not up (the gradient sums to 0 over a group).
    # The study chose it: the built-in default since (its keys restate the default).
    "centered_mle": {"maxent.listwise_loss": "centered_mle"},
}
PINNED = {"training.autocast_bf16": False, "generation.dtype": None, "logging.progress_bar": False,
          "logging.report_to": [], "checkpoint.save_steps": 0}
KEEP = ("step", "reward", "rewards/boxed_accuracy/mean", "rewards/format/mean", "completions/mean_length",
        "entropy", "frac_reward_zero_std", "step_time")

# The rules, fixed before the runs. Windows are the first and the last WINDOW optimizer steps.
WINDOW = 3
COLLAPSE_DROP = 0.2  # collapse: reward(last) < reward(first) - 0.2, and the mean length fell
LEARN_GAIN = 0.1  # learns: reward(last) >= reward(first) + 0.1


@dataclass(frozen=True)
class RunSummary:
    """One (arm, seed): window means of the reward, accuracy, length and entropy, and seconds per step."""

    arm: str
    seed: int
    reward: tuple[float, float]  # (first window, last window)
    accuracy: tuple[float, float]
    length: tuple[float, float]
    entropy: tuple[float, float]
    sec_per_step: float

    @property
    def collapsed(self) -> bool:
        return self.reward[1] < self.reward[0] - COLLAPSE_DROP and self.length[1] < self.length[0]

    @property
    def learns(self) -> bool:
        return self.reward[1] >= self.reward[0] + LEARN_GAIN


def summarize(arm: str, seed: int, rows: list[dict]) -> RunSummary:
    """Window means over ``rows`` (one dict per optimizer step, in order)."""
    if len(rows) < 2 * WINDOW:
        raise ValueError(f"{arm} seed {seed}: {len(rows)} steps, need at least {2 * WINDOW}")

    def windows(key: str) -> tuple[float, float]:
        vals = [float(r[key]) for r in rows]
        return statistics.fmean(vals[:WINDOW]), statistics.fmean(vals[-WINDOW:])

    return RunSummary(arm, seed, windows("reward"), windows("rewards/boxed_accuracy/mean"),
                      windows("completions/mean_length"), windows("entropy"),
                      statistics.median(float(r["step_time"]) for r in rows))


def t_interval(values: list[float]) -> tuple[float, float, float]:
    """Mean and the two-sided 95% Student-t interval over seeds."""
    from scipy.stats import t

    mean = statistics.fmean(values)
    if len(values) < 2:
        return mean, math.nan, math.nan
    half = t.ppf(0.975, len(values) - 1) * statistics.stdev(values) / math.sqrt(len(values))
    return mean, mean - half, mean + half


def load(results: Path) -> dict[str, list[RunSummary]]:
    """Every finished run under ``results``, by arm (in :data:`ARMS` order, then others), seeds ascending."""
    by_arm: dict[str, list[RunSummary]] = {}
    for done in sorted(results.glob("*/seed*/done.json")):
        arm, seed = done.parent.parent.name, int(done.parent.name[4:])
        rows = result_files.read_jsonl(done.parent / "metrics.jsonl")
        by_arm.setdefault(arm, []).append(summarize(arm, seed, rows))
    order = [a for a in ARMS if a in by_arm] + sorted(a for a in by_arm if a not in ARMS)
    return {a: sorted(by_arm[a], key=lambda s: s.seed) for a in order}


def table(by_arm: dict[str, list[RunSummary]]) -> str:
    lines = [
        f"| arm | seeds | collapses | learn (+{LEARN_GAIN}) | reward first -> last {WINDOW} | "
        f"accuracy last {WINDOW} (95% CI) | length first -> last | entropy first -> last | s/step |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for arm, runs in by_arm.items():
        acc, lo, hi = t_interval([r.accuracy[1] for r in runs])
        mean = lambda f: statistics.fmean(f(r) for r in runs)  # noqa: E731
        lines.append(
            f"| {arm} | {len(runs)} | {sum(r.collapsed for r in runs)} | {sum(r.learns for r in runs)} | "
            f"{mean(lambda r: r.reward[0]):.3f} -> {mean(lambda r: r.reward[1]):.3f} | "
            f"{acc:.3f} ({lo:.3f}, {hi:.3f}) | {mean(lambda r: r.length[0]):.1f} -> {mean(lambda r: r.length[1]):.1f} | "
            f"{mean(lambda r: r.entropy[0]):.3f} -> {mean(lambda r: r.entropy[1]):.3f} | "
            f"{mean(lambda r: r.sec_per_step):.1f} |")
    return "\n".join(lines)


def per_seed(by_arm: dict[str, list[RunSummary]]) -> str:
    """Reward first -> last window per seed, one column per arm; C marks a collapse, x a seed that did not learn."""
    seeds = sorted({r.seed for runs in by_arm.values() for r in runs})
    cells = {(r.arm, r.seed): r for runs in by_arm.values() for r in runs}
    lines = ["| seed | " + " | ".join(by_arm) + " |", "|---|" + "---|" * len(by_arm)]
    for seed in seeds:
        row = []
        for arm in by_arm:
            r = cells.get((arm, seed))
            mark = "" if r is None or r.learns else (" C" if r.collapsed else " x")
            row.append("" if r is None else f"{r.reward[0]:.2f} -> {r.reward[1]:.2f}{mark}")
        lines.append(f"| {seed} | " + " | ".join(row) + " |")
    return "\n".join(lines)


def _cpu() -> str:
    for line in Path("/proc/cpuinfo").read_text().splitlines() if Path("/proc/cpuinfo").is_file() else []:
        if line.startswith("model name"):
            return line.split(":", 1)[1].strip()
    return platform.processor()


def run_one(arm: str, seed: int, *, results: Path, work: Path, extra: list[str]) -> None:
    """Train ``arm`` with ``seed`` unless ``done.json`` is there (a run cut off part-way starts over)."""
    out = results / arm / f"seed{seed}"
    if (out / "done.json").is_file():
        return
    shutil.rmtree(out, ignore_errors=True)
    out.mkdir(parents=True)
    run_dir = work / arm / f"seed{seed}"
    shutil.rmtree(run_dir, ignore_errors=True)
    t0 = time.time()
    _run([_cli(), "train", "--output-dir", str(run_dir), *_sets({**ARMS[arm], **PINNED, "training.seed": seed}),
          *extra], out / "log.txt", None)
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines() if line.strip()]
    result_files.write_text(out / "metrics.jsonl", "".join(json.dumps({k: r[k] for k in KEEP}) + "\n" for r in rows))
    (out / "log.txt").unlink()
    (out / "done.json").write_text(json.dumps({
        "arm": arm, "seed": seed, "steps": len(rows), "wall_s": round(time.time() - t0, 1), "cpu": _cpu(),
        "extra": extra}, indent=1) + "\n")
    shutil.rmtree(run_dir, ignore_errors=True)


def _seeds(text: str) -> list[int]:
    out: list[int] = []
    for part in text.split(","):
        lo, _, hi = part.partition("-")
        out += list(range(int(lo), int(hi or lo) + 1))
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="command", required=True)
    run = sub.add_parser("run", help="train every (arm, seed) not yet in the results, then print the tables")
    run.add_argument("--arms", default=",".join(ARMS), help=f"comma-separated, from {list(ARMS)}")
    run.add_argument("--seeds", default="0-9", help="e.g. 0-9 or 0,3,5")
    run.add_argument("--results", type=Path, default=RESULTS)
    run.add_argument("--work-dir", type=Path, default=None, help="run folders (default: a temporary folder)")
    run.add_argument("extra", nargs="*", help="arguments passed to every maxent-grpo train (after --)")
    tab = sub.add_parser("table", help="the tables from the results (seconds)")
    tab.add_argument("--results", type=Path, default=RESULTS)
    args = parser.parse_args(argv)
    if args.command == "run":
        arms = args.arms.split(",")
        unknown = [a for a in arms if a not in ARMS]
        if unknown:
            parser.error(f"--arms: unknown {unknown}; choose from {list(ARMS)}")
        work = args.work_dir or Path(tempfile.mkdtemp(prefix="default-learning-"))
        for seed in _seeds(args.seeds):
            for arm in arms:
                run_one(arm, seed, results=args.results, work=work, extra=args.extra)
                print(f"done: {arm} seed {seed}", flush=True)
    by_arm = load(args.results)
    print(table(by_arm) + "\n\n" + per_seed(by_arm))
    return 0


if __name__ == "__main__":
    sys.exit(main())
