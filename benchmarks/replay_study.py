"""Verified mode replay on ModeBench (issue 35): Re:Dr, Re:Max, MaxRL, Dr.GRPO, the replay control, xDr.

    python -m benchmarks.replay_study run       # train + evaluate every (arm, seed) not yet in the results
    python -m benchmarks.replay_study analyze   # the tables from the committed raw results (seconds)
    python -m benchmarks.replay_study length    # one arm and seed, pass@8 every --every steps: the study's length
    python -m benchmarks.replay_study smoke --work-dir DIR   # tiny model, two arms, two steps

BENCHMARKS.md §12. Every arm trains from ``recipes/modebench_replay.yaml`` (SmolLM2-135M-Instruct on
the modebench package's level-1 graph colouring, generated offline, graded by the package: a binary
reward) with only its method keys changed, so all arms of a training seed consume the same prompts
in the same order. Each final model is evaluated once with ``maxent-grpo eval`` on the fixed eval
split: ``eval.draws`` groups of ``eval.k`` samples per prompt at temperature 1 plus one greedy, with
the same sampling seed for every arm. One (arm, train seed) writes ``<results>/<arm>/seed<s>/``:
``config.yaml`` (the full resolved config), ``train_metrics.jsonl``, ``eval/{summary.json,
completions.jsonl, per_prompt.jsonl}`` (prompt text dropped; each ``.jsonl`` stored gzipped,
``benchmarks/result_files.py``) and last ``done.json``; a run with
``done.json`` is skipped, so ``run`` resumes. The analysis is ``benchmarks/replay_study_stats.py``.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import shutil
import sys
import tempfile
import time
from pathlib import Path

from benchmarks.modebench import START, _cli, _env, _run, _sets, _slim, smoke_model, train_arm
from benchmarks import result_files

REPO = Path(__file__).resolve().parents[1]
RECIPE = REPO / "recipes" / "modebench_replay.yaml"
RESULTS = REPO / "benchmarks" / "results" / "modebench_replay"
DR_GRPO_LOSS = {"loss.loss_type": "dr_grpo", "loss.scale_rewards": "none"}

# arm -> overrides of the recipe (dotted keys). Every arm but the default method sits on Dr.GRPO's
# loss (the presets of redr, remax and maxrl set it; §16-§17), with beta 0 (the recipe's default).
ARMS: dict[str, dict] = {
    START: {},
    "dr_grpo": {"method": "dr_grpo", **DR_GRPO_LOSS},
    "redr": {"method": "redr", **DR_GRPO_LOSS},
    "remax": {"method": "remax", **DR_GRPO_LOSS},
    "maxrl": {"method": "maxrl", **DR_GRPO_LOSS},
    # The control: every replay pass runs and the bank fills, with an exactly zero replay gradient. Its
    # weights equal Dr.GRPO's bit for bit, so after its run the evaluation is reused (see run_one).
    "redr_control": {"method": "redr", **DR_GRPO_LOSS, "replay.compute_only": True},
    # §2d's best MaxEnt arm by pass@8 (+4.2 points, the interval containing 0).
    "xdr_tau0.01": {"method": "xdr", **DR_GRPO_LOSS, "xdr.tau": 0.01},
    # The built-in default method, MaxEnt listwise weights (its own loss; the recipe's beta 0).
    "maxent_listwise": {"method": "maxent_listwise"},
}
TRAIN_SEEDS = (0, 1, 2)
EVAL_SEED = 0  # one evaluation per run, the same sampling seed for every arm (its draws are the replicates)
EVAL_PROBLEMS = 16


def run_one(arm: str, seed: int, *, results: Path, work: Path, base: list[str], env: dict,
            eval_problems: int = EVAL_PROBLEMS) -> Path:
    """Train ``arm`` with ``seed`` and evaluate its final model; skip when ``done.json`` exists."""
    trained = train_arm(arm, ARMS[arm], seed, results=results, work=work, base=base, env=env)
    if trained is None:
        return results / arm / f"seed{seed}"
    out, run_dir, log, final, steps, train_s = (trained.out, trained.run_dir, trained.log, trained.final,
                                                trained.steps, trained.train_s)
    t1 = time.time()
    weights = None if arm == START else hashlib.sha256((final / "model.safetensors").read_bytes()).hexdigest()
    twin = _same_weights(results, seed, weights)
    for partial in (out / "eval", run_dir / "eval"):  # left by a run cut off while evaluating
        shutil.rmtree(partial, ignore_errors=True)
    if twin is not None:
        # The same weights and the same eval seed give the same samples: the twin's evaluation is this one's.
        shutil.copytree(twin / "eval", out / "eval")
    else:
        _evaluate(final, run_dir / "eval", out / "eval", base=base, eval_problems=eval_problems, log=log, env=env)
    (out / "done.json").write_text(json.dumps({
        "arm": arm, "seed": seed, "steps": steps, "train_s": train_s, "resumed_from": trained.resumed_from,
        "eval_s": time.time() - t1,
        "eval_seed": EVAL_SEED, "weights_sha256": weights,
        "eval_of": None if twin is None else twin.parent.name}, indent=1) + "\n")
    shutil.rmtree(run_dir, ignore_errors=True)
    return out


def _evaluate(model: Path | str, scratch: Path, dest: Path, *, base: list[str], eval_problems: int, log: Path,
              env: dict) -> None:
    """``maxent-grpo eval`` of ``model`` on the fixed eval split (:data:`EVAL_SEED`'s draws) into ``scratch``,
    kept without prompt text in ``dest``."""
    eval_sets = {"data.task_kwargs.split": "eval", "data.size": eval_problems, "training.seed": EVAL_SEED}
    _run([_cli(), "eval", str(model), *base, *_sets(eval_sets), "--num-prompts", str(eval_problems),
          "--output", str(scratch)], log, env)
    _slim(scratch, dest)


def _same_weights(results: Path, seed: int, weights: str | None) -> Path | None:
    """A finished, separately evaluated run of ``seed`` whose final weights hash to ``weights`` (the replay
    control trains bitwise like Dr.GRPO: ALGORITHMS.md §17); None when there is none."""
    if weights is None:
        return None
    for done in sorted(results.glob(f"*/seed{seed}/done.json")):
        info = json.loads(done.read_text())
        if info.get("weights_sha256") == weights and info.get("eval_of") is None:
            return done.parent
    return None


def cmd_run(args) -> int:
    arms = args.arms.split(",") if args.arms else list(ARMS)
    unknown = [a for a in arms if a not in ARMS]
    if unknown:
        raise ValueError(f"--arms: unknown {unknown}; choose from {list(ARMS)}")
    seeds = [int(s) for s in args.seeds.split(",")]
    base = ["--config", str(args.config), *[a for kv in args.set for a in ("--set", kv)]]
    work = args.work_dir or Path(tempfile.mkdtemp(prefix="replay-study-"))
    # Seed-major: every arm gets seed 0 before any gets seed 1, so a cut-off study stays balanced.
    # The start model is evaluated once (its "seed" is only a label).
    jobs = [(arm, seed) for seed in seeds for arm in arms if arm != START or seed == seeds[0]]
    for arm, seed in jobs:
        t0 = time.time()
        print(f"[replay_study] {arm} seed {seed} ...", file=sys.stderr, flush=True)
        run_one(arm, seed, results=args.results, work=work, base=base, env=_env(args.threads),
                eval_problems=args.eval_problems)
        print(f"[replay_study] {arm} seed {seed} done in {time.time() - t0:.0f} s", file=sys.stderr, flush=True)
    return 0


# The study's length (§12b): the first checkpoint from MIN_LENGTH steps on after which pass@8 falls by
# no more than LENGTH_TOLERANCE at any later checkpoint (about a third of one 96-prompt measurement's SE).
MIN_LENGTH = 40
LENGTH_TOLERANCE = 0.03


def run_length(arm: str, seed: int, *, steps: int, every: int, results: Path, work: Path, base: list[str],
               env: dict, eval_problems: int) -> list[tuple[int, dict]]:
    """Train ``arm`` with ``seed`` for ``steps`` steps, a checkpoint every ``every``, and evaluate each one
    like :func:`run_one` does a final model; return ``(step, summary)`` from step 0 (the start model, the
    study's own :data:`START` run) on. ``<results>/length/<arm>/seed<s>/step-N/`` keeps each evaluation
    (``done.json`` last); training resumes from its latest checkpoint, and evaluated steps are skipped."""
    start = run_one(START, seed, results=results, work=work, base=base, env=env, eval_problems=eval_problems)
    out = results / "length" / arm / f"seed{seed}"
    out.mkdir(parents=True, exist_ok=True)
    run_dir, log = work / "length" / arm / f"seed{seed}", out / "log.txt"
    marks = range(every, steps + 1, every)
    if not all((out / f"step-{n}" / "done.json").is_file() for n in marks):
        ckpts = run_dir / "checkpoints"
        if not (ckpts / f"step-{steps}").is_dir():
            overrides = {**ARMS[arm], "training.seed": seed, "training.max_steps": steps,
                         "checkpoint.save_steps": every, "checkpoint.save_minutes": 0, "checkpoint.keep_last": None,
                         "logging.report_to": [], "logging.progress_bar": False, "eval.every_steps": 0}
            resume = ["--resume"] if ckpts.is_dir() and any(ckpts.glob("step-*")) else ["--overwrite"]
            _run([_cli(), "train", *base, "--output-dir", str(run_dir), *_sets(overrides), *resume], log, env)
            shutil.copy(run_dir / "config.yaml", out / "config.yaml")
            result_files.copy(run_dir / "metrics.jsonl", out / "train_metrics.jsonl")
        for n in marks:
            done = out / f"step-{n}" / "done.json"
            if done.is_file():
                continue
            t0 = time.time()
            _evaluate(ckpts / f"step-{n}", run_dir / "eval" / f"step-{n}", done.parent / "eval", base=base,
                      eval_problems=eval_problems, log=log, env=env)
            done.write_text(json.dumps({"arm": arm, "seed": seed, "step": n, "eval_s": time.time() - t0,
                                        "eval_seed": EVAL_SEED}, indent=1) + "\n")
        shutil.rmtree(run_dir, ignore_errors=True)
    summary = [(0, json.loads((start / "eval" / "summary.json").read_text()))]
    return summary + [(n, json.loads((out / f"step-{n}" / "eval" / "summary.json").read_text())) for n in marks]


def study_length(curve: list[tuple[int, float]], min_length: int = MIN_LENGTH,
                 tolerance: float = LENGTH_TOLERANCE) -> int | None:
    """The first step ``>= min_length`` of ``curve`` ((step, pass@8) in step order) from which no later
    pass@8 is lower by more than ``tolerance``: where the sharpening has stopped; None when pass@8 is
    still falling at the last checkpoint."""
    for i, (step, value) in enumerate(curve):
        if step >= min_length and all(later >= value - tolerance for _, later in curve[i + 1:]):
            return step
    return None


def cmd_length(args) -> int:
    if args.arm not in ARMS or args.arm == START:
        raise ValueError(f"--arm: {args.arm!r} is not a trained arm of {list(ARMS)}")
    base = ["--config", str(args.config), *[a for kv in args.set for a in ("--set", kv)]]
    work = args.work_dir or Path(tempfile.gettempdir()) / "replay-study-length"  # the same folder: resumes
    summaries = run_length(args.arm, args.seed, steps=args.steps, every=args.every, results=args.results,
                           work=work, base=base, env=_env(args.threads), eval_problems=args.eval_problems)
    print(f"{args.arm} seed {args.seed}, {args.eval_problems} eval prompts (ModeBench's metrics, k = eval.k)\n")
    print("| step | pass@k | accuracy | distinct@k | greedy pass@1 |\n|---|---|---|---|---|")
    for step, s in summaries:
        print(f"| {step} | {s['mb/pass@k']:.3f} | {s['mb/accuracy']:.3f} | {s['mb/distinct@k']:.3f} "
              f"| {s['greedy_pass@1']:.3f} |")
    length = study_length([(step, s["mb/pass@k"]) for step, s in summaries], min(MIN_LENGTH, args.steps))
    print(f"\nthe study's length (first step >= {MIN_LENGTH} after which pass@k falls by <= {LENGTH_TOLERANCE}): "
          + (f"{length}" if length is not None else "none yet: pass@k still falls at the last checkpoint"))
    return 0


def cmd_analyze(args) -> int:
    from benchmarks.replay_study_stats import analyze

    print(analyze(args.results, arms=list(ARMS), baseline="dr_grpo"))
    return 0


def cmd_smoke(args) -> int:
    """Two arms, two steps, the tiny random model: the whole pipeline, run and analyze."""
    from benchmarks.replay_study_stats import analyze

    work = args.work_dir
    model_dir = smoke_model(work)
    sets = [f"model.name_or_path={model_dir}", "training.max_steps=2", "generation.num_generations=4",
            "generation.max_new_tokens=8", "training.micro_batch_size=4", "eval.k=4"]
    ns = argparse.Namespace(arms="dr_grpo,redr", seeds="0", config=RECIPE, set=sets, results=work / "results",
                            work_dir=work / "runs", threads=args.threads, eval_problems=2)
    cmd_run(ns)
    print(analyze(ns.results, arms=list(ARMS), baseline="dr_grpo"))
    return 0


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    sub = p.add_subparsers(dest="command", required=True)
    run = sub.add_parser("run", help="train and evaluate every (arm, seed) not in the results yet")
    run.add_argument("--arms", help=f"comma-separated, of {list(ARMS)} (default: all)")
    run.add_argument("--seeds", default=",".join(map(str, TRAIN_SEEDS)), help="training seeds")
    run.add_argument("--eval-problems", type=int, default=EVAL_PROBLEMS, help="eval problems (prompts)")
    run.add_argument("--config", type=Path, default=RECIPE, help="the base recipe every arm overrides")
    run.add_argument("--set", action="append", default=[], help="KEY=VALUE override for every arm")
    run.add_argument("--results", type=Path, default=RESULTS, help="raw results folder (resumes from it)")
    run.add_argument("--work-dir", type=Path, help="scratch folder for checkpoints (deleted per run)")
    run.add_argument("--threads", type=int, default=1, help="torch threads per child process")
    lp = sub.add_parser("length", help="one arm and seed, pass@8 every --every steps (the study's length)")
    lp.add_argument("--arm", default="dr_grpo", help=f"one of {list(ARMS)[1:]}")
    lp.add_argument("--seed", type=int, default=0, help="training seed")
    lp.add_argument("--steps", type=int, default=80, help="optimizer steps")
    lp.add_argument("--every", type=int, default=10, help="evaluate a checkpoint every this many steps")
    lp.add_argument("--eval-problems", type=int, default=EVAL_PROBLEMS, help="eval problems (prompts)")
    lp.add_argument("--config", type=Path, default=RECIPE, help="the base recipe")
    lp.add_argument("--set", action="append", default=[], help="KEY=VALUE override")
    lp.add_argument("--results", type=Path, default=RESULTS, help="raw results folder (resumes from it)")
    lp.add_argument("--work-dir", type=Path, help=(
        "scratch folder for checkpoints, kept until every step is evaluated (default: TMPDIR/replay-study-length)"))
    lp.add_argument("--threads", type=int, default=1, help="torch threads per child process")
    ana = sub.add_parser("analyze", help="the tables from the raw results")
    ana.add_argument("--results", type=Path, default=RESULTS)
    smoke = sub.add_parser("smoke", help="tiny model, two arms, two steps")
    smoke.add_argument("--work-dir", type=Path, required=True)
    smoke.add_argument("--threads", type=int, default=1)
    args = p.parse_args(argv)
    commands = {"run": cmd_run, "length": cmd_length, "analyze": cmd_analyze, "smoke": cmd_smoke}
    return commands[args.command](args)


if __name__ == "__main__":
    sys.exit(main())
