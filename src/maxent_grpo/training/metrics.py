"""Step metrics (seed ``maxent_grpo.training.metrics``): build, accumulate, write.

``metrics.jsonl`` holds one JSON object per optimizer step. Each line is
written whole and fsynced, so a killed run never leaves half a record; on
resume the lines after the checkpoint's step are dropped before appending.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
from dataclasses import dataclass, field
from pathlib import Path

import torch

from maxent_grpo.core.rollout_correction import MismatchSums, combine_mismatch_sums, mismatch_metrics
from maxent_grpo.core.step import StepResult
from maxent_grpo.training.distributed import Dist
from maxent_grpo.training.pipeline import PreparedBatch


@dataclass
class MetricState:
    """Running sums for windowed averages (the progress bar and the end-of-run summary)."""

    sums: dict[str, float] = field(default_factory=dict)
    counts: dict[str, int] = field(default_factory=dict)


def accumulate_metrics(state: MetricState, metrics: dict[str, float]) -> None:
    for key, value in metrics.items():
        if isinstance(value, (int, float)) and math.isfinite(value):
            state.sums[key] = state.sums.get(key, 0.0) + float(value)
            state.counts[key] = state.counts.get(key, 0) + 1


def flush_metric_averages(state: MetricState) -> dict[str, float]:
    out = {k: state.sums[k] / state.counts[k] for k in state.sums if state.counts[k]}
    state.sums.clear()
    state.counts.clear()
    return out


def _gathered_mean_std(dist: Dist, values: torch.Tensor) -> tuple[float, float]:
    allv = torch.tensor(dist.gather_floats([float(v) for v in values]), dtype=torch.float64)
    if allv.numel() == 0:
        return math.nan, math.nan  # no values: logged as null
    return float(allv.mean()), float(allv.std()) if allv.numel() > 1 else 0.0


def _gathered_mismatch(dist: Dist, local: MismatchSums) -> MismatchSums:
    """Every rank's mismatch statistics combined (sums added, extremes taken)."""
    names = [f.name for f in dataclasses.fields(MismatchSums)]
    flat = dist.gather_floats([getattr(local, n) for n in names])
    parts = [MismatchSums(*flat[i : i + len(names)]) for i in range(0, len(flat), len(names))]
    return combine_mismatch_sums(parts)


def build_training_metrics_dict(
    prepared: PreparedBatch,
    result: StepResult,
    *,
    step: int,
    learning_rate: float,
    timings: dict[str, float],
    controller: dict[str, float],
    dist: Dist,
    max_completion_length: int,
) -> dict[str, float]:
    """Flat metrics for one optimizer step, reduced over ranks."""
    rc, packed = prepared.reward_comp, prepared.packed
    # A completion no reward function scored (None) has no reward: it is left out, never counted as 0.
    reward, reward_std = _gathered_mean_std(dist, rc.total[~torch.isnan(rc.total)])
    m: dict[str, float] = {"step": step, "reward": reward, "reward_std": reward_std}
    for k, name in enumerate(rc.reward_names):
        col = rc.per_function[:, k]
        col = col[~torch.isnan(col)]
        m[f"rewards/{name}/mean"], m[f"rewards/{name}/std"] = _gathered_mean_std(dist, col)
    m["frac_reward_zero_std"] = dist.mean(float(rc.zero_std.float().mean()))
    lengths = packed.completion_mask.sum(1)
    m["completions/mean_length"] = dist.mean(float(lengths.float().mean()))
    m["completions/max_length"] = max(dist.gather_floats([float(lengths.max())]))
    m["completions/clipped_ratio"] = dist.mean(float(packed.truncated.float().mean()))
    for key, value in result.metrics.items():
        m[key] = dist.mean(value)
    m["grad_norm"] = result.grad_norm
    if result.mismatch is not None:
        m.update(mismatch_metrics(_gathered_mismatch(dist, result.mismatch)))
    m["learning_rate"] = learning_rate
    if prepared.weight_stats is not None:
        m["weight_entropy"] = dist.mean(float(prepared.weight_stats.weight_entropy))
        m["weight_entropy_min"] = min(dist.gather_floats([float(prepared.weight_stats.weight_entropy_min)]))
        m["weight_entropy_max"] = max(dist.gather_floats([float(prepared.weight_stats.weight_entropy_max)]))
    if prepared.row_weights is not None:
        m["xdr/multiplier_max"] = max(dist.gather_floats([float(prepared.row_weights.max())]))
    if rc.seed_scales is not None:
        m["seed_grpo/scale_mean"] = dist.mean(float(rc.seed_scales.mean()))
    for key, value in {**prepared.diversity, **prepared.stats}.items():
        m[key] = dist.mean(value)
    m.update(controller)
    m["num_tokens"] = float(dist.all_reduce_sum(torch.tensor([float(prepared.total_input_tokens)]))[0])
    for key, value in timings.items():
        m[key] = value
    m["step_time"] = timings["time/total"]
    return m


class MetricsLog:
    """Append-only ``metrics.jsonl`` whose records survive a kill at any moment."""

    def __init__(self, path: str | Path, *, resume_after_step: int | None = None):
        self.path = Path(path)
        if resume_after_step is not None and self.path.exists():
            kept = [
                line for line in self.path.read_text().splitlines()
                if line.strip() and _complete(line) and json.loads(line)["step"] <= resume_after_step
            ]
            tmp = self.path.with_name(self.path.name + ".tmp")
            tmp.write_text("".join(line + "\n" for line in kept))
            os.replace(tmp, self.path)
        elif resume_after_step is None and self.path.exists():
            self.path.unlink()

    def write(self, record: dict) -> None:
        clean = {k: (None if isinstance(v, float) and not math.isfinite(v) else v) for k, v in record.items()}
        line = json.dumps(clean, allow_nan=False, default=float)
        with open(self.path, "a") as fh:
            fh.write(line + "\n")
            fh.flush()
            os.fsync(fh.fileno())


def _complete(line: str) -> bool:
    try:
        json.loads(line)
    except json.JSONDecodeError:
        return False
    return True


def read_metrics(path: str | Path) -> list[dict]:
    """Parse ``metrics.jsonl``, ignoring a torn last line."""
    p = Path(path)
    if not p.exists():
        return []
    return [json.loads(line) for line in p.read_text().splitlines() if line.strip() and _complete(line)]
