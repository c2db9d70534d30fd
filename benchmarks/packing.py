"""Padding-free packing (``training.packing``) against the padded and the shared-prompt policy passes:
seconds per step, seconds in the policy phase, and the token positions one policy pass computes
(``tokens/policy_forward``) against the batch's real tokens (``tokens/real``), on the same prompts.

    python benchmarks/packing.py --setting smollm2-64 --reps 2 --threads 2

Each repetition runs the four variants one after the other (A B C D A B C D), each in a fresh process,
so a busy machine slows them alike; the first step of each run is the warm-up and is left out.
Generation is the same in all four (it shares prompts whenever the CPU default does), so every
variant trains on the same completions at its first step.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.children import child_env  # noqa: E402
from benchmarks.model_paths import resolve_model  # noqa: E402
from benchmarks.ours import run_ours  # noqa: E402
from benchmarks.settings import add_setting_args, setting_from_args  # noqa: E402

VARIANTS = {
    "padded": {"training": {"share_prompts": False, "packing": False}},
    "shared prompts": {"training": {"share_prompts": True, "packing": False}},
    "packed": {"training": {"share_prompts": False, "packing": True}},
    "shared prompts, packed completions": {"training": {"share_prompts": True, "packing": True}},
}


def _mean(rows: list[dict], key: str) -> float:
    return statistics.fmean(float(r[key]) for r in rows)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_setting_args(p)
    p.add_argument("--reps", type=int, default=2)
    p.add_argument("--threads", type=int)
    p.add_argument("--work-dir", type=Path)
    p.add_argument("--json-out", type=Path)
    args = p.parse_args(argv)
    setting = setting_from_args(args)
    if setting.steps < 2:
        raise SystemExit("--steps must be >= 2 (the first step is the warm-up)")
    work = args.work_dir or Path(tempfile.mkdtemp(prefix="packing-"))
    model_dir = resolve_model(setting.model)
    env = child_env(args.threads)
    raw: dict[str, list[list[dict]]] = {v: [] for v in VARIANTS}
    for rep in range(args.reps):
        for name, extra in VARIANTS.items():
            result = run_ours(setting, model_dir, work / f"rep{rep}" / name.replace(" ", "_"), env, extra=extra)
            raw[name].append(result.extra["metrics"])
    first = {name: runs[0][0]["reward"] for name, runs in raw.items()}
    print(f"{setting.name}: {setting.model}, P={setting.prompts_per_step} G={setting.num_generations} "
          f"max_new_tokens={setting.max_new_tokens} micro={setting.micro_batch_size}, "
          f"{'bf16' if setting.bf16 else 'fp32'}; {args.reps} rep(s) x {setting.steps} steps (first left out); "
          f"step-1 rewards {first}")
    print("| variant | s/step | policy s/step | tokens/policy_forward | tokens/real | computed/real |")
    print("|---|---|---|---|---|---|")
    summary = {}
    for name, runs in raw.items():
        timed = [r for run in runs for r in run[1:]]
        every = [r for run in runs for r in run]
        row = {"step_s": statistics.median(float(r["step_time"]) for r in timed),
               "policy_s": statistics.median(float(r["time/policy"]) for r in timed),
               "forward": _mean(every, "tokens/policy_forward"), "real": _mean(every, "tokens/real")}
        summary[name] = row
        print(f"| {name} | {row['step_s']:.3f} | {row['policy_s']:.3f} | {row['forward']:.0f} | {row['real']:.0f} "
              f"| {row['forward'] / row['real']:.2f} |")
    if args.json_out:
        args.json_out.write_text(json.dumps({"setting": setting.__dict__, "summary": summary, "raw": raw}, indent=1,
                                            default=str))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
