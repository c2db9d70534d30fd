"""``maxent-grpo report RUN_DIR [RUN_DIR ...]``: plots and one HTML page for finished or live runs.

Reads what a run writes: ``metrics.jsonl`` (one JSON object per optimizer step),
``config.yaml``, ``run_info.json`` and ``completions/step-N.jsonl``. Several run dirs
overlay their curves, one colour per run. Plots whose metrics no run has are skipped.
"""

from __future__ import annotations

import importlib.util
import math
import re
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

# The run folder's contents live in report_data.py, shared with report_html.py (which this module calls).
from maxent_grpo.report_data import (
    ReportError,
    RunData,
    best_and_worst,
    load_run,
    rolling_mean,
    run_labels,
    series,
    smoothing_window,
)
from maxent_grpo.report_html import render_report
from maxent_grpo.run_files import parse_metrics_lines

__all__ = [
    "FigureSpec",
    "Panel",
    "PlotImage",
    "RunData",
    "best_and_worst",
    "draw_figure",
    "draw_step_time",
    "figure_specs",
    "load_run",
    "main_report",
    "parse_metrics_lines",
    "plot_figure",
    "plot_step_time",
    "rolling_mean",
    "run_labels",
    "series",
    "smoothing_window",
]

PHASES = ("time/generate", "time/reward", "time/reference", "time/teacher", "time/policy", "time/optimizer")
STEP_LABEL = "optimizer step"




# ----------------------------------------------------------------------------- what to plot


@dataclass(frozen=True)
class Panel:
    key: str
    title: str
    ylabel: str


@dataclass(frozen=True)
class FigureSpec:
    filename: str
    title: str
    panels: tuple[Panel, ...]
    # "smooth": thin per-step line plus a thick rolling mean (noisy metrics);
    # "line": the values as they are (schedules, controller states); "points": sparse (eval).
    style: str = "smooth"


def figure_specs(keys: set[str]) -> list[FigureSpec]:
    """The figures to draw for the metric ``keys`` present in any run (empty figures dropped)."""
    reward_names = sorted(k[len("rewards/") : -len("/mean")] for k in keys if re.fullmatch(r"rewards/.+/mean", k))
    completion_keys = sorted((k for k in keys if k.startswith("completions/")), key=_completion_order)
    eval_keys = sorted(k for k in keys if k.startswith("eval/"))
    specs = [
        FigureSpec(
            "reward.png",
            "Rewards (mean over the step's completions)",
            (
                Panel("reward", "Total reward", "reward"),
                Panel("reward_std", "Total reward: std over the step", "reward"),
            )
            + tuple(Panel(f"rewards/{n}/mean", f"Reward function: {n}", "reward") for n in reward_names),
        ),
        FigureSpec(
            "kl_entropy.png",
            "Policy drift and exploration",
            (
                Panel("kl", r"KL($\pi_\theta\;\|\;\pi_{\mathrm{ref}}$)", "nats per token"),
                Panel("entropy", "Policy token entropy", "nats per token"),
                Panel("weight_entropy", "Entropy of the MaxEnt weights w, group mean (ln G = uniform)", "nats"),
            ),
        ),
        FigureSpec(
            "controllers.png",
            "Controllers and schedules",
            (
                Panel("tau", "Temperature τ", "τ"),
                Panel("beta", "KL coefficient β", "β"),
                Panel("learning_rate", "Learning rate", "learning rate"),
            ),
            style="line",
        ),
        FigureSpec(
            "completions.png",
            "Completions",
            tuple(Panel(k, _completion_title(k), _completion_unit(k)) for k in completion_keys),
        ),
        FigureSpec(
            "clipping.png",
            "PPO ratio clipping (fraction of completion tokens)",
            (
                Panel("clip_ratio/low_mean", r"Clipped below (ratio < 1 − $\varepsilon_{\mathrm{low}}$)", "fraction of tokens"),
                Panel("clip_ratio/high_mean", r"Clipped above (ratio > 1 + $\varepsilon_{\mathrm{high}}$)", "fraction of tokens"),
                Panel("clip_ratio/region_mean", "Clipped, either side", "fraction of tokens"),
            ),
        ),
        FigureSpec(
            "optimization.png",
            "Optimization",
            (
                Panel("loss", "Loss", "loss"),
                Panel("grad_norm", "Gradient norm (before clipping)", "L2 norm"),
            ),
        ),
        FigureSpec(
            "eval.png",
            "Evaluation (held-out prompts)",
            tuple(Panel(k, k[len("eval/") :], _eval_unit(k)) for k in sorted(eval_keys, key=_eval_order)),
            style="points",
        ),
    ]
    kept = []
    for spec in specs:
        panels = tuple(p for p in spec.panels if p.key in keys)
        if panels:
            kept.append(FigureSpec(spec.filename, spec.title, panels, spec.style))
    return kept


_COMPLETION_TITLES = {
    "mean_length": "Completion length (mean)",
    "min_length": "Completion length (min)",
    "max_length": "Completion length (max)",
    "clipped_ratio": "Completions cut at the length limit",
    "mean_terminated_length": "Length of completions that ended",
}


def _completion_order(key: str) -> tuple:
    name = key[len("completions/") :]
    known = list(_COMPLETION_TITLES)
    return (known.index(name) if name in known else len(known), name)


def _completion_title(key: str) -> str:
    name = key[len("completions/") :]
    return _COMPLETION_TITLES.get(name, "Completions: " + name.replace("_", " "))


def _completion_unit(key: str) -> str:
    return "tokens" if "length" in key else "fraction of completions" if "ratio" in key else ""


_EVAL_FAMILIES = ("greedy_pass@", "pass@", "mean@", "distinct@", "coverage@")
_EVAL_UNITS = ("fraction of prompts", "fraction of prompts", "mean score", "distinct correct answers",
               "fraction of valid answers")


def _eval_order(key: str) -> tuple:
    name = key[len("eval/") :]
    for i, family in enumerate(_EVAL_FAMILIES):
        if name.startswith(family) and name[len(family) :].isdigit():
            return (i, int(name[len(family) :]), name)
    return (len(_EVAL_FAMILIES), 0, name)


def _eval_unit(key: str) -> str:
    family = _eval_order(key)[0]
    return _EVAL_UNITS[family] if family < len(_EVAL_UNITS) else "value"


# ----------------------------------------------------------------------------- entry point


def main_report(run_dirs: Sequence[str | Path], out_dir: str | Path | None = None, *, samples: int = 3) -> Path:
    """Write the plots and ``report.html`` into ``out_dir``; return the HTML path.

    ``out_dir`` defaults to ``RUN_DIR/report`` for one run and ``./report`` for several.
    ``samples`` best and as many worst completions of each run's latest logged step are shown.
    """
    if len(run_dirs) == 0:
        raise ReportError("run_dirs must name at least one run folder")
    if samples < 0:
        raise ValueError(f"samples must be >= 0, got {samples}")
    if importlib.util.find_spec("matplotlib") is None:
        raise ImportError("maxent-grpo report draws with matplotlib: pip install 'maxent-grpo[report]'")
    paths = [Path(p) for p in run_dirs]
    out = Path(out_dir) if out_dir is not None else (paths[0] / "report" if len(paths) == 1 else Path("report"))
    runs = [load_run(p, label) for p, label in zip(paths, run_labels(paths))]
    out.mkdir(parents=True, exist_ok=True)


    keys = {k for run in runs for record in run.records for k in record if series([record], k)[0]}
    images = [plot_figure(spec, runs, out) for spec in figure_specs(keys)]
    if keys & set(PHASES) or "step_time" in keys:
        images.append(plot_step_time(runs, out))
    embedded = [(img.filename, img.title, (out / img.filename).read_bytes()) for img in images]
    html = render_report(runs, embedded, samples=samples)
    path = out / "report.html"
    path.write_text(html, encoding="utf-8")
    return path


# ----------------------------------------------------------------------------- drawing


@dataclass(frozen=True)
class PlotImage:
    filename: str
    title: str


_COLORS = ("tab:blue", "tab:orange", "tab:green", "tab:red", "tab:purple", "tab:brown", "tab:pink", "tab:gray")


def _color(i: int) -> str:
    return _COLORS[i % len(_COLORS)]


def _figure(num_panels: int, *, sharey: bool = False):
    # A bare Figure (no pyplot): no global backend state, nothing shown on screen.
    from matplotlib.figure import Figure

    ncols = min(3, num_panels)
    nrows = math.ceil(num_panels / ncols)
    fig = Figure(figsize=(max(7.0, 5.0 * ncols), 3.3 * nrows + 0.7), layout="constrained", dpi=100)
    axes = fig.subplots(nrows, ncols, squeeze=False, sharey=sharey).ravel()
    for ax in axes[num_panels:]:
        ax.set_visible(False)
    return fig, axes[:num_panels]


def plot_figure(spec: FigureSpec, runs: Sequence[RunData], out_dir: Path) -> PlotImage:
    draw_figure(spec, runs).savefig(out_dir / spec.filename)
    return PlotImage(spec.filename, spec.title)


def draw_figure(spec: FigureSpec, runs: Sequence[RunData]):
    """The matplotlib Figure of ``spec``: one panel per metric, one colour per run."""
    fig, axes = _figure(len(spec.panels))
    longest = max(len(series(run.records, p.key)[0]) for run in runs for p in spec.panels)
    window = smoothing_window(longest)
    title = spec.title
    if spec.style == "smooth" and window > 1:
        title += f"\nthin: every step; thick: rolling mean over the last {window} steps"
    for ax, panel in zip(axes, spec.panels):
        for i, run in enumerate(runs):
            steps, values = series(run.records, panel.key)
            if not steps:
                continue
            color = _color(i)
            if spec.style == "points" or len(steps) == 1:
                ax.plot(steps, values, color=color, marker="o", markersize=4, linewidth=1.2, label=run.label)
            elif spec.style == "smooth" and window > 1:
                ax.plot(steps, values, color=color, linewidth=0.8, alpha=0.3)
                ax.plot(steps, rolling_mean(values, window), color=color, linewidth=2.0, label=run.label)
            else:
                ax.plot(steps, values, color=color, linewidth=1.5, label=run.label)
        ax.set_title(panel.title, fontsize=11)
        ax.set_xlabel(STEP_LABEL)
        ax.set_ylabel(panel.ylabel)
        ax.grid(alpha=0.3)
    if len(runs) > 1:
        # One legend for the whole figure, below the panels, where it hides no curve.
        labelled = {}
        for ax in axes:
            for handle, label in zip(*ax.get_legend_handles_labels()):
                labelled.setdefault(label, handle)
        order = [run.label for run in runs if run.label in labelled]
        fig.legend([labelled[k] for k in order], order, loc="outside lower center", ncols=min(len(order), 4),
                   title="run", fontsize=9)
    fig.suptitle(title, fontsize=12)
    return fig


def plot_step_time(runs: Sequence[RunData], out_dir: Path) -> PlotImage:
    draw_step_time(runs).savefig(out_dir / "step_time.png")
    return PlotImage("step_time.png", "Step time by phase")


def draw_step_time(runs: Sequence[RunData]):
    """Per run: the phases of a step stacked, and what the total has beyond them."""
    shown = [run for run in runs if any(series(run.records, k)[0] for k in (*PHASES, "step_time"))]
    fig, axes = _figure(len(shown), sharey=True)
    for ax, run in zip(axes, shown):
        rows = [r for r in run.records if any(k in r for k in (*PHASES, "step_time"))]
        steps = [r["step"] for r in rows]
        layers = {k[len("time/") :]: [_number(r.get(k)) for r in rows] for k in PHASES if any(k in r for r in rows)}
        # A phase keeps its colour in every run, whichever phases a run timed.
        colors = [_color(PHASES.index(f"time/{name}")) for name in layers]
        totals = [_number(r.get("step_time")) for r in rows]
        if any(totals):
            layers["other"] = [max(0.0, t - sum(v[j] for v in layers.values())) for j, t in enumerate(totals)]
            colors.append("lightgray")
        ax.stackplot(steps, *layers.values(), labels=list(layers), colors=colors, alpha=0.85)
        if len(runs) > 1:
            ax.set_title(run.label, fontsize=11)
        ax.set_xlabel(STEP_LABEL)
        ax.set_ylabel("seconds per step")
        ax.grid(alpha=0.3)
    labelled = {}
    for ax in axes:
        for handle, label in zip(*ax.get_legend_handles_labels()):
            labelled.setdefault(label, handle)
    order = [k[len("time/") :] for k in reversed(PHASES) if k[len("time/") :] in labelled]
    order = (["other"] if "other" in labelled else []) + order  # top of the stack first
    names = ["other (step_time − phases)" if label == "other" else label for label in order]
    fig.legend([labelled[k] for k in order], names, loc="outside center right", title="phase", fontsize=9)
    fig.suptitle("Wall-clock time per optimizer step, by phase (stacked)", fontsize=12)
    return fig


def _number(value: object) -> float:
    # Stacking needs a value at every step: a phase not logged at a step drew 0 s there.
    if isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value):
        return float(value)
    return 0.0
