"""The loop's logging path (seed ``maxent_grpo.training.metrics``).

* :func:`summarize_reward_stats` / :func:`summarize_weight_stats`: a batch's reward
  and listwise-weight statistics combined over every process; the tau controller
  steers by the latter.
* :func:`log_local_step`: one process's own view of a step, at DEBUG level.
* :func:`log_training_step`: the step's metrics gathered over processes
  (:func:`build_training_metrics_dict`), then :func:`log_training_metrics` writes
  them to ``metrics.jsonl`` and the trackers, with the completion table.

``metrics.jsonl`` holds one JSON object per optimizer step. Each line is
written whole and fsynced, so a killed run never leaves half a record; on
resume the lines after the checkpoint's step are dropped before appending.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import math
import os
from dataclasses import dataclass
from pathlib import Path

import torch

from maxent_grpo.core.advantages import maxrl_group_stats
from maxent_grpo.core.rollout_correction import MismatchSums, combine_mismatch_sums, mismatch_metrics
from maxent_grpo.core.step import StepResult
from maxent_grpo.training.distributed import Dist
from maxent_grpo.kill_points import kill_point
from maxent_grpo.run_files import prompt_ids_hash, read_metrics, write_text_atomic
from maxent_grpo.rewards.maxent import RewardComputation, WeightLoggingView, WeightStats
from maxent_grpo.training.pipeline import PreparedBatch
from maxent_grpo.training.tables import gather_completion_rows, write_completion_table

log = logging.getLogger("maxent_grpo")


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


@dataclass(frozen=True)
class RewardLoggingView:
    """A batch's rewards over every process: total and per function (completions no function
    scored are left out; NaN when there are none)."""

    mean: float
    std: float
    per_function: dict[str, tuple[float, float]]  # name -> (mean, std)
    frac_zero_std: float  # share of groups whose rewards all agree


def summarize_reward_stats(dist: Dist, reward_comp: RewardComputation) -> RewardLoggingView:
    rc = reward_comp
    mean, std = _gathered_mean_std(dist, rc.total[~torch.isnan(rc.total)])
    per_function = {}
    for k, name in enumerate(rc.reward_names):
        col = rc.per_function[:, k]
        per_function[name] = _gathered_mean_std(dist, col[~torch.isnan(col)])
    return RewardLoggingView(mean, std, per_function, dist.mean(float(rc.zero_std.float().mean())))


def summarize_weight_stats(dist: Dist, weight_stats: WeightStats) -> WeightLoggingView | None:
    """The listwise weights' statistics over every process (ranks may hold different numbers of
    groups): the entropy over the groups in the loss (also over ``log G``), and the mean and
    sample std of the listwise advantages ``w_i - 1/G`` over every row. None when no group
    entered the loss (nothing to steer by)."""
    ws = weight_stats
    n = ws.num_active_groups or 0
    adv = ws.advantage_entropy.detach().to(torch.float64)
    entropy_part = [ws.weight_entropy * n, float(n), ws.weight_entropy_min, ws.weight_entropy_max] if n else [0.0, 0.0]
    parts = dist.gather_objects([(entropy_part, float(adv.sum()), float((adv * adv).sum()), adv.numel())])
    total = sum(e[1] for e, *_ in parts)
    if total == 0:
        return None
    entropy = sum(e[0] for e, *_ in parts) / total
    rows = sum(p[3] for p in parts)
    adv_mean = sum(p[1] for p in parts) / rows
    adv_var = (sum(p[2] for p in parts) - rows * adv_mean**2) / (rows - 1) if rows >= 2 else 0.0
    g = ws.weights_grouped.shape[1]
    return WeightLoggingView(
        entropy=entropy,
        entropy_norm=entropy / math.log(g) if g > 1 else 0.0,
        entropy_min=min(e[2] for e, *_ in parts if e[1]),
        entropy_max=max(e[3] for e, *_ in parts if e[1]),
        advantage_entropy_mean=adv_mean,
        advantage_entropy_std=math.sqrt(max(adv_var, 0.0)),
    )


def maxrl_metrics(dist: Dist, rc: RewardComputation) -> dict[str, float]:
    """ALGORITHMS.md §16's metrics over every process: ``maxrl/success_rate`` (the mean of
    ``K / G_v`` over groups with a valid reward), ``maxrl/no_success_frac`` (the share of those
    with ``K = 0``, which carry no signal) and ``maxrl/adv_max`` (the largest advantage)."""
    rate, none = maxrl_group_stats(rc.total, rc.num_generations)
    rates = dist.gather_floats([float(v) for v in rate])
    nones = dist.gather_floats([float(v) for v in none])
    return {
        "maxrl/success_rate": sum(rates) / len(rates) if rates else math.nan,
        "maxrl/no_success_frac": sum(nones) / len(nones) if nones else math.nan,
        "maxrl/adv_max": max(dist.gather_floats([float(rc.advantages.max())])),
    }


def log_local_step(dist: Dist, prepared: PreparedBatch, result: StepResult, step: int) -> None:
    """This process's own view of the step (DEBUG level: ``MAXENT_GRPO_LOG=DEBUG``)."""
    if not log.isEnabledFor(logging.DEBUG):
        return
    total = prepared.reward_comp.total
    known = total[~torch.isnan(total)]
    log.debug("rank %d step %d: %d completions, local reward %.4f, loss %.6f, grad norm %.4f", dist.rank, step,
              total.numel(), float(known.mean()) if known.numel() else math.nan, result.loss, result.grad_norm)


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
    weight_view: WeightLoggingView | None = None,
) -> dict[str, float]:
    """Flat metrics for one optimizer step, reduced over ranks."""
    rc, packed = prepared.reward_comp, prepared.packed
    # A completion no reward function scored (None) has no reward: it is left out, never counted as 0.
    rewards = summarize_reward_stats(dist, rc)
    m: dict[str, float] = {"step": step, "reward": rewards.mean, "reward_std": rewards.std}
    for name, (mean, std) in rewards.per_function.items():
        m[f"rewards/{name}/mean"], m[f"rewards/{name}/std"] = mean, std
    m["frac_reward_zero_std"] = rewards.frac_zero_std
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
        view = weight_view
        nan = math.nan  # no group entered the loss: logged as null, not as an entropy
        m["weight_entropy"] = view.entropy if view is not None else nan
        m["weight_entropy_min"] = view.entropy_min if view is not None else nan
        m["weight_entropy_max"] = view.entropy_max if view is not None else nan
        m["weight_entropy_norm"] = view.entropy_norm if view is not None else nan
        m["listwise_advantage_std"] = view.advantage_entropy_std if view is not None else nan
    if prepared.row_weights is not None:
        m["xdr/multiplier_max"] = max(dist.gather_floats([float(prepared.row_weights.max())]))
    if rc.seed_scales is not None:
        m["seed_grpo/scale_mean"] = dist.mean(float(rc.seed_scales.mean()))
    if rc.settings.advantage_estimator == "maxrl":
        m.update(maxrl_metrics(dist, rc))
    for key, value in {**prepared.diversity, **prepared.stats}.items():
        m[key] = dist.mean(value)
    m.update(controller)
    m["num_tokens"] = float(dist.all_reduce_sum(torch.tensor([float(prepared.total_input_tokens)]))[0])
    m["prompt_ids_hash"] = prompt_ids_hash(dist.gather_objects(prepared.rollout.prompt_ids))
    for key, value in timings.items():
        m[key] = value
    m["step_time"] = timings["time/total"]
    return m


def log_training_metrics(metrics_log: "MetricsLog | None", trackers, step: int, metrics: dict) -> dict:
    """Write one step's gathered metrics to ``metrics.jsonl`` and the trackers (main process:
    ``metrics_log`` is None elsewhere); return them."""
    if metrics_log is not None:
        metrics_log.write(metrics)
        trackers.log(metrics, step)
    return metrics


@dataclass(frozen=True)
class MetricsSink:
    """Where a run's step metrics go: ``metrics.jsonl`` (``log``, the main process's; None elsewhere),
    the trackers, and the run folder for the completion tables; ``dist`` gathers them over processes."""

    dist: Dist
    log: "MetricsLog | None"
    trackers: object
    output_dir: Path


def log_training_step(
    prepared: PreparedBatch, result: StepResult, sink: MetricsSink, *, step: int, extra: dict[str, float],
    completion_table: bool, **dict_kwargs,
) -> dict[str, float]:
    """Gather the step's metrics over processes, add ``extra`` (skip counts, eval), log them, and
    write the completion table of every process's rows when ``completion_table``."""
    dist = sink.dist
    log_local_step(dist, prepared, result, step)
    metrics = build_training_metrics_dict(prepared, result, step=step, dist=dist, **dict_kwargs)
    metrics.update(extra)
    table = gather_completion_rows(prepared, dist) if completion_table else None
    log_training_metrics(sink.log, sink.trackers, step, metrics)
    if sink.log is not None and table is not None:
        write_completion_table(sink.output_dir, step, table, sink.trackers)
    return metrics


class MetricsLog:
    """Append-only ``metrics.jsonl`` whose records survive a kill at any moment."""

    def __init__(self, path: str | Path, *, resume_after_step: int | None = None):
        self.path = Path(path)
        if resume_after_step is not None and self.path.exists():
            kept = [r for r in read_metrics(self.path) if r["step"] <= resume_after_step]
            write_text_atomic(self.path, "".join(json.dumps(r, allow_nan=False) + "\n" for r in kept))
        elif resume_after_step is None and self.path.exists():
            self.path.unlink()

    def write(self, record: dict) -> None:
        clean = {k: (None if isinstance(v, float) and not math.isfinite(v) else v) for k, v in record.items()}
        line = json.dumps(clean, allow_nan=False, default=float)
        with open(self.path, "a") as fh:
            # In two writes so that a crash-safety test can kill the run between them (kill_points).
            half = len(line) // 2
            fh.write(line[:half])
            fh.flush()
            kill_point("metrics.mid_line", record["step"])
            fh.write(line[half:] + "\n")
            fh.flush()
            os.fsync(fh.fileno())
