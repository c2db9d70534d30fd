"""Learning comparison: ours vs TRL from the same start, same steps, prompts and seeds.

    python benchmarks/learning.py --setting smollm2-64 --steps 40 --learning-rate 1e-5 --seeds 0,1 \\
        --eval-prompts 32 --eval-samples 8

For each seed, both trainers run the same setting (model, prompts in the same
order, sampling, rewards, optimizer, LR) in fresh processes. The table gives
the mean training reward over the first and the last ``--window`` steps, wall
time and seconds per step; with ``--eval-prompts`` each final model (and the
start model, once) is also scored on held-out prompts by
``benchmarks.sample_eval`` (mean task score, pass@1, pass@n).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
from pathlib import Path

if __package__ in (None, ""):  # run as a script: make `benchmarks` importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.children import child_env, python_module_cmd, run_child  # noqa: E402
from benchmarks.model_paths import resolve_model  # noqa: E402
from benchmarks.ours import final_model_dir, ours_available  # noqa: E402
from benchmarks.results import RunResult  # noqa: E402
from benchmarks.settings import BenchSetting, add_setting_args, setting_from_args  # noqa: E402
from benchmarks.sides import run_side, run_trl_saving  # noqa: E402


def window_means(rewards: list[float | None], window: int) -> tuple[float, float]:
    """Mean reward of the first and of the last ``window`` steps."""
    values = [r for r in rewards if r is not None]
    if window < 1 or len(values) < window:
        raise ValueError(f"window must be in [1, {len(values)}] (the logged steps), got {window}")
    return statistics.fmean(values[:window]), statistics.fmean(values[-window:])


def heldout_eval(model_dir: Path, setting: BenchSetting, prompts: int, samples: int, out: Path,
                 env: dict[str, str]) -> dict:
    """``benchmarks.sample_eval`` on ``model_dir`` in a fresh process; its JSON summary.

    The held-out prompts and the sampling seed come from ``setting.seed``: pass the same setting
    for every model that is to be compared."""
    cmd = python_module_cmd(
        "benchmarks.sample_eval", "--model-dir", str(model_dir), "--task", setting.task,
        "--prompts", str(prompts), "--samples", str(samples), "--max-new-tokens", str(setting.max_new_tokens),
        "--seed", str(setting.seed), "--out", str(out), *(["--bf16"] if setting.bf16 else []),
        "--task-kwargs", json.dumps(setting.task_kwargs), "--few-shot", json.dumps(setting.few_shot),
    )
    run_child(cmd, out.with_suffix(".log"), env)
    return json.loads(out.read_text())


def _eval_cells(ev: dict | None) -> str:
    if ev is None:
        return "— | — | —"
    pass_at = {int(k): v for k, v in ev["pass_at"].items()}
    return f"{ev['mean_score']:.3f} | {pass_at[1]:.3f} | {pass_at[max(pass_at)]:.3f}"


def learning_table(rows: list[dict], window: int, start_eval: dict | None, samples: int) -> str:
    lines = [
        f"| side | seed | reward first {window} | reward last {window} | change | s/step median | process wall s "
        f"| held-out score | pass@1 | pass@{samples} |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    if start_eval is not None:
        lines.append(f"| start model | — | — | — | — | — | — | {_eval_cells(start_eval)} |")
    for r in rows:
        first, last = r["first"], r["last"]
        lines.append(
            f"| {r['side']} | {r['seed']} | {first:.3f} | {last:.3f} | {last - first:+.3f} "
            f"| {statistics.median(r['step_times']):.2f} | {r['wall_s']:.0f} | {_eval_cells(r['eval'])} |"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description="Ours vs TRL: reward at start and end, wall time, held-out score.")
    add_setting_args(p)
    p.add_argument("--seeds", default="0", help="comma-separated seeds")
    p.add_argument("--window", type=int, default=5, help="steps averaged at the start and at the end")
    p.add_argument("--eval-prompts", type=int, default=0, help="held-out prompts (0: no held-out evaluation)")
    p.add_argument("--eval-samples", type=int, default=8)
    p.add_argument("--threads", type=int)
    p.add_argument("--work-dir", type=Path)
    p.add_argument("--json-out", type=Path)
    args = p.parse_args(argv)
    base = setting_from_args(args)
    seeds = [int(s) for s in args.seeds.split(",") if s.strip()]
    why = ours_available()
    if why is not None:
        print(f"learning comparison needs our trainer: {why}", file=sys.stderr)
        return 2
    work = args.work_dir or Path(tempfile.mkdtemp(prefix="maxent-learning-"))
    env = child_env(args.threads)
    model_dir = resolve_model(base.model)
    evaluate = args.eval_prompts > 0
    start_eval = (
        heldout_eval(model_dir, base, args.eval_prompts, args.eval_samples, work / "eval-start.json", env)
        if evaluate else None
    )
    rows = []
    for seed in seeds:
        setting = base.replace(seed=seed)
        for side in ("ours", "trl"):
            run_dir = work / f"seed{seed}" / side
            print(f"[seed {seed}] {side} ...", file=sys.stderr, flush=True)
            if side == "ours":
                result: RunResult = run_side("ours", setting, model_dir, run_dir, env)
                final = final_model_dir(run_dir, setting.steps) if evaluate else None
            elif evaluate:
                result, final = run_trl_saving(setting, model_dir, run_dir, env)
            else:
                result, final = run_side("trl", setting, model_dir, run_dir, env), None
            first, last = window_means(result.rewards, args.window)
            # `base`: every model, the start model included, is scored on the same held-out prompts.
            ev = heldout_eval(final, base, args.eval_prompts, args.eval_samples, run_dir / "eval.json", env) \
                if final is not None else None
            rows.append({"side": side, "seed": seed, "first": first, "last": last, "rewards": result.rewards,
                         "step_times": result.step_times, "wall_s": result.wall_s, "eval": ev})
    print(f"### learning: {base.model}, {base.task}, P={base.prompts_per_step} G={base.num_generations} "
          f"max_new_tokens={base.max_new_tokens}, lr={base.learning_rate}, beta={base.beta}, "
          f"loss={base.loss_type}, {base.steps} steps, seeds {seeds}\n")
    print(learning_table(rows, args.window, start_eval, args.eval_samples))
    print(f"\n* raw results in {work}")
    if args.json_out is not None:
        args.json_out.write_text(json.dumps({"setting": base.__dict__, "start_eval": start_eval, "runs": rows}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
