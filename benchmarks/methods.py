"""Methods at equal budget: GRPO, Dr.GRPO, MaxEnt listwise and xDr with our trainer.

    python benchmarks/methods.py --setting smollm2-pair-sum --seeds 0 --eval-prompts 32 --eval-samples 8

Every method gets the same model, prompts, sampling, rewards, optimizer, LR and
number of optimizer steps (so the same generated-token budget). Each final
model is scored on held-out prompts of a task with many correct answers
(the benchmark's ``pair_sum`` by default: every a + b = n is correct; reasoning-gym's
``countdown`` is the other choice, too hard for SmolLM2-135M) by
``benchmarks.sample_eval``: mean task score, pass@1, pass@n and the number of
distinct correct answers per prompt, next to the training reward at the start
and end and the wall time.
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

from benchmarks.children import child_env  # noqa: E402
from benchmarks.learning import heldout_eval, window_means  # noqa: E402
from benchmarks.model_paths import resolve_model  # noqa: E402
from benchmarks.ours import final_model_dir, ours_available  # noqa: E402
from benchmarks.settings import add_setting_args, setting_from_args  # noqa: E402
from benchmarks.sides import run_side  # noqa: E402

# name -> (our method, loss_type, extra config sections). The method presets of
# our config supply the rest (e.g. Dr.GRPO's unscaled advantages).
METHOD_VARIANTS: dict[str, tuple[str, str, dict]] = {
    "grpo": ("grpo", "grpo", {}),
    "dr_grpo": ("dr_grpo", "dr_grpo", {"loss": {"scale_rewards": "none"}}),
    # Weighted MLE on the listwise targets, as in the default recipe (BENCHMARKS.md §3).
    "maxent_listwise": ("maxent_listwise", "dapo", {"maxent": {"listwise_loss": "weighted_mle"}}),
    "xdr": ("xdr", "dapo", {}),
}


def _cell(value: float | None, fmt: str) -> str:
    return "—" if value is None else format(value, fmt)


def methods_table(rows: list[dict], window: int, samples: int) -> str:
    lines = [
        f"| method | seed | reward first {window} | reward last {window} | held-out score | pass@1 "
        f"| pass@{samples} | distinct correct / prompt | format rate | s/step median | process wall s |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        ev = r["eval"]
        pass_at = {int(k): v for k, v in ev["pass_at"].items()}
        lines.append(
            f"| {r['method']} | {'—' if r['seed'] is None else r['seed']} | {_cell(r['first'], '.3f')} | {_cell(r['last'], '.3f')} "
            f"| {ev['mean_score']:.3f} | {pass_at[1]:.3f} | {pass_at[max(pass_at)]:.3f} "
            f"| {ev['distinct_correct_per_prompt']:.2f} | {ev['format_rate']:.2f} "
            f"| {_cell(statistics.median(r['step_times']) if r['step_times'] else None, '.2f')} "
            f"| {_cell(r['wall_s'], '.0f')} |"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description="GRPO, Dr.GRPO, MaxEnt listwise, xDr at equal budget.")
    add_setting_args(p)
    p.add_argument("--methods", default=",".join(METHOD_VARIANTS), help="comma-separated subset")
    p.add_argument("--seeds", default="0")
    p.add_argument("--window", type=int, default=5)
    p.add_argument("--eval-prompts", type=int, default=32)
    p.add_argument("--eval-samples", type=int, default=8)
    p.add_argument("--threads", type=int)
    p.add_argument("--work-dir", type=Path)
    p.add_argument("--json-out", type=Path)
    p.add_argument("--no-start-eval", dest="start_eval", action="store_false",
                   help="skip the held-out evaluation of the start model")
    args = p.parse_args(argv)
    methods = [m.strip() for m in args.methods.split(",") if m.strip()]
    unknown = [m for m in methods if m not in METHOD_VARIANTS]
    if unknown:
        raise ValueError(f"--methods: unknown {unknown}; choose from {sorted(METHOD_VARIANTS)}")
    if args.eval_prompts < 1:
        raise ValueError(f"--eval-prompts must be >= 1, got {args.eval_prompts}")
    why = ours_available()
    if why is not None:
        print(f"the methods comparison needs our trainer: {why}", file=sys.stderr)
        return 2
    base = setting_from_args(args)
    seeds = [int(s) for s in args.seeds.split(",") if s.strip()]
    work = args.work_dir or Path(tempfile.mkdtemp(prefix="maxent-methods-"))
    env = child_env(args.threads)
    model_dir = resolve_model(base.model)
    rows = []
    # Every model, the start model included, is scored on the same held-out prompts (those of `base`).
    if args.start_eval:
        ev = heldout_eval(model_dir, base, args.eval_prompts, args.eval_samples, work / "eval-start.json", env)
        rows.append({"method": "start model", "seed": None, "first": None, "last": None, "rewards": None,
                     "step_times": None, "wall_s": None, "eval": ev})
    for seed in seeds:
        for name in methods:
            method, loss_type, extra = METHOD_VARIANTS[name]
            setting = base.replace(seed=seed, method=method, loss_type=loss_type)
            run_dir = work / f"seed{seed}" / name
            print(f"[seed {seed}] {name} ...", file=sys.stderr, flush=True)
            result = run_side("ours", setting, model_dir, run_dir, env, ours_extra=extra)
            first, last = window_means(result.rewards, args.window)
            ev = heldout_eval(final_model_dir(run_dir, setting.steps), base, args.eval_prompts,
                              args.eval_samples, run_dir / "eval.json", env)
            rows.append({"method": name, "seed": seed, "first": first, "last": last, "rewards": result.rewards,
                         "step_times": result.step_times, "wall_s": result.wall_s, "eval": ev})
    print(f"### methods: {base.model}, {base.task}, P={base.prompts_per_step} G={base.num_generations} "
          f"max_new_tokens={base.max_new_tokens}, lr={base.learning_rate}, beta={base.beta}, "
          f"{base.steps} steps, seeds {seeds}\n")
    print(methods_table(rows, args.window, args.eval_samples))
    print(f"\n* raw results in {work}")
    if args.json_out is not None:
        args.json_out.write_text(json.dumps({"setting": base.__dict__, "runs": rows}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
