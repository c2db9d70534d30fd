"""Ours vs TRL vs the floor, side by side: the one benchmark command.

    python benchmarks/run.py --setting tiny|smollm2-64|smollm2-256 --beta 0 --reps 3

Each repetition runs every side once, each in a fresh process, in an order
that rotates from one repetition to the next (so a busy machine does not
always hit the same side). All sides get the same model folder, prompts,
sampling, rewards, optimizer and LR (one :class:`BenchSetting` JSON). The
table reports seconds per optimizer step over the steps after each run's
first (warm-up) step, ratios to TRL and to the floor, peak RSS (each child's
own ``ru_maxrss``), generated tokens per second and the process CPU time per
step. Every side records a hash of the prompt token ids each step trained on
(``prompt_hashes``); the run fails, with no table, when two sides differ at any
step of any repetition. "Ours" is skipped, with the reason printed, only when
our CLI is absent; "ours_vllm" (our trainer with ``generation.backend: vllm``) also when vLLM is
(run it from ``.venv-vllm``: ``.venv-vllm/bin/python benchmarks/run.py --sides ours,ours_vllm,trl,floor``).
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

from benchmarks.children import child_env  # noqa: E402
from benchmarks.model_paths import resolve_model  # noqa: E402
from benchmarks.ours import ours_available, ours_vllm_available  # noqa: E402
from benchmarks.results import SIDES, RunResult, markdown_table, prompt_mismatch, summarize  # noqa: E402
from benchmarks.settings import BenchSetting, add_setting_args, setting_from_args  # noqa: E402
from benchmarks.sides import run_side  # noqa: E402


def compare(setting: BenchSetting, sides: list[str], reps: int, work_dir: Path,
            threads: int | None = None, timeout_s: float | None = None,
            ours_extra: dict | None = None) -> dict[str, list[RunResult]]:
    """``reps`` rotations over ``sides``; returns the runs of each side. ``ours_extra``: config sections
    our side (and only ours) gets on top of the setting's."""
    if reps < 1:
        raise ValueError(f"reps must be >= 1, got {reps}")
    unknown = [s for s in sides if s not in SIDES]
    if unknown or not sides:
        raise ValueError(f"sides must be a non-empty subset of {SIDES}, got {sides}")
    model_dir = resolve_model(setting.model)  # built or converted here, outside every timed child
    work_dir.mkdir(parents=True, exist_ok=True)
    env = child_env(threads)
    runs: dict[str, list[RunResult]] = {s: [] for s in sides}
    for rep in range(reps):
        order = sides[rep % len(sides):] + sides[: rep % len(sides)]
        for side in order:
            print(f"[rep {rep + 1}/{reps}] {side} ...", file=sys.stderr, flush=True)
            result = run_side(side, setting, model_dir, work_dir / f"rep{rep}" / side, env, timeout_s,
                              ours_extra=ours_extra)
            print(f"[rep {rep + 1}/{reps}] {side}: step s {[round(t, 2) for t in result.step_times]}, "
                  f"peak RSS {result.peak_rss_bytes / 2**30:.2f} GiB", file=sys.stderr, flush=True)
            runs[side].append(result)
    return runs


def title(setting: BenchSetting, reps: int) -> str:
    dtype = "bf16" if setting.bf16 else "fp32"
    return (
        f"{setting.name}: {setting.model}, {setting.task}, P={setting.prompts_per_step} G={setting.num_generations} "
        f"max_new_tokens={setting.max_new_tokens} micro={setting.micro_batch_size}, beta={setting.beta}, "
        f"loss={setting.loss_type}, {dtype}{', activation checkpointing' if setting.gradient_checkpointing else ''}; "
        f"{reps} rep(s) x {setting.steps} steps"
    )


def _parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description="Ours vs TRL vs the floor: seconds per step, peak RSS, tokens/s.")
    add_setting_args(p)
    p.add_argument("--reps", type=int, default=3)
    p.add_argument("--sides", default="ours,trl,floor",
                   help="comma-separated subset of ours,ours_vllm,trl,floor (ours_vllm: run in .venv-vllm)")
    p.add_argument("--threads", type=int, help="OMP/MKL threads of every child (default: torch's own choice)")
    p.add_argument("--timeout", type=float, help="seconds allowed per child run")
    p.add_argument("--work-dir", type=Path, help="where configs, logs and raw results go (default: a new temp dir)")
    p.add_argument("--json-out", type=Path, help="write the summaries and raw runs here")
    p.add_argument("--ours-packing", action="store_true",
                   help="our training.packing: true (its auto, the default, already packs on the CPU: completions "
                        "behind the shared prompts); TRL's GRPOTrainer and the floor have no counterpart")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = _parse_args(argv)
    setting = setting_from_args(args)
    sides = [s.strip() for s in args.sides.split(",") if s.strip()]
    notes = []
    for side in ("ours", "ours_vllm"):
        why = ours_available() if side == "ours" else ours_vllm_available()
        if side in sides and why is not None:
            sides.remove(side)
            notes.append(f"{side} skipped: {why}")
            print(notes[-1], file=sys.stderr)
    work_dir = args.work_dir or Path(tempfile.mkdtemp(prefix="maxent-bench-"))
    load_before = os.getloadavg()
    ours_extra = {"training": {"packing": True}} if args.ours_packing else None
    if args.ours_packing:
        notes.append("ours with training.packing: true")
    runs = compare(setting, sides, args.reps, work_dir, args.threads, args.timeout, ours_extra=ours_extra)
    load_after = os.getloadavg()
    mismatch = prompt_mismatch(runs)
    if mismatch is not None:
        print(f"FAILED: the sides did not train on the same prompts: {mismatch} (raw results in {work_dir})",
              file=sys.stderr)
        return 1
    summaries = {side: summarize(side, side_runs) for side, side_runs in runs.items()}
    process_cpu = ", ".join(
        f"{side} {statistics.median(r.extra['process_cpu_s'] for r in side_runs):.0f}" for side, side_runs in runs.items()
    )
    notes.append(f"process CPU s per run (median; start-up and ours' final checkpoint included): {process_cpu}")
    notes.append(f"threads per child: {args.threads or 'torch default'}; 1-min load average "
                 f"{load_before[0]:.1f} before, {load_after[0]:.1f} after ({os.cpu_count()} CPUs); "
                 f"raw results in {work_dir}")
    print(markdown_table(summaries, title(setting, args.reps)))
    print()
    for note in notes:
        print(f"* {note}")
    if args.json_out is not None:
        payload = {
            "setting": setting.__dict__,
            "reps": args.reps,
            "notes": notes,
            "summaries": {k: v.__dict__ for k, v in summaries.items()},
            "runs": {k: [r.__dict__ for r in v] for k, v in runs.items()},
        }
        args.json_out.write_text(json.dumps(payload, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
