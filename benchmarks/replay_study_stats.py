"""The verified-replay study's analysis (issue 35, BENCHMARKS.md §12): ModeBench's metrics per prompt,
arm means and effects with 95% intervals, training and the replay's cost.

Per (arm, train seed, eval prompt), from the run's ``eval/completions.jsonl`` (ALGORITHMS.md §18):
pass@8 = the mean over the prompt's draws (groups of k) of 1[a verified answer in the group];
distinct@8 = the mean over draws of the number of distinct verified mode keys; accuracy = the
verified share of all samples; PCMD pooled over the draws (``core/mode_metrics.prompt_pcmd``: None
below two verified answers); greedy pass@1. A run with an unscorable completion has no metrics
(§18's failure policy) and is listed.

Intervals, prompt-clustered: an arm's mean is the mean over prompts of the prompt's mean over
runs, with a t interval over prompts (clusters - 1 df); an effect against the baseline is the OLS of
``benchmarks/modebench_stats.arm_effects`` on that arm's and the baseline's observations (arm +
train-seed fixed effects, clustered by prompt), Holm across arms per metric. PCMD enters only where
defined, so its effects compare the prompts and runs where each arm had two verified answers.
"""

from __future__ import annotations

import json
import statistics
from pathlib import Path

import numpy as np
import pandas as pd

from benchmarks import result_files
from benchmarks.modebench_stats import arm_effects, holm
from maxent_grpo.core.mode_metrics import prompt_pcmd

METRICS = ("pass@8", "distinct@8", "pcmd", "accuracy", "greedy_pass@1")
START = "start_model"


def prompt_metrics(records: list[dict]) -> list[dict]:
    """One dict per evaluated prompt of one run (prompt_index order) from its completion records."""
    sampled: dict[int, dict[int, list]] = {}
    greedy: dict[int, bool] = {}
    task: dict[int, str] = {}
    for r in records:
        verified = bool(r["correct"]) and r["mode_key"] is not None
        task[r["prompt_index"]] = r["task"]
        if r["mode"] == "greedy":
            greedy[r["prompt_index"]] = verified
        else:
            sampled.setdefault(r["prompt_index"], {}).setdefault(r["draw"], []).append((verified, r["mode_key"], False))
    out = []
    for index in sorted(sampled):
        groups = [g for _, g in sorted(sampled[index].items())]
        out.append({
            "prompt": f"{task[index]}/{index}", "task": task[index],
            "pass@8": statistics.fmean(float(any(v for v, _, _ in g)) for g in groups),
            "distinct@8": statistics.fmean(float(len({key for v, key, _ in g if v})) for g in groups),
            "accuracy": statistics.fmean(float(v) for g in groups for v, _, _ in g),
            "pcmd": prompt_pcmd(groups),
            "greedy_pass@1": float(greedy[index]) if index in greedy else np.nan,
        })
    return out


def load(results: Path) -> tuple[pd.DataFrame, list[str]]:
    """Observations (arm, train_seed, eval_seed, task, prompt, metrics...) of every finished run, and the
    runs left out because the verifier could not score some completion."""
    rows, failed = [], []
    for done in sorted(results.glob("*/seed*/done.json")):
        info = json.loads(done.read_text())
        records = result_files.read_jsonl(done.parent / "eval" / "completions.jsonl")
        if any(r["unscorable"] for r in records):
            failed.append(f"{info['arm']}/seed{info['seed']}")
            continue
        # The evaluation's own verdict on the run's PCMD: ModeBench's rule (eval.min_defined_prompts prompts
        # with two verified answers, 30 by default).
        reportable = bool(json.loads((done.parent / "eval" / "summary.json").read_text())["mb/pcmd_reportable"])
        for p in prompt_metrics(records):
            rows.append({"arm": info["arm"], "train_seed": info["seed"], "eval_seed": info["eval_seed"],
                         "pcmd_reportable": reportable, **p})
    if not rows:
        raise FileNotFoundError(f"no finished runs (done.json) under {results}")
    return pd.DataFrame(rows), failed


def arm_mean(df: pd.DataFrame, metric: str) -> tuple[float, float, float, int]:
    """Mean over prompts of each prompt's mean over runs (defined values only), a 95% t interval over
    prompts, and the number of prompts."""
    from scipy import stats

    per_prompt = df.dropna(subset=[metric]).groupby("prompt")[metric].mean()
    n = len(per_prompt)
    if n == 0:
        return np.nan, np.nan, np.nan, 0
    mean = float(per_prompt.mean())
    if n < 2:
        return mean, np.nan, np.nan, n
    half = float(stats.t(df=n - 1).ppf(0.975) * per_prompt.std(ddof=1) / np.sqrt(n))
    return mean, mean - half, mean + half, n


def _effect(effects: pd.DataFrame, arm: str, scale: float, p_name: str = "p_holm") -> str:
    if arm not in set(effects["arm"]):
        return "n/a"
    e = effects.set_index("arm").loc[arm]
    digits = 1 if scale == 100 else 2  # points, or the metric's own unit

    def num(x: float) -> str:  # rounding first, then + 0.0, so that a rounding -0.0 prints as +0.0
        return f"{round(scale * x, digits) + 0.0:+.{digits}f}"

    return f"{num(e.effect)} [{num(e.lo)}, {num(e.hi)}] ({p_name} {e[p_name]:.2f})"


def effects(df: pd.DataFrame, metric: str, baseline: str) -> pd.DataFrame:
    """Each arm against ``baseline`` on the defined observations of ``metric``: one ``arm_effects`` fit per
    arm on that arm's and the baseline's observations alone, then Holm across arms; empty with fewer than
    two arms there.

    One fit per pair, not one over every arm: the seed fixed effects of a joint fit are shared by all
    arms, so where the observations are unbalanced (PCMD is defined on different prompts and runs per
    arm; an arm may lack a seed) a third arm's values would move this arm's effect."""
    data = df[df["arm"] != START].dropna(subset=[metric])
    arms = [a for a in data["arm"].unique() if a != baseline]
    if not arms or baseline not in set(data["arm"]):
        return pd.DataFrame(columns=["arm", "effect", "lo", "hi", "p", "p_holm"])
    table = pd.concat([arm_effects(data[data["arm"].isin([arm, baseline])], metric, baseline) for arm in arms],
                      ignore_index=True)
    table["p_holm"] = holm(list(table["p"]))
    return table


def results_table(df: pd.DataFrame, arms: list[str], baseline: str) -> str:
    """Per arm: runs, then pass@8, distinct@8, PCMD (with its defined observations and the runs whose
    evaluation found it reportable), accuracy and greedy pass@1 as mean [95% CI]; then the effects of
    pass@8, distinct@8 and PCMD against ``baseline``."""
    fx = {m: effects(df, m, baseline) for m in ("pass@8", "distinct@8", "pcmd")}
    lines = ["| arm | runs | pass@8 | distinct@8 | PCMD (defined obs.) | accuracy | greedy pass@1 "
             "| Δpass@8 (points) | Δdistinct@8 | ΔPCMD |", "|---|---|---|---|---|---|---|---|---|---|"]
    for arm in [a for a in arms if a in set(df["arm"])]:
        mine = df[df["arm"] == arm]
        cells = [arm, str(mine["train_seed"].nunique())]
        for metric in ("pass@8", "distinct@8", "pcmd", "accuracy", "greedy_pass@1"):
            mean, lo, hi, _ = arm_mean(mine, metric)
            text = "n/a" if np.isnan(mean) else f"{mean:.3f} [{lo:.3f}, {hi:.3f}]"
            if metric == "pcmd":
                runs = mine.groupby("train_seed")["pcmd_reportable"].first()
                text += (f" ({int(mine['pcmd'].notna().sum())}/{len(mine)}; "
                         f"reportable in {int(runs.sum())}/{len(runs)} runs)")
            cells.append(text)
        if arm in (baseline, START):
            cells += ["(baseline)" if arm == baseline else "(not trained)"] * 3
        else:
            cells += [_effect(fx["pass@8"], arm, 100), _effect(fx["distinct@8"], arm, 1), _effect(fx["pcmd"], arm, 1)]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def contrasts(df: pd.DataFrame, pairs: list[tuple[str, str]]) -> str:
    """The replay's own effect: each (treatment, reference) pair alone, same model as the main table;
    one comparison per fit, so its p is unadjusted."""
    lines = ["| contrast | Δpass@8 (points) | Δdistinct@8 | ΔPCMD |", "|---|---|---|---|"]
    for arm, ref in pairs:
        pair = df[df["arm"].isin([arm, ref])]
        if pair["arm"].nunique() < 2:
            continue
        cells = [f"{arm} - {ref}"]
        for metric, scale in (("pass@8", 100), ("distinct@8", 1), ("pcmd", 1)):
            cells.append(_effect(effects(pair, metric, ref), arm, scale, p_name="p"))
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def per_seed(df: pd.DataFrame, arms: list[str], baseline: str) -> str:
    """Each training seed alone: every arm's pass@8 / distinct@8 (means over prompts); then each arm's
    pass@8 difference from ``baseline`` per seed (the seeds both ran) and their mean with a t interval over
    seeds (S - 1 df): the effect if the training seeds are a random draw, not the ones fixed here."""
    from scipy import stats

    trained = [a for a in arms if a in set(df["arm"]) and a != START]
    means = df[df["arm"].isin(trained)].groupby(["arm", "train_seed"])[["pass@8", "distinct@8"]].mean()
    seeds = sorted(int(s) for s in df.loc[df["arm"].isin(trained), "train_seed"].unique())
    lines = ["| seed | " + " | ".join(trained) + " |", "|---" * (len(trained) + 1) + "|"]
    for seed in seeds:
        cells = [f"{means.loc[(a, seed), 'pass@8']:.3f} / {means.loc[(a, seed), 'distinct@8']:.3f}"
                 if (a, seed) in means.index else "-" for a in trained]
        lines.append(f"| {seed} | " + " | ".join(cells) + " |")
    lines += ["", "| arm | Δpass@8 per seed (points) | mean over seeds [95% CI, seeds random] |", "|---|---|---|"]
    for arm in [a for a in trained if a != baseline]:
        both = [s for s in seeds if (arm, s) in means.index and (baseline, s) in means.index]
        diffs = [100 * (means.loc[(arm, s), "pass@8"] - means.loc[(baseline, s), "pass@8"]) for s in both]
        if not diffs:
            continue
        mean = float(np.mean(diffs))
        interval = "n/a (one seed)"
        if len(diffs) > 1:
            half = float(stats.t(df=len(diffs) - 1).ppf(0.975) * np.std(diffs, ddof=1) / np.sqrt(len(diffs)))
            interval = f"[{mean - half:+.1f}, {mean + half:+.1f}]"
        lines.append(f"| {arm} | {', '.join(f'{s}: {d:+.1f}' for s, d in zip(both, diffs))} | {mean:+.1f} {interval} |")
    return "\n".join(lines)


def _train_runs(results: Path, arm: str) -> list[list[dict]]:
    runs = []
    for done in sorted(results.glob(f"{arm}/seed*/done.json")):
        path = done.parent / "train_metrics.jsonl"
        if result_files.exists(path):
            runs.append(result_files.read_jsonl(path))
    return runs


def training_table(results: Path, arms: list[str]) -> str:
    """Per arm, means over runs: training accuracy (the reward's mean over the step's completions) at
    the first and last step, groups with zero reward spread, seconds per step; the bank at the end."""
    lines = ["| arm | runs | accuracy step 1 | accuracy last step | groups with zero reward std | s/step "
             "| banked prompts (end) | banked modes (end) |", "|---|---|---|---|---|---|---|---|"]
    for arm in arms:
        runs = _train_runs(results, arm)
        if not runs:
            continue
        bank = [r[-1].get("bank/prompts") for r in runs]
        modes = [r[-1].get("bank/modes") for r in runs]
        lines.append(
            f"| {arm} | {len(runs)} | {np.mean([r[0]['rewards/modebench_pkg/mean'] for r in runs]):.3f} "
            f"| {np.mean([r[-1]['rewards/modebench_pkg/mean'] for r in runs]):.3f} "
            f"| {np.mean([m['frac_reward_zero_std'] for r in runs for m in r]):.2f} "
            f"| {np.median([m['time/total'] for r in runs for m in r]):.1f} "
            f"| {'-' if None in bank else f'{np.mean(bank):.1f}'} | {'-' if None in modes else f'{np.mean(modes):.1f}'} |")
    return "\n".join(lines)


def replay_cost(results: Path, arms: list[str]) -> str:
    """What replay costs per step (``replay/time_s``: its passes; ``time/replay_admission``: banking the
    step's groups; ``replay/time_share``: both over the step's wall time), over the steps that replayed
    (a bank with an exemplar) and over all steps."""
    lines = ["| arm | steps | steps that replayed | replay s/step (when replaying) | admission s/step "
             "| share of the step (when replaying) | share over all steps | replayed modes/step |",
             "|---|---|---|---|---|---|---|---|"]
    for arm in arms:
        steps = [m for r in _train_runs(results, arm) for m in r if "replay/time_s" in m]
        if not steps:
            continue
        active = [m for m in steps if "replay/groups" in m]

        def mean(values) -> str:
            return f"{np.mean(values):.3f}" if values else "-"

        lines.append(f"| {arm} | {len(steps)} | {len(active)} | {mean([m['replay/time_s'] for m in active])} "
                     f"| {mean([m['time/replay_admission'] for m in steps])} "
                     f"| {mean([m['replay/time_share'] for m in active])} | {mean([m['replay/time_share'] for m in steps])} "
                     f"| {mean([m['replay/modes'] for m in active])} |")
    return "\n".join(lines)


def analyze(results: Path, *, arms: list[str], baseline: str) -> str:
    """The study's report: the setup line, the results table, the replay contrasts, each seed alone,
    training, cost."""
    df, failed = load(results)
    head = (f"Verified replay on ModeBench: {df['arm'].nunique()} arms (the start model included), train seeds "
            f"{sorted(int(s) for s in df['train_seed'].unique())}, {df['prompt'].nunique()} eval prompts "
            f"({', '.join(f'{t} {n}' for t, n in df.groupby('task')['prompt'].nunique().items())}), {len(df)} "
            f"observations (arm, seed, prompt). Means [95% CI] over prompts; effects vs {baseline}: one OLS per "
            "arm on its and the baseline's observations, train-seed fixed effects, prompt-clustered SEs, Holm "
            "across arms per metric; PCMD where defined "
            "(two or more verified answers over the prompt's draws).")
    if failed:
        head += f" Left out (an unscorable completion): {', '.join(failed)}."
    parts = [head, results_table(df, arms, baseline),
             contrasts(df, [("redr", "redr_control"), ("remax", "maxrl")]), per_seed(df, arms, baseline),
             training_table(results, arms), replay_cost(results, arms)]
    return "\n\n".join(parts)
