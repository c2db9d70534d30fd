"""ModeBench study: do the MaxEnt methods keep more correct answers than Dr.GRPO? (issue 14)

    python -m benchmarks.modebench run       # train + evaluate every (arm, seed) not yet in the results
    python -m benchmarks.modebench analyze   # table and plots from the committed raw results
    python -m benchmarks.modebench smoke --work-dir DIR   # tiny model, two arms, two steps

Every arm trains from ``recipes/modebench.yaml`` (SmolLM2-135M-Instruct on the three
ModeBench tasks interleaved, Dr.GRPO) with only its method's keys changed, so all arms
consume the same prompts (``training.max_steps * training.prompts_per_step``) from the same
seeded order. Each final model is evaluated with ``maxent-grpo eval`` on the fixed eval
split (K samples at temperature 1 plus one greedy) once per eval seed. One (arm, train seed)
writes ``<results>/<arm>/seed<s>/``: ``config.yaml`` (the full resolved config),
``train_metrics.jsonl``, ``eval-seed<e>/{summary.json, completions.jsonl, per_prompt.jsonl}``
and last ``done.json`` (each ``.jsonl`` stored gzipped, ``benchmarks/result_files.py``); a run with
``done.json`` is skipped, so ``run`` resumes.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import yaml

from benchmarks import result_files

REPO = Path(__file__).resolve().parents[1]
RECIPE = REPO / "recipes" / "modebench.yaml"
RESULTS = REPO / "benchmarks" / "results" / "modebench"
DR_GRPO_LOSS = {"loss.loss_type": "dr_grpo", "loss.scale_rewards": "none"}

# arm -> overrides of recipes/modebench.yaml (dotted keys). Every arm sits on Dr.GRPO's loss.
START = "start_model"  # not trained: the start model's scores under the same evaluation
ARMS: dict[str, dict] = {
    START: {},
    "dr_grpo": {"method": "dr_grpo", **DR_GRPO_LOSS},
    **{f"xdr_tau{t}": {"method": "xdr", **DR_GRPO_LOSS, "xdr.tau": t} for t in (0.0, 0.01, 0.05, 0.25)},
    "xdr_adaptive": {"method": "xdr", **DR_GRPO_LOSS, "xdr.tau": 0.05, "xdr.mode_adaptive": True},
    # The default recipe's listwise setting (weighted MLE, tau 0.5; BENCHMARKS.md §3).
    "maxent_listwise": {"method": "maxent_listwise", **DR_GRPO_LOSS, "maxent.tau": 0.5,
                        "maxent.listwise_loss": "weighted_mle"},
    "seed_dr_grpo": {"method": "seed_grpo", **DR_GRPO_LOSS, "seed_grpo.alpha": 1.0},
    "token_maxent": {"method": "maxent_entropy", **DR_GRPO_LOSS, "loss.entropy_coef": 0.01},
}
# A screen for MaxEnt listwise's best configuration at this budget (not in the default study):
# python -m benchmarks.modebench run --arms listwise_ce,... --seeds 0 --results benchmarks/results/modebench_listwise
LISTWISE = {"method": "maxent_listwise", **DR_GRPO_LOSS}
LISTWISE_SCREEN: dict[str, dict] = {
    "listwise_ce": {**LISTWISE, "maxent.tau": 0.5, "maxent.listwise_loss": "cross_entropy"},
    **{f"listwise_tau{t}": {**LISTWISE, "maxent.tau": t, "maxent.listwise_loss": "weighted_mle"} for t in (0.1, 0.25)},
    # The tau controller steering the weight entropy toward 1.0 nats (uniform over 8 is 2.08).
    "listwise_controller": {**LISTWISE, "maxent.tau": 0.5, "maxent.listwise_loss": "weighted_mle",
                            "maxent.tau_target_entropy": 1.0, "maxent.tau_lr": 0.5},
}
ALL_ARMS = {**ARMS, **LISTWISE_SCREEN}
TRAIN_SEEDS = (0, 1, 2)
EVAL_SEEDS = (0, 1)
EVAL_PROBLEMS_PER_TASK = 4  # pair_sum has only 4 eval problems (n = 6, 9, 12, 15)


def _cli() -> str:
    beside = Path(sys.executable).parent / "maxent-grpo"
    found = str(beside) if beside.is_file() else shutil.which("maxent-grpo")
    if found is None:
        raise FileNotFoundError("the maxent-grpo command is not installed (bash scripts/setup.sh study)")
    return found


def _sets(overrides: dict) -> list[str]:
    return [a for key, value in overrides.items() for a in ("--set", f"{key}={json.dumps(value)}")]


def _run(cmd: list[str], log: Path, env: dict) -> None:
    with log.open("a") as out:
        out.write("$ " + " ".join(cmd) + "\n")
        out.flush()
        done = subprocess.run(cmd, stdout=out, stderr=subprocess.STDOUT, env=env, cwd=REPO, check=False)
    if done.returncode != 0:
        raise RuntimeError(f"{cmd[1]} failed ({done.returncode}); see {log}")


def _slim(src: Path, dest: Path) -> None:
    """Copy an eval folder, dropping each record's prompt text (prompt_index and task identify it)."""
    dest.mkdir(parents=True, exist_ok=True)
    shutil.copy(src / "summary.json", dest / "summary.json")
    result_files.copy(src / "per_prompt.jsonl", dest / "per_prompt.jsonl")
    lines = []
    for record in result_files.read_jsonl(src / "completions.jsonl"):
        record.pop("prompt")
        lines.append(json.dumps(record))
    result_files.write_text(dest / "completions.jsonl", "\n".join(lines) + "\n")


@dataclass(frozen=True)
class Trained:
    """One arm and seed, trained: where its results go, its scratch folder and log, its final model."""

    out: Path
    run_dir: Path
    log: Path
    final: Path | str  # the final checkpoint, or the start model's name
    steps: int
    train_s: float  # this call's training time (from ``resumed_from`` on)
    resumed_from: int  # the checkpoint step a cut-off run resumed from; 0 when trained from the start


# A run saves a checkpoint every SAVE_EVERY steps (the last one only is kept), so that a run cut off part-way
# resumes from it; resuming restores the weights, optimizer and samplers' state (README: resume).
SAVE_EVERY = 10


def train_arm(arm: str, arm_sets: dict, seed: int, *, results: Path, work: Path, base: list[str], env) -> Trained | None:
    """Train ``arm`` (its ``--set`` overrides ``arm_sets``) with ``seed``, the run's metrics and config kept in
    ``results/ARM/seedN``; None when that folder holds a ``done.json`` (a finished run is skipped). A run cut
    off part-way resumes from its latest checkpoint in ``work``, or starts over when it has none. The
    :data:`START` arm is not trained: its final model is the base recipe's."""
    out = results / arm / f"seed{seed}"
    if (out / "done.json").is_file():
        return None
    out.mkdir(parents=True, exist_ok=True)  # a cut-off run's log.txt is kept and appended to
    run_dir = work / arm / f"seed{seed}"
    ckpts = run_dir / "checkpoints"
    saved = sorted(int(p.name.split("-")[1]) for p in ckpts.glob("step-*")) if arm != START else []
    if not saved:
        shutil.rmtree(run_dir, ignore_errors=True)
    log = out / "log.txt"
    overrides = {**arm_sets, "training.seed": seed, "logging.report_to": [], "logging.progress_bar": False,
                 "checkpoint.save_steps": SAVE_EVERY, "checkpoint.save_minutes": 0, "checkpoint.keep_last": 1,
                 "eval.every_steps": 0}
    t0 = time.time()
    if arm == START:  # the start model, untrained: evaluated like every arm
        final, steps = _start_model(base), 0
    else:
        resume = ["--resume"] if saved else []
        _run([_cli(), "train", *base, "--output-dir", str(run_dir), *_sets(overrides), *resume], log, env)
        steps = max(int(p.name.split("-")[1]) for p in ckpts.glob("step-*"))
        final = ckpts / f"step-{steps}"
        shutil.copy(run_dir / "config.yaml", out / "config.yaml")
        result_files.copy(run_dir / "metrics.jsonl", out / "train_metrics.jsonl")
    return Trained(out=out, run_dir=run_dir, log=log, final=final, steps=steps, train_s=time.time() - t0,
                   resumed_from=saved[-1] if saved else 0)


def run_one(arm: str, seed: int, *, results: Path, work: Path, base: list[str], eval_seeds, env,
            eval_problems: int = EVAL_PROBLEMS_PER_TASK) -> Path:
    """Train ``arm`` with ``seed``, evaluate its final model once per eval seed; skip when done."""
    trained = train_arm(arm, ALL_ARMS[arm], seed, results=results, work=work, base=base, env=env)
    if trained is None:
        return results / arm / f"seed{seed}"
    out, run_dir, log, final, steps, train_s = (trained.out, trained.run_dir, trained.log, trained.final,
                                                trained.steps, trained.train_s)
    t1 = time.time()
    eval_dirs = [run_dir / f"eval-seed{e}" for e in eval_seeds]
    for partial in eval_dirs:  # left by a run cut off while evaluating
        shutil.rmtree(partial, ignore_errors=True)
    # Both eval seeds in one child process (one torch start-up); each is exactly `maxent-grpo eval`.
    _run([sys.executable, "-m", "benchmarks.modebench", "eval-child", str(final), "--eval-problems", str(eval_problems),
          "--seeds", ",".join(map(str, eval_seeds)), "--out", str(run_dir), "--base", json.dumps(base)], log, env)
    for e, eval_dir in zip(eval_seeds, eval_dirs):
        _slim(eval_dir, out / f"eval-seed{e}")
    evals = {"eval_s": time.time() - t1, "eval_seeds": list(eval_seeds)}
    (out / "done.json").write_text(json.dumps({"arm": arm, "seed": seed, "steps": steps, "train_s": train_s,
                                               "resumed_from": trained.resumed_from, **evals}, indent=1) + "\n")
    shutil.rmtree(run_dir, ignore_errors=True)
    return out


def _start_model(base: list[str]) -> str:
    """The base recipe's model (after any ``--set model.name_or_path=...``)."""
    name = yaml.safe_load(Path(base[1]).read_text())["model"]["name_or_path"]
    for i, item in enumerate(base):
        if item == "--set" and base[i + 1].startswith("model.name_or_path="):
            name = base[i + 1].split("=", 1)[1]
    return name


def _env(threads: int | None) -> dict:
    env = dict(os.environ)
    if threads:
        env.update(OMP_NUM_THREADS=str(threads), MKL_NUM_THREADS=str(threads))
    return env


def cmd_run(args) -> int:
    arms = args.arms.split(",") if args.arms else list(ARMS)
    unknown = [a for a in arms if a not in ALL_ARMS]
    if unknown:
        raise ValueError(f"--arms: unknown {unknown}; choose from {list(ALL_ARMS)}")
    seeds = [int(s) for s in args.seeds.split(",")]
    base = ["--config", str(args.config), *[a for kv in args.set for a in ("--set", kv)]]
    work = args.work_dir or Path(tempfile.mkdtemp(prefix="modebench-"))
    shard, shards = (int(x) for x in args.shard.split("/"))
    # Seed-major order: every arm gets seed 0 before any gets seed 1, so a cut-off study is balanced.
    # The start model is evaluated once (its "seed" is only the eval's label).
    jobs = [(arm, seed) for seed in seeds for arm in arms if arm != START or seed == seeds[0]]
    for arm, seed in jobs[shard::shards]:
            t0 = time.time()
            print(f"[modebench] {arm} seed {seed} ...", file=sys.stderr, flush=True)
            run_one(arm, seed, results=args.results, work=work, base=base,
                    eval_seeds=[int(e) for e in args.eval_seeds.split(",")], env=_env(args.threads),
                    eval_problems=args.eval_problems)
            print(f"[modebench] {arm} seed {seed} done in {time.time() - t0:.0f} s", file=sys.stderr, flush=True)
    return 0


def cmd_eval_child(args) -> int:
    """``maxent-grpo eval`` of one model once per eval seed, in this process."""
    import torch

    from maxent_grpo.cli import main as cli_main

    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", torch.get_num_threads())))
    for e in args.seeds.split(","):
        eval_sets = {"data.task_kwargs": {"split": "eval"}, "data.size": args.eval_problems, "training.seed": int(e)}
        code = cli_main(["eval", args.model, *args.base, *_sets(eval_sets), "--output", str(args.out / f"eval-seed{e}"),
                         "--num-prompts", str(3 * args.eval_problems)])
        if code != 0:
            return code
    return 0


def cmd_analyze(args) -> int:
    from benchmarks.modebench_stats import analyze

    print(analyze(args.results, args.plots or args.results, baseline="dr_grpo", arms=ALL_ARMS))
    return 0


def smoke_model(work: Path) -> Path:
    """The tiny random model the smoke runs train, built once under ``work``."""
    from benchmarks.tiny_model import build_tiny_model

    model_dir = work / "tiny-model"
    if not (model_dir / "config.json").is_file():
        build_tiny_model(model_dir)
    return model_dir


def cmd_smoke(args) -> int:
    """Two arms, two steps, the tiny random model: the whole pipeline, run and analyze, in a minute."""
    work = args.work_dir
    model_dir = smoke_model(work)
    sets = [f"model.name_or_path={model_dir}", "training.max_steps=2", "training.prompts_per_step=3",
            "generation.num_generations=4", "generation.max_new_tokens=8", "training.micro_batch_size=4"]
    ns = argparse.Namespace(
        arms="dr_grpo,xdr_tau0.05", seeds="0", eval_seeds="0,1", config=RECIPE,
        set=[*sets, "eval.k=4"], results=work / "results", work_dir=work / "runs", threads=args.threads,
        shard="0/1", eval_problems=2,
    )
    cmd_run(ns)
    print(analyze_smoke(ns.results))
    return 0


def analyze_smoke(results: Path) -> str:
    from benchmarks.modebench_stats import analyze

    return analyze(results, results, baseline="dr_grpo", arms=ARMS)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    sub = p.add_subparsers(dest="command", required=True)
    run = sub.add_parser("run", help="train and evaluate every (arm, seed) not in the results yet")
    run.add_argument("--arms", help=f"comma-separated, of {list(ALL_ARMS)} (default: the study's {list(ARMS)})")
    run.add_argument("--seeds", default=",".join(map(str, TRAIN_SEEDS)), help="training seeds")
    run.add_argument("--eval-seeds", default=",".join(map(str, EVAL_SEEDS)), help="evaluation seeds")
    run.add_argument("--eval-problems", type=int, default=EVAL_PROBLEMS_PER_TASK, help="eval problems per task")
    run.add_argument("--config", type=Path, default=RECIPE, help="the base recipe every arm overrides")
    run.add_argument("--set", action="append", default=[], help="KEY=VALUE override for every arm")
    run.add_argument("--results", type=Path, default=RESULTS, help="raw results folder (resumes from it)")
    run.add_argument("--work-dir", type=Path, help="scratch folder for checkpoints (deleted per run)")
    run.add_argument("--threads", type=int, default=1,
                     help="torch threads per child process (1: on shared, niced cores more threads spin and wait)")
    run.add_argument("--shard", default="0/1", help="I/N: run every N-th job starting at I (parallel workers)")
    ana = sub.add_parser("analyze", help="table and plots from the raw results")
    ana.add_argument("--results", type=Path, default=RESULTS)
    ana.add_argument("--plots", type=Path, help="folder for the plots (default: the results folder)")
    smoke = sub.add_parser("smoke", help="tiny model, two arms, two steps")
    smoke.add_argument("--work-dir", type=Path, required=True)
    smoke.add_argument("--threads", type=int, default=1)
    child = sub.add_parser("eval-child", help="(internal) evaluate one model for several eval seeds")
    child.add_argument("model")
    child.add_argument("--eval-problems", type=int, required=True)
    child.add_argument("--seeds", required=True)
    child.add_argument("--out", type=Path, required=True)
    child.add_argument("--base", type=json.loads, required=True, help="the recipe arguments, a JSON list")
    args = p.parse_args(argv)
    commands = {"run": cmd_run, "analyze": cmd_analyze, "smoke": cmd_smoke, "eval-child": cmd_eval_child}
    return commands[args.command](args)


if __name__ == "__main__":
    sys.exit(main())
