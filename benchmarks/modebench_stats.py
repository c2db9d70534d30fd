"""ModeBench analysis: effects vs the baseline from a linear probability model, and the plots.

For each metric (pass@8, mean@8, coverage@8, and greedy pass@1), one OLS fit over every
(arm, train seed, eval seed, prompt) observation:

    metric ~ C(arm, baseline) + C(task) + C(train_seed) + C(eval_seed)

with standard errors clustered by prompt (statsmodels' ``cov_type="cluster"``, t reference
with clusters - 1 degrees of freedom). An
arm's effect is its arm coefficient; 95% intervals; p-values Holm-corrected across
the arms within each metric. "mean@8 flat" is a TOST equivalence test at +-3 points:
both one-sided p-values below 0.05 (the 90% interval inside +-0.03).
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pandas as pd

from benchmarks import result_files

EQUIVALENCE_MARGIN = 0.03
START = "start_model"  # the untrained model: a reference row, not an arm of the comparison
METRICS = ("pass@8", "mean@8", "coverage@8", "greedy_pass@1")


def load_observations(results: Path) -> pd.DataFrame:
    """One row per (arm, train seed, eval seed, prompt) from every finished run under ``results``."""
    rows = []
    for done in sorted(results.glob("*/seed*/done.json")):
        info = json.loads(done.read_text())
        for eval_dir in sorted(done.parent.glob("eval-seed*")):
            eval_seed = int(eval_dir.name.removeprefix("eval-seed"))
            for p in result_files.read_jsonl(eval_dir / "per_prompt.jsonl"):
                k = max(int(name.split("@")[1]) for name in p if name.startswith("pass@"))
                rows.append({
                    "arm": info["arm"], "train_seed": info["seed"], "eval_seed": eval_seed,
                    "task": p["task"], "prompt": f"{p['task']}/{p['prompt_index']}",
                    "pass@8": p[f"pass@{k}"], "mean@8": p[f"mean@{k}"], "coverage@8": p[f"coverage@{k}"],
                    "distinct@8": p[f"distinct@{k}"], "greedy_pass@1": p["greedy_pass@1"],
                })
    if not rows:
        raise FileNotFoundError(f"no finished runs (done.json) under {results}")
    return pd.DataFrame(rows)


def holm(pvalues: list[float]) -> list[float]:
    """Holm-Bonferroni adjusted p-values (statsmodels' multipletests)."""
    from statsmodels.stats.multitest import multipletests

    return list(multipletests(pvalues, method="holm")[1]) if pvalues else []


def arm_effects(df: pd.DataFrame, metric: str, baseline: str) -> pd.DataFrame:
    """Each arm's effect on ``metric`` vs ``baseline``: estimate, se, 95% CI, p, Holm p, TOST p."""
    import statsmodels.formula.api as smf
    from scipy import stats

    data = df.rename(columns={metric: "y"})
    terms = [f"C(arm, Treatment({baseline!r}))"]
    terms += [f"C({fe})" for fe in ("task", "train_seed", "eval_seed") if data[fe].nunique() > 1]
    groups = pd.factorize(data["prompt"])[0]
    # Few clusters (tens of prompts): t reference with (clusters - 1) degrees of freedom, as statsmodels does with use_t.
    fit = smf.ols("y ~ " + " + ".join(terms), data=data).fit(cov_type="cluster", cov_kwds={"groups": groups}, use_t=True)
    t_ref = stats.t(df=int(groups.max()))
    out = []
    prefix = f"C(arm, Treatment({baseline!r}))[T."
    for name in fit.params.index:
        if not name.startswith(prefix):
            continue
        # An arm equal to the baseline everywhere has a covariance of rounding size, possibly negative: its
        # sqrt is NaN (numpy would warn), and the branch below gives it a zero-width interval.
        with np.errstate(invalid="ignore"):
            est, se = float(fit.params[name]), float(fit.bse[name])
            lo, hi = (float(v) for v in fit.conf_int(0.05).loc[name])
            p_value = float(fit.pvalues[name])
        if not np.isfinite(se) or se < 1e-12:  # the arm equals the baseline on every observation: no spread
            se, lo, hi, p_value = 0.0, est, est, 1.0
        # TOST: H0 |effect| >= margin, rejected when both one-sided tests reject (same t reference as the fit's).
        p_tost = max(t_ref.sf((est + EQUIVALENCE_MARGIN) / se), t_ref.cdf((est - EQUIVALENCE_MARGIN) / se)) \
            if se > 0 else float(abs(est) >= EQUIVALENCE_MARGIN)
        out.append({"arm": name[len(prefix):-1], "effect": est, "se": se, "lo": lo, "hi": hi,
                    "p": p_value, "p_tost": float(p_tost)})
    table = pd.DataFrame(out)
    table["p_holm"] = holm(list(table["p"]))
    return table


def _fmt(row) -> str:
    return f"{100 * row.effect:+.1f} [{100 * row.lo:+.1f}, {100 * row.hi:+.1f}] (p_holm {row.p_holm:.2f})"


def effects_table(df: pd.DataFrame, baseline: str, arms: dict) -> tuple[str, dict[str, pd.DataFrame]]:
    """The markdown table of effects (points) and the per-metric effect frames."""
    # The untrained start model is shown for reference, outside the model and the Holm family.
    trained = df[df["arm"] != START]
    effects = {m: arm_effects(trained, m, baseline) for m in METRICS}
    means = df.groupby("arm")[list(METRICS) + ["distinct@8"]].mean()
    runs = df.groupby("arm")["train_seed"].nunique()
    lines = [
        f"| arm | runs | pass@8 | mean@8 | coverage@8 | distinct@8 | Δpass@8 [95% CI] | Δmean@8 [95% CI] "
        f"| mean@8 flat (TOST ±{100 * EQUIVALENCE_MARGIN:.0f}) | Δcoverage@8 [95% CI] | Δgreedy pass@1 [95% CI] |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for arm in [a for a in arms if a in means.index]:
        m = means.loc[arm]
        cells = [arm, str(runs[arm]), *(f"{m[c]:.3f}" for c in ("pass@8", "mean@8", "coverage@8", "distinct@8"))]
        if arm in (baseline, START):
            cells += ["(baseline)" if arm == baseline else "(not trained)"] * 5
        else:
            get = {metric: effects[metric].set_index("arm").loc[arm] for metric in METRICS}
            tost = get["mean@8"].p_tost
            cells += [_fmt(get["pass@8"]), _fmt(get["mean@8"]),
                      f"{'yes' if tost < 0.05 else 'no'} (p {tost:.2f})", _fmt(get["coverage@8"]),
                      _fmt(get["greedy_pass@1"])]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines), effects


def plot_dose_response(effects: dict[str, pd.DataFrame], path: Path) -> None:
    """Effect vs xDr tau (symlog axis) for pass@8, coverage@8 and mean@8, with 95% intervals."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 4))
    for metric, marker in (("pass@8", "o"), ("coverage@8", "s"), ("mean@8", "^")):
        e = effects[metric]
        e = e[e["arm"].str.startswith("xdr_tau")].copy()
        if e.empty:
            continue
        e["tau"] = e["arm"].str.removeprefix("xdr_tau").astype(float)
        e = e.sort_values("tau")
        ax.errorbar(e["tau"], 100 * e["effect"], yerr=[100 * (e["effect"] - e["lo"]), 100 * (e["hi"] - e["effect"])],
                    marker=marker, capsize=3, label=metric)
    ax.axhline(0, color="grey", lw=0.8)
    ax.set_xscale("symlog", linthresh=0.01)
    ax.set_xlim(left=-0.002)
    ax.set_xlabel("xDr tau")
    ax.set_ylabel("effect vs Dr.GRPO (points, 95% CI)")
    ax.set_title("ModeBench: xDr dose-response")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def plot_per_task(df: pd.DataFrame, arms: list[str], path: Path) -> None:
    """Per-task bars of mean pass@8 and coverage@8 for every arm.

    Error bars: +-1.96 standard errors over the (train seed, eval seed) runs, drawn from 3 runs up.
    """
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    tasks = sorted(df["task"].unique())
    fig, axes = plt.subplots(1, 2, figsize=(12, 4), sharey=True)
    width = 0.8 / max(len(arms), 1)
    for ax, metric in zip(axes, ("pass@8", "coverage@8")):
        per_run = df.groupby(["arm", "task", "train_seed", "eval_seed"])[metric].mean().reset_index()
        for i, arm in enumerate(arms):
            vals = [per_run[(per_run.arm == arm) & (per_run.task == t)][metric] for t in tasks]
            heights = [float(v.mean()) if len(v) else np.nan for v in vals]
            errs = [1.96 * float(v.std(ddof=1)) / np.sqrt(len(v)) if len(v) > 2 else 0.0 for v in vals]
            ax.bar(np.arange(len(tasks)) + i * width, heights, width, yerr=errs, capsize=2, label=arm)
        ax.set_xticks(np.arange(len(tasks)) + 0.4 - width / 2, tasks)
        ax.set_title(metric)
    axes[0].set_ylabel("mean over prompts, seeds")
    axes[1].legend(fontsize=7, ncol=2)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def arm_configs(results: Path, arms: dict) -> str:
    """Each arm's method keys, read back from a finished run's full config.yaml (the whole file sits beside it)."""
    import yaml

    lines = ["| arm | overrides of recipes/modebench.yaml | method, loss_type, scale_rewards |", "|---|---|---|"]
    for arm, overrides in arms.items():
        configs = sorted(d.parent / "config.yaml" for d in results.glob(f"{arm}/seed*/done.json"))
        configs = [c for c in configs if c.is_file()]  # the start model has none
        if not configs:
            continue
        cfg = yaml.safe_load(configs[0].read_text())
        keys = ", ".join(f"{k}={v}" for k, v in overrides.items())
        lines.append(f"| {arm} | {keys} | {cfg['method']}, {cfg['loss']['loss_type']}, {cfg['loss']['scale_rewards']} |")
    return "\n".join(lines)


def training_table(results: Path, arms: dict) -> str:
    """Per arm, means over its finished runs: training accuracy at the first and last step, the share of
    groups with no reward spread, and token entropy at the first and last step (``train_metrics.jsonl``)."""
    lines = ["| arm | runs | accuracy step 1 | accuracy last step | groups with zero reward std | entropy step 1 "
             "| entropy last step |", "|---|---|---|---|---|---|---|"]
    for arm in arms:
        runs = []
        for done in sorted(results.glob(f"{arm}/seed*/done.json")):
            path = done.parent / "train_metrics.jsonl"
            if result_files.exists(path):
                runs.append(result_files.read_jsonl(path))
        if not runs:
            continue

        def mean(values) -> float:
            return float(np.mean(values))

        lines.append(
            f"| {arm} | {len(runs)} | {mean([r[0]['rewards/modebench/mean'] for r in runs]):.3f} "
            f"| {mean([r[-1]['rewards/modebench/mean'] for r in runs]):.3f} "
            f"| {mean([m['frac_reward_zero_std'] for r in runs for m in r]):.2f} "
            f"| {mean([r[0]['entropy'] for r in runs]):.3f} | {mean([r[-1]['entropy'] for r in runs]):.3f} |"
        )
    return "\n".join(lines)


def analyze(results: Path, plots: Path, *, baseline: str, arms: dict) -> str:
    """The study's report: setup line, effects table, arm configs; writes the two plots under ``plots``."""
    df = load_observations(results)
    if df[df["arm"] != START]["arm"].nunique() < 2:
        return f"ModeBench: fewer than two trained arms finished under {results}; nothing to compare yet."
    table, effects = effects_table(df, baseline, arms)
    plots.mkdir(parents=True, exist_ok=True)
    plot_dose_response(effects, plots / "dose_response.png")
    plot_per_task(df, [a for a in arms if a in set(df["arm"])], plots / "per_task.png")
    head = (f"ModeBench: {df['arm'].nunique()} arms (the start model included), train seeds {sorted(int(s) for s in df['train_seed'].unique())}, "
            f"eval seeds {sorted(int(s) for s in df['eval_seed'].unique())}, {df['prompt'].nunique()} eval prompts "
            f"({', '.join(f'{t} {n}' for t, n in df.groupby('task')['prompt'].nunique().items())}), "
            f"{len(df)} observations. Effects in points vs {baseline}: OLS with task, train-seed, eval-seed "
            "fixed effects, prompt-clustered SEs; Holm across arms per metric.")
    return "\n\n".join([head, table, training_table(results, arms), arm_configs(results, arms),
                        f"plots: {plots / 'dose_response.png'}, {plots / 'per_task.png'}"])
