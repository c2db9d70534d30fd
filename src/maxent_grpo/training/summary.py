"""The lines a finished run prints: how far it went, what it learned, what to run next."""

from __future__ import annotations

import math
import shlex
from pathlib import Path

from maxent_grpo.training.checkpoint import list_checkpoints

# Steps averaged at each end of the run for the first -> last reward line (one step is noisy).
WINDOW = 3


def _mean_reward(rows: list[dict]) -> float:
    values = [r["reward"] for r in rows if r.get("reward") is not None and math.isfinite(r["reward"])]
    return sum(values) / len(values) if values else math.nan


def best_checkpoint(output_dir: Path, metrics: list[dict]) -> tuple[Path, str] | None:
    """The kept checkpoint with the best in-loop ``eval/pass@1`` (None without in-loop eval)."""
    by_step = {r["step"]: r["eval/pass@1"] for r in metrics if r.get("eval/pass@1") is not None}
    kept = [(by_step[int(p.name.split("-")[1])], p) for p in list_checkpoints(output_dir)
            if int(p.name.split("-")[1]) in by_step]
    if not kept:
        return None
    score, path = max(kept, key=lambda item: item[0])
    return path, f"eval/pass@1 {score:.3f}"


def format_summary(summary, *, config_path: Path) -> str:
    """The end-of-run block for a :class:`~maxent_grpo.training.loop.RunSummary`."""
    out = summary.output_dir
    rows = summary.metrics
    lines = [f"done: {summary.steps} steps, output in {out}"]
    if rows:
        first, last = rows[:WINDOW], rows[-WINDOW:]
        lines.append(
            f"  reward: {_mean_reward(first):.3f} (steps {first[0]['step']}-{first[-1]['step']}) -> "
            f"{_mean_reward(last):.3f} (steps {last[0]['step']}-{last[-1]['step']})"
        )
    lines.append(f"  metrics: {out / 'metrics.jsonl'}")
    if summary.checkpoint is not None:
        lines.append(f"  final checkpoint: {summary.checkpoint}")
    best = best_checkpoint(out, rows)
    if best is not None:
        lines.append(f"  best checkpoint: {best[0]} ({best[1]})")
    ckpt = best[0] if best is not None else summary.checkpoint
    lines.append(f"  plots:    maxent-grpo report {shlex.quote(str(out))}")
    if ckpt is not None:
        lines.append(
            f"  evaluate: maxent-grpo eval {shlex.quote(str(ckpt))} --config {shlex.quote(str(config_path))} "
            f"--output {shlex.quote(str(out / 'eval' / ckpt.name))}"
        )
    return "\n".join(lines)
