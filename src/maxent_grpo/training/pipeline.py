"""Batch preparation (seed ``maxent_grpo.training.pipeline``): a batch through its stages, in two halves.

The stages themselves, in the order they run, are in ``training/stages.py``. Here:

* :func:`produce_rollouts`, the producer's half (the ``sampling`` and ``rewarding`` stages), run now or
  ``rollout.max_staleness`` steps ahead; it leaves a :class:`RolloutRecord` on the data plane;
* :func:`settle_sampling`, with a backend that can lose its server (``vllm_server``): the point after each
  batch's sampling where every process agrees whether one lost it, and the lost batches are sampled again;
* :func:`finish_batch`, the trainer's half (the ``scoring`` stages) at the step, between two points every
  process reaches; it returns a :class:`PreparedBatch`, or the :class:`Skipped` value of the stage that
  failed, on every rank alike.

:func:`prepare_training_batch` (the seed's name) is the synchronous batch, the two halves in a row:
a :class:`PreparedBatch`, or None for a batch a stage skipped, with the reason logged and counted
(:func:`count_batch`, the run's :class:`~maxent_grpo.training.skip_counts.SkipCounts`). The loop makes
every batch of a synchronous run (``rollout.max_staleness: 0``, the local data plane) through it.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field, replace
from typing import Callable

import torch

from maxent_grpo.core.step import MicroBatch
from maxent_grpo.errors import UserError
from maxent_grpo.rewards.maxent import RewardComputation, WeightingSettings, WeightStats
from maxent_grpo.rollout.backend import (
    GenerationBackend,
    PackedRollout,
    RolloutBatch,
    SamplerGone,
    SamplerLost,
    select_groups,
)
from maxent_grpo.rollout.data_plane import RolloutRecord, Skipped
from maxent_grpo.tasks.modebench_package import Grades
from maxent_grpo.training.diversity import group_diversity
from maxent_grpo.training.skip_counts import SkipCounts
from maxent_grpo.training.stages import Draft, PipelineContext, SkipBatch, run_stages

__all__ = [
    "OTHER_RANK", "PipelineContext", "PreparedBatch", "SkipBatch", "complete_rollouts", "count_batch",
    "finish_batch", "prepare_training_batch", "produce_rollouts", "sampling_outcome", "score_batch",
    "settle_sampling",
]

log = logging.getLogger("maxent_grpo")


@dataclass
class PreparedBatch:
    """Everything the optimizer step needs for one batch, prompt-major ``[P*G]`` rows."""

    rows: list[dict]
    rollout: RolloutBatch
    packed: PackedRollout
    reward_comp: RewardComputation
    advantages: torch.Tensor  # [N], after SEED scaling
    ref_logps: torch.Tensor | None  # [N, T]
    weight_stats: WeightStats | None  # MaxEnt listwise weights
    listwise_active: torch.Tensor | None  # [P] groups that enter the listwise loss
    row_weights: torch.Tensor | None  # [N] xDr multipliers
    diversity: dict[str, float]
    stats: dict[str, float]
    timings: dict[str, float]
    extra_columns: dict[str, list] = field(default_factory=dict)  # the reward functions' log_extra columns
    teacher_logps: torch.Tensor | None = None  # [N, T] the teacher's (on-policy distillation)
    grades: Grades = field(default_factory=Grades)  # the batch's modebench grades (replay admission reads them)
    version: int = 0  # the policy version (optimizer steps taken) that sampled the batch

    @property
    def has_signal(self) -> bool:
        """Some group's completions got different rewards (else the policy term is zero)."""
        return not bool(self.reward_comp.zero_std.all())

    @property
    def total_input_tokens(self) -> int:
        return int(self.packed.attention_mask.sum())

    def micro_batches(self, size: int, old_logps: torch.Tensor | None = None) -> list[MicroBatch]:
        """Split into micro-batches of ``size`` rows (whole groups when ``size`` is a multiple of G)."""
        p, n = self.packed, self.packed.input_ids.shape[0]
        g, device = self.rollout.num_generations, self.packed.input_ids.device

        def rows(t: torch.Tensor | None, sl: slice) -> torch.Tensor | None:
            return None if t is None else t[sl].to(device)

        lw = self.weight_stats.flat_weights if self.weight_stats is not None else None
        out = []
        for s in range(0, n, size):
            e = min(s + size, n)
            sl = slice(s, e)
            out.append(
                MicroBatch(
                    input_ids=p.input_ids[sl],
                    attention_mask=p.attention_mask[sl],
                    prompt_length=p.prompt_length,
                    num_generations=g,
                    completion_mask=p.completion_mask[sl],
                    advantages=rows(self.advantages, sl),
                    old_logps=rows(old_logps, sl),
                    ref_logps=rows(self.ref_logps, sl),
                    row_weights=rows(self.row_weights, sl),
                    listwise_weights=rows(lw, sl),
                    listwise_active=rows(self.listwise_active, slice(s // g, e // g)),
                    behaviour_logps=rows(p.behaviour_logps, sl),
                    teacher_logps=rows(self.teacher_logps, sl),
                )
            )
        return out


# ----------------------------------------------------------------- the two halves

def produce_rollouts(
    ctx: PipelineContext, rows: list[dict], more_rows: Callable[[], list[dict]] | None, *, step: int, version: int,
) -> RolloutRecord:
    """The producer's half of a batch: sampling and rewarding, into a :class:`RolloutRecord`.

    Local to this process, so it may run ahead of the trainer (``rollout.max_staleness``); a failed
    stage comes back as the record's ``failure``. The one collective: with a backend that can lose its
    server, every process agrees after sampling (:func:`settle_sampling`; every process produces its
    batch at the same point of the step).
    """
    def draft() -> Draft:
        return Draft(rows, step, version, ctx.plan.batch.sampling, more_rows)

    # The step's rollout phase: every generate call of the step (retries, dynamic-sampling
    # rounds) inside one bracket, so a sleeping vLLM engine wakes its KV cache once.
    with ctx.backend.rollout_phase(ctx.model):
        if ctx.recovers_lost_server:
            sampled = settle_sampling(ctx, sampling_outcome(ctx, draft()), draft)
        else:
            sampled = run_stages(ctx, draft(), "sampling")
        return complete_rollouts(ctx, sampled, step=step, version=version)


def sampling_outcome(ctx: PipelineContext, draft: Draft) -> Draft | Skipped | SamplerLost | SamplerGone:
    """The sampling stages on ``draft``; a server lost meanwhile, or gone, as a value (for :func:`settle_sampling`)."""
    try:
        return run_stages(ctx, draft, "sampling")
    except (SamplerLost, SamplerGone) as err:
        return err


# A batch is sampled again at most this many times for servers lost while it was sampled.
MAX_RESAMPLES = 3


def settle_sampling(ctx: PipelineContext, outcome: Draft | Skipped | UserError,
                    make_draft: Callable[[], Draft]) -> Draft | Skipped:
    """Every process's sampling outcome, agreed on (collectives: every process calls this at the same point).

    A failure on any process (``outcome`` a :class:`UserError`: a sampler thread that timed out, a server
    that did not come back) raises on every process (:class:`SamplerGone` where it was another's). A
    server lost on any process (:class:`SamplerLost`): the last pushed weights go to the server again
    (``restore_weights``, which a replacement needs) and every process samples its batch again from a new
    ``make_draft()``: the same rows and seeds, so the batch is the one an uninterrupted run samples (a
    process that saw no loss may have sampled from a replacement before its weights were back).
    """
    for resamples in range(MAX_RESAMPLES + 1):
        lost = isinstance(outcome, SamplerLost)
        failed = isinstance(outcome, UserError) and not lost
        failed_any, lost_any = ctx.dist.max_over_ranks([int(failed), int(lost)])
        if failed_any:
            raise outcome if failed else SamplerGone("another process's sampler failed (its error is in its log)")
        if not lost_any:
            return outcome
        if resamples == MAX_RESAMPLES:
            break
        if lost:
            log.warning("%s: sampling the batch again once the weights are back", outcome)
        try:
            ctx.backend.restore_weights()  # raises on every process when it fails
        except UserError as err:
            raise SamplerGone(f"the weights could not be sent to the generation server again: {err}") from err
        outcome = sampling_outcome(ctx, make_draft())
    raise SamplerGone(f"the generation server was lost {MAX_RESAMPLES + 1} times while one batch was sampled")


def complete_rollouts(ctx: PipelineContext, sampled: Draft | Skipped, *, step: int, version: int) -> RolloutRecord:
    """The record of a batch whose sampling ended (or failed): its rewarding stages run here, in the
    trainer's thread (math-verify bounds its time with ``signal.alarm``, which only the main thread may set)."""
    done = sampled if isinstance(sampled, Skipped) else run_stages(ctx, sampled, "rewarding")
    if isinstance(done, Skipped):
        return RolloutRecord(step=step, version=version, rows=[], rollout=None, rewards=None, failure=done)
    done.timings["time/generate"] = time.perf_counter() - done.started - done.timings["time/reward"]
    return RolloutRecord(step=step, version=version, rows=done.rows, rollout=done.rollout, rewards=done.rewards,
                         stats=done.stats, timings=done.timings, extra_columns=done.columns,
                         dropped=dict(done.dropped), grades=done.grades)


def finish_batch(ctx: PipelineContext, record: RolloutRecord, weighting: WeightingSettings) -> PreparedBatch | Skipped:
    """The trainer's half: the producer's rollouts through the scoring stages, weighted with the live tau and
    beta of ``weighting`` (the run's ``TrainState.controllers``) and ready for the step, or the
    :class:`Skipped` that says why the batch does not train (the loop counts it).

    Two sync points, reached by every rank whatever happened locally, keep a
    multi-process run in step: after rollout and rewards (any failure skips the
    batch everywhere; every rank keeps the same number of groups, so the
    optimizer step runs the same number of micro-batches), and after scoring.
    """
    failed_anywhere, common = ctx.dist.any_and_min(record.failure is not None, len(record.rows))
    if failed_anywhere:
        return record.failure or OTHER_RANK
    outcome = score_batch(ctx, _draft_of(ctx, record, common, weighting))
    skipped_here = isinstance(outcome, Skipped)
    if ctx.dist.any_rank(skipped_here):
        return outcome if skipped_here else OTHER_RANK
    return _prepared(ctx, outcome)


def score_batch(ctx: PipelineContext, draft: Draft) -> Draft | Skipped:
    """The scoring stages on this process's batch (no collective)."""
    return run_stages(ctx, draft, "scoring")


def _draft_of(ctx: PipelineContext, record: RolloutRecord, groups: int, weighting: WeightingSettings) -> Draft:
    """A record's first ``groups`` groups (the count every rank has), as a draft for the scoring stages."""
    rows, rollout, rewards, columns = record.rows, record.rollout, record.rewards, record.extra_columns
    if groups < len(rows):
        n = groups * rollout.num_generations
        rows, rollout = rows[:groups], select_groups(rollout, list(range(groups)))
        rewards, columns = rewards[:n], {k: v[:n] for k, v in columns.items()}
    return Draft(rows, record.step, record.version, ctx.plan.batch.sampling, rollout=rollout, rewards=rewards,
                 stats=record.stats, timings=dict(record.timings), columns=columns, grades=record.grades,
                 weighting=weighting)


def _prepared(ctx: PipelineContext, d: Draft) -> PreparedBatch:
    comp = d.reward_comp
    groups = [d.rollout.completion_ids[i : i + d.rollout.num_generations]
              for i in range(0, len(d.rollout.completion_ids), d.rollout.num_generations)]
    return PreparedBatch(
        rows=d.rows, rollout=d.rollout, packed=d.packed, reward_comp=comp,
        # teacher.rewards false: distillation alone, the rewards only logged.
        advantages=comp.advantages if ctx.plan.batch.reward_advantages else torch.zeros_like(comp.advantages),
        ref_logps=d.ref_logps, teacher_logps=d.teacher_logps, weight_stats=d.targets.weight_stats,
        listwise_active=d.targets.listwise_active, row_weights=d.targets.row_weights,
        diversity=group_diversity(groups), stats=d.stats, timings=d.timings, extra_columns=d.columns,
        grades=d.grades, version=d.version,
    )


def count_batch(record: RolloutRecord, outcome: PreparedBatch | Skipped, skips: SkipCounts) -> PreparedBatch | None:
    """A batch taken by the trainer, counted in ``skips`` (its producer's dropped groups, and the batch
    when skipped, its reason logged); the batch, or None when it was skipped."""
    skipped = outcome if isinstance(outcome, Skipped) else None
    skips.count(record.dropped, skipped)
    if skipped is not None:
        log.warning("skipping batch: %s", skipped)
        return None
    return outcome


def prepare_training_batch(
    ctx: PipelineContext, generator: GenerationBackend, batch: list[dict], *, weighting: WeightingSettings,
    skips: SkipCounts | None = None, step: int = 0, more_rows: Callable[[], list[dict]] | None = None,
) -> PreparedBatch | None:
    """One synchronous batch of ``batch`` (prompt rows from the training data): sampled by ``generator``
    (the backend of ``ctx`` or another), rewarded, scored and weighted with ``weighting`` (the live tau
    and beta of the run's ``TrainState.controllers``), for the optimizer ``step`` (0-based; the reward
    functions' ``trainer_state``).

    Returns a :class:`PreparedBatch`, or None when a stage skipped the batch: the reason is logged and,
    with ``skips`` (the run's ``TrainState.skips``), counted under its stage. ``more_rows``: further
    rows for dynamic sampling's rounds (``batch.dynamic_sampling``).
    """
    producer = ctx if generator is ctx.backend else replace(ctx, backend=generator)
    record = produce_rollouts(producer, batch, more_rows, step=step, version=step)
    return count_batch(record, finish_batch(ctx, record, weighting), SkipCounts() if skips is None else skips)


# What a process whose own batch was fine skips when another process's failed.
OTHER_RANK = Skipped("other_rank", "another process's batch failed (its error is in its log)")
