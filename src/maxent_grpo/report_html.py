"""The HTML page of ``maxent-grpo report``: one self-contained file (plots embedded as PNG data).

Pure: takes the loaded runs and the PNG bytes, returns the page. Everything that
comes from a run (completions, prompts, config, names) is HTML-escaped.
"""

from __future__ import annotations

import base64
import math
from collections.abc import Sequence
from html import escape

from maxent_grpo.report_data import RunData, best_and_worst, rolling_mean, series, smoothing_window

__all__ = ["render_report"]

_CSS = """
body { font-family: system-ui, sans-serif; margin: 2em auto; max-width: 1500px; padding: 0 1em; color: #222; }
h1 { margin-bottom: 0.2em; } h2 { margin-top: 1.6em; border-bottom: 1px solid #ddd; }
table { border-collapse: collapse; margin: 0.5em 0; } th, td { border: 1px solid #ccc; padding: 3px 8px; }
th { background: #f3f3f3; text-align: left; } td.num { text-align: right; font-variant-numeric: tabular-nums; }
img { max-width: 100%; border: 1px solid #eee; }
pre { white-space: pre-wrap; word-break: break-word; background: #f7f7f7; padding: 0.6em; margin: 0.3em 0;
      max-height: 24em; overflow: auto; }
.sample { border: 1px solid #ddd; border-radius: 4px; padding: 0.4em 0.8em; margin: 0.6em 0; }
.best { border-left: 6px solid #2a9d3a; } .worst { border-left: 6px solid #c0392b; }
.meta { color: #555; font-size: 0.9em; }
"""


def render_report(runs: Sequence[RunData], images: Sequence[tuple[str, str, bytes]], *, samples: int) -> str:
    """The page: runs and their method, plots, best/worst completions, configs.

    ``images`` are ``(filename, title, png_bytes)``; each is embedded and links to its file.
    """
    parts = [
        "<!DOCTYPE html>",
        '<html lang="en"><head><meta charset="utf-8">',
        f"<title>maxent-grpo report: {escape(', '.join(r.label for r in runs))}</title>",
        f"<style>{_CSS}</style></head><body>",
        "<h1>maxent-grpo report</h1>",
        f'<p class="meta">{len(runs)} run(s). Plots are also saved as PNG files next to this page.</p>',
        "<h2>Runs</h2>",
        _runs_table(runs),
        "<h2>Plots</h2>",
    ]
    if not images:
        parts.append("<p>No plottable metrics were logged.</p>")
    for filename, title, png in images:
        data = base64.b64encode(png).decode("ascii")
        parts.append(
            f"<h3>{escape(title)}</h3>"
            f'<a href="{escape(filename)}"><img src="data:image/png;base64,{data}" alt="{escape(title)}"></a>'
        )
    if samples > 0:
        for run in runs:
            parts.append(_samples_section(run, samples))
    parts.append("<h2>Configuration</h2>")
    for run in runs:
        text = run.config_text if run.config_text is not None else "(no config.yaml in the run folder)"
        parts.append(
            f"<details><summary>{escape(run.label)}: config.yaml</summary><pre>{escape(text)}</pre></details>"
        )
    parts.append("<h2>Last logged metrics</h2>")
    for run in runs:
        parts.append(f"<details><summary>{escape(run.label)}</summary>{_last_metrics_table(run)}</details>")
    parts.append("</body></html>")
    return "\n".join(parts)


def _fmt(value: object) -> str:
    if isinstance(value, float):
        if not math.isfinite(value):
            return str(value)
        return f"{value:.4g}"
    return escape(str(value))


def _duration(seconds: float) -> str:
    minutes, secs = divmod(int(round(seconds)), 60)
    hours, minutes = divmod(minutes, 60)
    return f"{hours}:{minutes:02d}:{secs:02d}"


def _runs_table(runs: Sequence[RunData]) -> str:
    header = (
        "<tr><th>run</th><th>method</th><th>family</th><th>loss backend</th><th>steps logged</th>"
        "<th>last step</th><th>final reward<br>(rolling mean)</th><th>mean step time</th>"
        "<th>total step time</th><th>folder</th></tr>"
    )
    rows = []
    for run in runs:
        info = run.run_info if run.run_info is not None else {}
        _, rewards = series(run.records, "reward")
        final = _fmt(rolling_mean(rewards, smoothing_window(len(rewards)))[-1]) if rewards else "-"
        _, times = series(run.records, "step_time")
        mean_time = f"{sum(times) / len(times):.2f} s" if times else "-"
        total_time = _duration(sum(times)) if times else "-"
        last = run.records[-1]["step"] if run.records else "-"
        cells = [
            escape(run.label),
            *(escape(str(info.get(k, "-"))) for k in ("method", "family", "policy_loss")),
        ]
        numbers = [str(len(run.records)), str(last), final, mean_time, total_time]
        rows.append(
            "<tr>"
            + "".join(f"<td>{c}</td>" for c in cells)
            + "".join(f'<td class="num">{n}</td>' for n in numbers)
            + f"<td>{escape(str(run.path))}</td></tr>"
        )
    return "<table>" + header + "".join(rows) + "</table>"


def _samples_section(run: RunData, n: int) -> str:
    title = f"<h2>Sample completions: {escape(run.label)}"
    if run.completions_step is None:
        return title + "</h2><p>No completions were logged (completions/step-N.jsonl).</p>"
    best, worst = best_and_worst(run.completions, n)
    parts = [
        title + f", step {run.completions_step}</h2>",
        f'<p class="meta">The {len(best)} highest- and {len(worst)} lowest-reward of the '
        f"{len(run.completions)} completions logged at step {run.completions_step}.</p>",
        "<h3>Best</h3>",
        *(_sample(row, "best") for row in best),
        "<h3>Worst</h3>",
        *(_sample(row, "worst") for row in worst),
    ]
    return "\n".join(parts)


def _sample(row: dict, kind: str) -> str:
    facts = [f"reward <b>{_fmt(row['reward'])}</b>"]
    rewards = row.get("rewards")
    if isinstance(rewards, dict) and rewards:
        facts.append("(" + ", ".join(f"{escape(str(k))} {_fmt(v)}" for k, v in rewards.items()) + ")")
    for key, label in (("advantage", "advantage"), ("weight", "weight"), ("length", "length"),
                       ("finish_reason", "finish")):
        if key in row:
            facts.append(f"{label} {_fmt(row[key])}")
    prompt = row.get("prompt", "")
    prompt_text = prompt if isinstance(prompt, str) else repr(prompt)
    return (
        f'<div class="sample {kind}"><div class="meta">{" &middot; ".join(facts)}</div>'
        f"<details><summary>prompt</summary><pre>{escape(prompt_text)}</pre></details>"
        f"<pre>{escape(str(row.get('completion', '')))}</pre></div>"
    )


def _last_metrics_table(run: RunData) -> str:
    if not run.records:
        return "<p>(no metrics)</p>"
    last = run.records[-1]
    rows = "".join(f'<tr><td>{escape(k)}</td><td class="num">{_fmt(v)}</td></tr>' for k, v in sorted(last.items()))
    return f"<table><tr><th>metric</th><th>value at step {last['step']}</th></tr>{rows}</table>"
