"""DDP vs FSDP2 on 2 processes: seconds per step and peak memory of each process.

    python benchmarks/sharding_bench.py --setting tiny|smollm2-64 --reps 1 --threads 1

Each strategy runs our CLI under ``torchrun --standalone --nproc_per_node 2``
(gloo on a CPU) with the same benchmark setting (``settings.py``, mapped by
``ours.ours_config``; ``--prompts-per-step`` is per process, as in training).
Each worker writes its own peak RSS at exit (``peak_worker.py``). Step time is
the median, min and max of ``step_time`` over the steps after each run's first.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
from pathlib import Path

if __package__ in (None, ""):  # run as a script: make `benchmarks` importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.children import child_env, run_child  # noqa: E402
from benchmarks.model_paths import resolve_model  # noqa: E402
from benchmarks.ours import read_metrics, write_config  # noqa: E402
from benchmarks.settings import add_setting_args, setting_from_args  # noqa: E402

STRATEGIES = ("ddp", "fsdp2")
NPROC = 2


def run_strategy(strategy: str, setting, model_dir: Path, work: Path, env: dict[str, str]) -> dict:
    config = write_config(setting, model_dir, work / "config.yaml", {"training": {"strategy": strategy}})
    peaks = work / "peaks"
    peaks.mkdir(parents=True, exist_ok=True)
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", str(NPROC),
           "-m", "benchmarks.peak_worker", "train", "--config", str(config), "--output-dir", str(work / "out"),
           "--max-steps", str(setting.steps)]
    child = run_child(cmd, work / "torchrun.log", {**env, "PEAK_DIR": str(peaks)})
    times = [float(r["step_time"]) for r in read_metrics(work / "out")][1:]
    rss = [json.loads((peaks / f"rank-{r}.json").read_text())["peak_rss_bytes"] for r in range(NPROC)]
    return {"step_times": times, "peak_rss_bytes": rss, "wall_s": child.wall_s}


def table(results: dict[str, list[dict]]) -> str:
    lines = ["| strategy | s/step median | min | max | peak RSS rank 0 GiB | peak RSS rank 1 GiB | steps timed |",
             "|---|---|---|---|---|---|---|"]
    for strategy, runs in results.items():
        times = [t for r in runs for t in r["step_times"]]
        rss = [max(r["peak_rss_bytes"][k] for r in runs) / 2**30 for k in range(NPROC)]
        lines.append(f"| {strategy} | {statistics.median(times):.3f} | {min(times):.3f} | {max(times):.3f} | "
                     f"{rss[0]:.2f} | {rss[1]:.2f} | {len(times)} ({len(runs)} runs) |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description="DDP vs FSDP2 on 2 processes: seconds per step, peak RSS per process.")
    add_setting_args(p)
    p.add_argument("--reps", type=int, default=1)
    p.add_argument("--strategies", default=",".join(STRATEGIES))
    p.add_argument("--threads", type=int, default=1, help="OMP/MKL threads of each worker")
    p.add_argument("--work-dir", type=Path)
    args = p.parse_args(argv)
    setting = setting_from_args(args)
    if setting.steps < 2:
        p.error("--steps must be >= 2 (the first step is not timed)")
    model_dir = resolve_model(setting.model)
    work = args.work_dir or Path(tempfile.mkdtemp(prefix="maxent-sharding-"))
    env = child_env(args.threads)
    results: dict[str, list[dict]] = {}
    load_before = os.getloadavg()[0]
    for rep in range(args.reps):
        for strategy in args.strategies.split(","):
            print(f"[rep {rep + 1}/{args.reps}] {strategy} ...", file=sys.stderr, flush=True)
            results.setdefault(strategy, []).append(
                run_strategy(strategy, setting, model_dir, work / f"rep{rep}" / strategy, env))
    print(f"{setting.name}: {setting.model}, P={setting.prompts_per_step} per process x {NPROC} processes, "
          f"G={setting.num_generations}, {setting.max_new_tokens} tokens, micro={setting.micro_batch_size}, "
          f"{'bf16' if setting.bf16 else 'fp32'}, {setting.steps} steps per run")
    print(table(results))
    print(f"\n* threads per worker: {args.threads}; 1-min load average {load_before:.1f} before, "
          f"{os.getloadavg()[0]:.1f} after ({os.cpu_count()} CPUs); raw results in {work}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
