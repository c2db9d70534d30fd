"""What the report reads from a run folder: its metrics, config, identity and latest completions."""

from __future__ import annotations

import json
import math
import re
import warnings
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

from maxent_grpo.errors import UserError
from maxent_grpo.run_files import METRICS_NAME, parse_metrics_lines



class ReportError(UserError, ValueError):
    """A run folder given to ``maxent-grpo report`` cannot be read."""


@dataclass(frozen=True)
class RunData:
    label: str
    path: Path
    records: list[dict]  # one per step, sorted by step, the last record of a step wins
    config_text: str | None
    run_info: dict | None
    completions_step: int | None  # the latest step with logged completions
    completions: list[dict] = field(default_factory=list)


def series(records: Sequence[dict], key: str) -> tuple[list[int], list[float]]:
    """Steps and values of ``key`` where it is a finite number."""
    steps, values = [], []
    for record in records:
        value = record.get(key)
        if isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value):
            steps.append(record["step"])
            values.append(float(value))
    return steps, values


def smoothing_window(num_points: int) -> int:
    """Trailing rolling-mean window: about a twentieth of the run, between 1 and 50 steps."""
    return max(1, min(50, round(num_points / 20)))


def rolling_mean(values: Sequence[float], window: int) -> list[float]:
    """Trailing mean over the last ``window`` values (fewer at the start)."""
    if window < 1:
        raise ValueError(f"window must be >= 1, got {window}")
    out, total = [], 0.0
    for i, v in enumerate(values):
        total += v
        if i >= window:
            total -= values[i - window]
        out.append(total / min(i + 1, window))
    return out


def run_labels(paths: Sequence[Path]) -> list[str]:
    """Shortest trailing path parts that tell the run dirs apart (``a/run``, ``b/run``)."""
    parts = [Path(p).resolve().parts for p in paths]
    for depth in range(1, max(len(p) for p in parts) + 1):
        labels = ["/".join(p[-depth:]) for p in parts]
        if len(set(labels)) == len(labels):
            return labels
    raise ReportError(f"run_dirs must be different folders, got {[str(p) for p in paths]}")


def best_and_worst(rows: Sequence[dict], n: int) -> tuple[list[dict], list[dict]]:
    """The ``n`` highest- and ``n`` lowest-reward rows (worst first), never the same row twice."""
    ranked = sorted(rows, key=lambda r: r["reward"], reverse=True)
    best = ranked[:n]
    worst = list(reversed(ranked[max(n, len(ranked) - n) :]))
    return best, worst


_COMPLETION_FILE = re.compile(r"^step-(\d+)\.jsonl$")


def load_run(run_dir: str | Path, label: str) -> RunData:
    run_dir = Path(run_dir)
    metrics_path = run_dir / METRICS_NAME
    if not metrics_path.is_file():
        raise ReportError(f"run_dirs: {run_dir} has no {METRICS_NAME}")
    records, problems = parse_metrics_lines(metrics_path.read_text().splitlines())
    for problem in problems:
        warnings.warn(f"{metrics_path}: {problem}; skipped", stacklevel=2)
    config_path = run_dir / "config.yaml"
    info_path = run_dir / "run_info.json"
    completion_files = sorted(
        (int(m.group(1)), p)
        for p in (run_dir / "completions").glob("step-*.jsonl")
        if (m := _COMPLETION_FILE.match(p.name))
    )
    completions_step, completions = None, []
    if completion_files:
        completions_step, latest = completion_files[-1]
        completions, problems = _read_completions(latest)
        for problem in problems:
            warnings.warn(f"{latest}: {problem}; skipped", stacklevel=2)
    return RunData(
        label=label,
        path=run_dir,
        records=records,
        config_text=config_path.read_text() if config_path.is_file() else None,
        run_info=json.loads(info_path.read_text()) if info_path.is_file() else None,
        completions_step=completions_step,
        completions=completions,
    )


def _read_completions(path: Path) -> tuple[list[dict], list[str]]:
    rows, problems = [], []
    for number, line in enumerate(path.read_text().splitlines(), start=1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except json.JSONDecodeError:
            problems.append(f"line {number} is not JSON")
            continue
        if not isinstance(row, dict) or not isinstance(row.get("reward"), (int, float)):
            problems.append(f"line {number} has no numeric 'reward'")
            continue
        rows.append(row)
    return rows, problems
