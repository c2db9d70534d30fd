"""Batch preparation (seed ``maxent_grpo.training.pipeline``), in two halves.

:func:`produce_rollouts` (the producer, run by the rollout queue now or ``rollout.max_staleness``
steps ahead): generation (with retries and, for DAPO, dynamic sampling) and rewards, into a
:class:`RolloutRecord`. :func:`finish_batch` (the trainer, at the step): reward statistics
(advantages, q, SEED scales), the optional reward-side entropy bonus, reference scoring and the
method's weighting; it returns a :class:`PreparedBatch`, or the :class:`Skipped` value of a stage
that failed. A failing stage raises :class:`SkipBatch`; its caller turns it into the value, which
the record carries from the producer to the trainer. Nothing is silently trained on.

:func:`prepare_training_batch` (the seed's name) is the synchronous batch, the two halves in a row:
a :class:`PreparedBatch`, or None for a batch a stage skipped, with the reason logged and counted
(:func:`count_batch`, the run's :class:`~maxent_grpo.training.skip_counts.SkipCounts`). The loop makes
every batch of a synchronous run (``rollout.max_staleness: 0``, the local data plane) through it.
"""

from __future__ import annotations

import logging
import time
from collections import Counter
from dataclasses import dataclass, field, replace
from typing import Callable

import torch

from maxent_grpo.core.advantages import NonBinaryRewardError, combine_rewards, zero_std_groups
from maxent_grpo.core.step import MicroBatch
from maxent_grpo.methods import RewardScalingInputs, TargetInputs
from maxent_grpo.tasks.modebench import answer_key
from maxent_grpo.tasks.modebench_package import Grades, Unscorable
from maxent_grpo.rewards.maxent import (
    RewardComputation,
    WeightingSettings,
    WeightStats,
    apply_policy_entropy_bonus,
    compute_reward_statistics,
)
from maxent_grpo.rewards.context import RewardContext, TrainerState
from maxent_grpo.rewards.registry import RewardFunctionError, RewardSpec, evaluate_rewards, rollout_reward_inputs
from maxent_grpo.rollout.data_plane import RolloutRecord, Skipped
from maxent_grpo.rollout.backend import (
    SamplingParams,
    GenerationBackend,
    PackedRollout,
    RolloutBatch,
    concat_rollouts,
    generate_groups,
    pack_rollout,
    select_groups,
)
from maxent_grpo.data.prompts import format_prompt, prompt_messages
from maxent_grpo.envs.episodes import EpisodePlay, run_episodes
from maxent_grpo.training.diversity import group_diversity
from maxent_grpo.training.distributed import Dist
from maxent_grpo.training.run_plan import RunPlan
from maxent_grpo.training.skip_counts import SkipCounts

log = logging.getLogger("maxent_grpo")


class SkipBatch(Exception):
    """Raised inside a stage that failed for this batch; the stage's caller turns it into the
    :class:`Skipped` value the rest of the pipeline hands on (``skipped``)."""

    def __init__(self, stage: str, reason: str):
        super().__init__(f"{stage}: {reason}")
        self.skipped = Skipped(stage, reason)


@dataclass(frozen=True)
class PipelineContext:
    """What the batch stages read: the plan and the parts that do the work (no run state: that is the
    loop's ``TrainState``)."""

    plan: RunPlan
    model: torch.nn.Module  # the policy, unwrapped
    tokenizer: object
    backend: GenerationBackend
    reward_spec: RewardSpec
    dist: Dist
    # Completion log-probs [N, T] under the frozen reference, no grad: (input_ids, attention_mask,
    # prompt_length) -> [N, T]; None when the method scores no reference.
    reference_logps: Callable[[torch.Tensor, torch.Tensor, int], torch.Tensor] | None = None
    # The same for on-policy distillation's frozen teacher (training/teacher.py), with the batch's prompt
    # rows first (for a teacher with its own chat template); None without one.
    teacher_logps: Callable[[list[dict], torch.Tensor, torch.Tensor, int], torch.Tensor] | None = None
    # Multi-turn episodes: each row's environment and the limits; None: one-shot prompts.
    episodes: EpisodePlay | None = None
    # Optimizer steps per pass over the training rows (the reward functions' trainer_state.epoch); 0: unknown.
    steps_per_epoch: float = 0.0


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


# ----------------------------------------------------------------- stages

@dataclass
class Sampled:
    """Generation's output for one batch, before any reward: the rows whose groups are complete."""

    rows: list[dict]
    rollout: RolloutBatch
    stats: dict[str, float]
    # Multi-turn episodes: each completion's environment (the user's object for a TRL class), for the
    # reward functions' ``environments`` keyword; None for one-shot prompts.
    environments: list | None = None
    dropped: dict[str, int] = field(default_factory=dict)  # groups left out, by cause (RolloutRecord.dropped)


def sample_rollouts(ctx: PipelineContext, rows: list[dict], params: SamplingParams) -> Sampled:
    """Generate (or play the episodes of) ``rows``; raises :class:`SkipBatch`. Touches neither the
    policy's gradients nor any collective, so a sampler beside the trainer may run it in a thread."""
    return _generate(ctx, rows, params)


def _generate(ctx: PipelineContext, rows: list[dict], params: SamplingParams) -> Sampled:
    b = ctx.plan.batch
    if ctx.episodes is not None:
        return _play_episodes(ctx, ctx.episodes, rows, params)
    prompts = [format_prompt(ctx.tokenizer, r["prompt"], system_prompt=b.system_prompt, few_shot=list(b.few_shot))
               for r in rows]
    try:
        rollout, dropped = generate_groups(
            ctx.backend, prompts, b.num_generations, params, max_retry_rounds=b.max_retry_rounds,
        )
    except (RuntimeError, ValueError) as err:
        raise SkipBatch("generation", str(err)) from err
    if dropped:
        rows = [r for i, r in enumerate(rows) if i not in set(dropped)]
    if not rows:
        raise SkipBatch("generation", "every prompt came back with fewer than num_generations completions")
    return Sampled(rows, rollout, {}, dropped={"incomplete_groups": len(dropped)} if dropped else {})


def _play_episodes(ctx: PipelineContext, play: EpisodePlay, rows: list[dict], params: SamplingParams) -> Sampled:
    """Multi-turn rollouts (envs/episodes.py): a row whose episodes failed leaves with its group."""
    b = ctx.plan.batch
    try:
        played = run_episodes(
            ctx.backend, ctx.tokenizer, rows, [play.environments.factory(r) for r in rows], b.num_generations,
            params, play.limits,
            frame=lambda m: prompt_messages(m, system_prompt=b.system_prompt, few_shot=list(b.few_shot)),
        )
    except (RuntimeError, ValueError) as err:
        raise SkipBatch("generation", str(err)) from err
    if played.failures:
        log.warning("%d episode(s) failed, their groups dropped; first: %s", len(played.failures), played.failures[0])
    if not played.kept_rows:
        raise SkipBatch("environment", f"every group had a failed episode; first: {played.failures[0]}")
    return Sampled([rows[i] for i in played.kept_rows], played.rollout, played.stats, played.environments,
                   dropped={"failed_episodes": len(played.failures)} if played.failures else {})


@dataclass
class _Scored:
    """One round's rewards and what the reward functions logged (``log_extra``, ``log_metric``)."""

    sampled: Sampled
    per_fn: torch.Tensor
    context: RewardContext


def _score_round(ctx: PipelineContext, sampled: Sampled, state: TrainerState, timings: dict,
                 grades: Grades) -> _Scored:
    t0 = time.perf_counter()
    context = RewardContext(sampled.rollout.num_completions, state, sampled.environments, mode_grades=grades)
    try:
        rewards = evaluate_rewards(ctx.reward_spec, *rollout_reward_inputs(sampled.rows, sampled.rollout), context)
    except RewardFunctionError as err:
        raise SkipBatch("reward", str(err)) from err
    finally:
        timings["time/reward"] += time.perf_counter() - t0
    if torch.isnan(rewards).all():
        raise SkipBatch("reward", f"every reward function returned None for all {rewards.shape[0]} completions")
    return _Scored(sampled, rewards, context)


def _kept_columns(rounds: list[tuple[_Scored, list[int]]], g: int, n: int) -> dict[str, list]:
    """The ``log_extra`` columns of the kept groups of each round, in order (None where a round logged none)."""
    names = sorted({c for scored, _ in rounds for c in scored.context.extra_columns})
    out: dict[str, list] = {}
    for name in names:
        values: list = []
        for scored, keep in rounds:
            column = scored.context.extra_columns.get(name)
            values += [None if column is None else column[i * g + j] for i in keep for j in range(g)]
        out[name] = values[:n]
    return out


def _rewards_and_rounds(ctx: PipelineContext, first: Sampled, more_rows: Callable[[], list[dict]] | None,
                        state: TrainerState, timings: dict, grades: Grades):
    """Score ``first``; with dynamic sampling keep only groups whose rewards vary, sampling more
    rounds (from the current weights) until the batch is full (§9). Returns rows, rollout, rewards,
    stats (with the reward functions' ``log_metric`` means), their ``log_extra`` columns and the
    groups generation dropped in every round, by cause."""
    scored = _score_round(ctx, first, state, timings, grades)
    b = ctx.plan.batch
    if not b.dynamic_sampling:
        return (first.rows, first.rollout, scored.per_fn, {**first.stats, **scored.context.metric_means()},
                dict(scored.context.extra_columns), dict(first.dropped))
    g, target = first.rollout.num_generations, b.prompts_per_step
    rounds: list[tuple[_Scored, list[int]]] = []
    kept_rows, kept_rollouts, kept_rewards, seen, metrics, dropped = [], [], [], 0, {}, Counter()
    for round_idx in range(b.max_gen_batches):
        if round_idx > 0:
            if more_rows is None:
                break
            scored = _score_round(ctx, _generate(ctx, more_rows(), b.sampling), state, timings, grades)
        rows, rollout, per_fn = scored.sampled.rows, scored.sampled.rollout, scored.per_fn
        metrics.update(scored.context.metric_means())
        dropped.update(scored.sampled.dropped)
        seen += len(rows)
        flat = zero_std_groups(combine_rewards(per_fn, ctx.reward_spec.weight_tensor()), g)
        keep = [i for i in range(len(rows)) if not bool(flat[i])]
        rounds.append((scored, keep))
        kept_rows += [rows[i] for i in keep]
        kept_rollouts.append(select_groups(rollout, keep))
        kept_rewards.append(per_fn.view(len(rows), g, -1)[keep].reshape(-1, per_fn.shape[1]))
        if len(kept_rows) >= target:
            break
    else:
        log.warning("dynamic sampling: %d of %d groups after %d rounds", len(kept_rows), target, b.max_gen_batches)
    if not kept_rows:
        raise SkipBatch("dynamic_sampling", "no group with varied rewards")
    kept_rows = kept_rows[:target]
    rollout = select_groups(concat_rollouts(kept_rollouts), list(range(len(kept_rows))))
    per_fn = torch.cat(kept_rewards)[: len(kept_rows) * g]
    stats = {**scored.sampled.stats, **metrics, "dynamic_sampling/groups_seen": float(seen)}
    return kept_rows, rollout, per_fn, stats, _kept_columns(rounds, g, len(kept_rows) * g), dict(dropped)


def _policy_entropy(ctx: PipelineContext, packed: PackedRollout) -> torch.Tensor:
    _, ent = ctx.plan.scoring.score_rows(ctx.model, packed.input_ids, packed.attention_mask, packed.prompt_length,
                                         with_entropy=True)
    m = packed.completion_mask
    return ((ent * m).sum(1) / m.sum(1).clamp(min=1)).cpu()


# ----------------------------------------------------------------- orchestration

def produce_rollouts(
    ctx: PipelineContext, rows: list[dict], more_rows: Callable[[], list[dict]] | None, *, step: int, version: int,
) -> RolloutRecord:
    """The producer's half of a batch: generation (retries, dynamic-sampling rounds) and rewards.

    Local to this process (no collective), so it may run ahead of the trainer
    (``rollout.max_staleness``); a failed stage comes back as the record's ``failure``.
    """
    t0 = time.perf_counter()
    # The step's rollout phase: every generate call of the step (retries, dynamic-sampling
    # rounds) inside one bracket, so a sleeping vLLM engine wakes its KV cache once.
    with ctx.backend.rollout_phase(ctx.model):
        try:
            sampled: Sampled | Skipped = sample_rollouts(ctx, rows, ctx.plan.batch.sampling)
        except SkipBatch as err:
            sampled = err.skipped
        return complete_rollouts(ctx, sampled, more_rows, step=step, version=version, started=t0)


def complete_rollouts(
    ctx: PipelineContext, sampled: Sampled | Skipped, more_rows: Callable[[], list[dict]] | None, *,
    step: int, version: int, started: float,
) -> RolloutRecord:
    """The record of a batch whose generation ended (or failed): rewards, and dynamic-sampling rounds.

    Rewards run here, in the trainer's thread: math-verify bounds its time with
    ``signal.alarm``, which only the main thread may set. ``started``: when generation began.
    """
    timings = {"time/reward": 0.0}
    # TRL's trainer_state for the reward functions: the step this batch trains, as a float of epochs too.
    state = TrainerState(global_step=step, max_steps=ctx.plan.schedule.max_steps,
                         epoch=step / ctx.steps_per_epoch if ctx.steps_per_epoch else 0.0)
    grades = Grades()  # each completion graded once for its reward, answer key and replay admission
    if isinstance(sampled, Skipped):
        return RolloutRecord(step=step, version=version, rows=[], rollout=None, rewards=None, failure=sampled)
    try:
        rows, rollout, per_fn, stats, columns, dropped = _rewards_and_rounds(ctx, sampled, more_rows, state, timings,
                                                                             grades)
    except SkipBatch as err:
        return RolloutRecord(step=step, version=version, rows=[], rollout=None, rewards=None, failure=err.skipped)
    timings["time/generate"] = time.perf_counter() - started - timings["time/reward"]
    return RolloutRecord(step=step, version=version, rows=rows, rollout=rollout, rewards=per_fn, stats=stats,
                         timings=timings, extra_columns=columns, dropped=dropped, grades=grades)


def finish_batch(ctx: PipelineContext, record: RolloutRecord, weighting: WeightingSettings) -> PreparedBatch | Skipped:
    """The trainer's half: the producer's rollouts scored, weighted (with the live tau and beta of
    ``weighting``, the run's ``TrainState.weighting``) and ready for the step, or the :class:`Skipped`
    that says why the batch does not train (the loop counts it).

    Two sync points, reached by every rank whatever happened locally, keep a
    multi-process run in step: after rollout and rewards (any failure skips the
    batch everywhere; every rank keeps the same number of groups, so the
    optimizer step runs the same number of micro-batches), and after scoring.
    """
    failed_anywhere, common = ctx.dist.any_and_min(record.failure is not None, len(record.rows))
    if failed_anywhere:
        return record.failure or OTHER_RANK
    rows, rollout, per_fn, timings = record.rows, record.rollout, record.rewards, dict(record.timings)
    columns = record.extra_columns
    if common < len(rows):
        rows, rollout = rows[:common], select_groups(rollout, list(range(common)))
        per_fn = per_fn[: common * rollout.num_generations]
        columns = {k: v[: common * rollout.num_generations] for k, v in columns.items()}
    try:
        outcome = _score_and_weight(ctx, weighting, rows, rollout, per_fn, record.stats, timings, columns,
                                    record.grades)
        outcome.version = record.version
    except SkipBatch as err:
        outcome = err.skipped
    skipped_here = isinstance(outcome, Skipped)
    if ctx.dist.any_rank(skipped_here):
        return outcome if skipped_here else OTHER_RANK
    return outcome


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
    and beta of the run's ``TrainState.weighting``), for the optimizer ``step`` (0-based; the reward
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


def _score_and_weight(ctx: PipelineContext, weighting: WeightingSettings, rows, rollout, per_fn, stats, timings,
                      columns, grades: Grades) -> PreparedBatch:
    b, method = ctx.plan.batch, ctx.plan.method
    packed = pack_rollout(rollout, ctx.tokenizer.pad_token_id, device=ctx.dist.device)
    if b.mask_truncated_completions:
        packed.completion_mask[packed.truncated] = 0.0
    g = rollout.num_generations
    t1 = time.perf_counter()
    try:
        keys = [answer_key(rows[i // g], text, grades) for i, text in enumerate(rollout.completion_texts)]
    except Unscorable as err:  # never a wrong answer (ALGORITHMS.md §18): the batch is skipped
        raise SkipBatch("verifier", str(err)) from err
    seed = None
    if method.reward_scaling is not None:
        try:
            seed = method.reward_scaling(RewardScalingInputs(
                answer_keys=keys, behaviour_logps=packed.behaviour_logps, completion_mask=packed.completion_mask,
                num_generations=g,
            ))
        except ValueError as err:
            raise SkipBatch("reward_scaling", str(err)) from err
    rs = b.reward_stats
    counts = packed.completion_mask.sum(1).cpu()
    try:
        reward_comp = compute_reward_statistics(
            per_fn, ctx.reward_spec.weight_tensor(), g,
            names=ctx.reward_spec.names,
            q_temperature=rs.q_temperature,
            q_epsilon=rs.q_epsilon,
            scale_rewards=rs.scale_rewards,
            advantage_estimator=rs.advantage_estimator,
            truncated=packed.truncated.cpu(),
            zero_truncated_completion_rewards=b.zero_truncated_completion_rewards,
            seed_grpo=seed,
            token_counts=counts,
            aggregation=rs.aggregation,
        )
    except NonBinaryRewardError as err:  # the reward set does not fit loss.advantage_estimator (maxrl)
        # Skipped on every rank like a failing reward function; max_consecutive_skips stops the run.
        raise SkipBatch("reward", f"{err}; use 0/1 reward functions only (e.g. boxed_accuracy alone)") from err
    if b.policy_entropy_bonus_coef > 0:
        reward_comp = apply_policy_entropy_bonus(reward_comp, _policy_entropy(ctx, packed), b.policy_entropy_bonus_coef)
    timings["time/reward"] += time.perf_counter() - t1
    t2 = time.perf_counter()
    ref_logps = None
    if ctx.reference_logps is not None:
        ref_logps = ctx.reference_logps(packed.input_ids, packed.attention_mask, packed.prompt_length)
        if not torch.isfinite(ref_logps).all():
            raise SkipBatch("reference", "non-finite reference log-probs")
    timings["time/reference"] = time.perf_counter() - t2
    teacher_logps = None
    if ctx.teacher_logps is not None:
        t3 = time.perf_counter()
        teacher_logps = ctx.teacher_logps(rows, packed.input_ids, packed.attention_mask, packed.prompt_length)
        if not torch.isfinite(teacher_logps).all():
            raise SkipBatch("teacher", "non-finite teacher log-probs")
        timings["time/teacher"] = time.perf_counter() - t3
    targets = method.targets(TargetInputs(
        weighting=weighting, reward_comp=reward_comp, completion_texts=rollout.completion_texts,
        answer_keys=keys, num_generations=g, lengths=counts,
        ref_logp_sum=None if ref_logps is None else (ref_logps * packed.completion_mask).sum(1).cpu(),
    ))
    groups = [rollout.completion_ids[i : i + g] for i in range(0, len(rollout.completion_ids), g)]
    return PreparedBatch(
        extra_columns=columns,
        rows=rows,
        rollout=rollout,
        packed=packed,
        reward_comp=reward_comp,
        # teacher.rewards false: distillation alone, the rewards only logged.
        advantages=reward_comp.advantages if b.reward_advantages else torch.zeros_like(reward_comp.advantages),
        ref_logps=ref_logps,
        teacher_logps=teacher_logps,
        weight_stats=targets.weight_stats,
        listwise_active=targets.listwise_active,
        row_weights=targets.row_weights,
        diversity=group_diversity(groups),
        stats=stats,
        timings=timings,
        grades=grades,
    )
