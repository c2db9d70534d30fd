"""The batch's stages, in the order they run: one batch is a :class:`Draft` that each stage,
``(ctx, draft) -> draft``, reads and adds to (``training/pipeline.py`` runs them).

The stages register themselves below (:func:`stage`, into :data:`STAGES`), in three parts:

* ``sampling``: generation (with retries) or multi-turn episodes. It touches neither the policy's
  gradients nor any collective, so a sampler beside the trainer may run it in a thread;
* ``rewarding``: the reward functions, and dynamic sampling's further rounds (DAPO). With sampling,
  the producer's half of a batch, run now or ``rollout.max_staleness`` steps ahead;
* ``scoring``: the trainer's half, at the step: the answer keys, SEED scales, reward statistics
  (advantages, q), the reward-side entropy bonus, the reference and teacher log-probs and the
  method's weighting.

A stage that fails for this batch raises :class:`SkipBatch` with its stage's name; :func:`run_stages`,
the one place that catches it, turns it into the :class:`Skipped` value that travels on instead of
the batch. Nothing is silently trained on.
"""

from __future__ import annotations

import logging
import time
from collections import Counter
from dataclasses import dataclass, field
from typing import Callable

import torch

from maxent_grpo.core.advantages import NonBinaryRewardError, combine_rewards, zero_std_groups
from maxent_grpo.data.prompts import format_prompt, prompt_messages
from maxent_grpo.envs.episodes import EpisodePlay, run_episodes
from maxent_grpo.methods import MethodTargets, RewardScalingInputs, TargetInputs
from maxent_grpo.rewards.context import RewardContext, TrainerState
from maxent_grpo.rewards.maxent import RewardComputation, SeedGrpoInputs, WeightingSettings, apply_policy_entropy_bonus
from maxent_grpo.rewards.maxent.reward_stats import reward_statistics
from maxent_grpo.rewards.registry import RewardFunctionError, RewardSpec, evaluate_rewards, rollout_reward_inputs
from maxent_grpo.rollout.backend import (
    GenerationBackend,
    PackedRollout,
    RolloutBatch,
    SamplerGone,
    SamplerLost,
    SamplingParams,
    concat_rollouts,
    generate_groups,
    pack_rollout,
    select_groups,
)
from maxent_grpo.rollout.data_plane import Skipped
from maxent_grpo.tasks.modebench import answer_key
from maxent_grpo.tasks.modebench_package import Grades, Unscorable
from maxent_grpo.training.distributed import Dist
from maxent_grpo.training.run_plan import RunPlan

log = logging.getLogger("maxent_grpo")


class SkipBatch(Exception):
    """Raised inside a stage that failed for this batch, with the stage's name (the ``skipped/<stage>``
    counter); :func:`run_stages` turns it into the :class:`Skipped` value the batch becomes."""

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
    # The backend can lose its server and get it back (rollout.backends.Backend.recovers_lost_server):
    # each batch's sampling ends with every process agreeing whether one lost it (pipeline.settle_sampling).
    recovers_lost_server: bool = False


# ----------------------------------------------------------------- the batch on its way

@dataclass
class Draft:
    """One batch between its stages: what it is drawn from, then what each stage has added. Prompt-major
    ``[P*G]`` rows; a stage reads the fields its predecessors in :data:`STAGES` set, and sets its own."""

    rows: list[dict]  # the prompt rows (after generation: those whose groups are complete)
    step: int  # the optimizer step it trains (0-based; the reward functions' trainer_state)
    version: int  # the policy version (optimizer steps taken) that samples it
    params: SamplingParams
    more_rows: Callable[[], list[dict]] | None = None  # dynamic sampling's further rows
    started: float = field(default_factory=time.perf_counter)  # when generation began
    # sampling
    rollout: RolloutBatch | None = None
    environments: list | None = None  # multi-turn: each completion's environment (the rewards' keyword)
    dropped: Counter = field(default_factory=Counter)  # groups left out, by cause (RolloutRecord.dropped)
    stats: dict[str, float] = field(default_factory=dict)
    timings: dict[str, float] = field(default_factory=lambda: {"time/reward": 0.0})
    # rewarding
    rewards: torch.Tensor | None = None  # [N, F] per reward function
    columns: dict[str, list] = field(default_factory=dict)  # the reward functions' log_extra columns
    grades: Grades = field(default_factory=Grades)  # each completion graded once (reward, keys, replay)
    # scoring
    weighting: WeightingSettings | None = None  # the live tau and beta (the plan's, with the run's TrainState.controllers)
    packed: PackedRollout | None = None
    answer_keys: list | None = None
    seed_scales: SeedGrpoInputs | None = None  # SEED-GRPO's reward scaling (method.reward_scaling), None without
    reward_comp: RewardComputation | None = None
    ref_logps: torch.Tensor | None = None  # [N, T]
    teacher_logps: torch.Tensor | None = None  # [N, T]
    targets: MethodTargets | None = None


@dataclass(frozen=True)
class Stage:
    """A registered stage: its part (``sampling``, ``rewarding``, ``scoring``), when it applies to a run,
    and the timing its seconds add to."""

    name: str
    part: str
    run: Callable[[PipelineContext, Draft], Draft]
    applies: Callable[[PipelineContext], bool]
    timing: str | None


STAGES: list[Stage] = []  # in the order they run


def stage(name: str, part: str, *, applies: Callable[[PipelineContext], bool] = lambda ctx: True,
          timing: str | None = None):
    """Register ``(ctx, draft) -> draft`` as stage ``name`` of ``part``, after those registered before it."""

    def register(fn: Callable[[PipelineContext, Draft], Draft]):
        STAGES.append(Stage(name, part, fn, applies, timing))
        return fn

    return register


def run_stages(ctx: PipelineContext, draft: Draft, part: str) -> Draft | Skipped:
    """``draft`` through the stages of ``part`` that apply to this run; the :class:`Skipped` of the
    first that raises :class:`SkipBatch` (the only place it is caught)."""
    for s in STAGES:
        if s.part != part or not s.applies(ctx):
            continue
        t0 = time.perf_counter()
        try:
            draft = s.run(ctx, draft)
        except SkipBatch as err:
            return err.skipped
        finally:
            if s.timing is not None:
                draft.timings[s.timing] = draft.timings.get(s.timing, 0.0) + time.perf_counter() - t0
    return draft


# ----------------------------------------------------------------- sampling

@stage("generation", "sampling")
def generate(ctx: PipelineContext, d: Draft) -> Draft:
    """The rows' groups of ``num_generations`` completions (or, with environments, their episodes);
    a group that stays incomplete after the retries leaves with its row."""
    if ctx.episodes is not None:
        return _play_episodes(ctx, ctx.episodes, d)
    b = ctx.plan.batch
    prompts = [format_prompt(ctx.tokenizer, r["prompt"], system_prompt=b.system_prompt, few_shot=list(b.few_shot))
               for r in d.rows]
    try:
        d.rollout, dropped = generate_groups(
            ctx.backend, prompts, b.num_generations, d.params, max_retry_rounds=b.max_retry_rounds,
        )
    except (SamplerLost, SamplerGone):
        raise  # not this batch's fault: sampled again, or the run stops (pipeline.settle_sampling)
    except (RuntimeError, ValueError) as err:
        raise SkipBatch("generation", str(err)) from err
    if dropped:
        d.rows = [r for i, r in enumerate(d.rows) if i not in set(dropped)]
        d.dropped["incomplete_groups"] += len(dropped)
    if not d.rows:
        raise SkipBatch("generation", "every prompt came back with fewer than num_generations completions")
    return d


def _play_episodes(ctx: PipelineContext, play: EpisodePlay, d: Draft) -> Draft:
    """Multi-turn rollouts (envs/episodes.py): a row whose episodes failed leaves with its group."""
    b = ctx.plan.batch
    try:
        played = run_episodes(
            ctx.backend, ctx.tokenizer, d.rows, [play.environments.factory(r) for r in d.rows], b.num_generations,
            d.params, play.limits,
            frame=lambda m: prompt_messages(m, system_prompt=b.system_prompt, few_shot=list(b.few_shot)),
        )
    except (SamplerLost, SamplerGone):
        raise
    except (RuntimeError, ValueError) as err:
        raise SkipBatch("generation", str(err)) from err
    if played.failures:
        log.warning("%d episode(s) failed, their groups dropped; first: %s", len(played.failures), played.failures[0])
        d.dropped["failed_episodes"] += len(played.failures)
    if not played.kept_rows:
        raise SkipBatch("environment", f"every group had a failed episode; first: {played.failures[0]}")
    d.rows, d.rollout, d.environments = [d.rows[i] for i in played.kept_rows], played.rollout, played.environments
    d.stats.update(played.stats)
    return d


# ----------------------------------------------------------------- rewarding

@stage("reward", "rewarding", timing="time/reward")
def reward(ctx: PipelineContext, d: Draft) -> Draft:
    """Every reward function on every completion (``[N, F]``, NaN where one returned None), with what
    they logged: ``log_metric`` means into the stats, ``log_extra`` columns for the completion table."""
    state = TrainerState(global_step=d.step, max_steps=ctx.plan.schedule.max_steps,
                         epoch=d.step / ctx.steps_per_epoch if ctx.steps_per_epoch else 0.0)
    context = RewardContext(d.rollout.num_completions, state, d.environments, mode_grades=d.grades)
    try:
        d.rewards = evaluate_rewards(ctx.reward_spec, *rollout_reward_inputs(d.rows, d.rollout), context)
    except RewardFunctionError as err:
        raise SkipBatch("reward", str(err)) from err
    if torch.isnan(d.rewards).all():
        raise SkipBatch("reward", f"every reward function returned None for all {d.rewards.shape[0]} completions")
    d.stats.update(context.metric_means())
    d.columns = dict(context.extra_columns)
    return d


@stage("dynamic_sampling", "rewarding", applies=lambda ctx: ctx.plan.batch.dynamic_sampling)
def dynamic_sampling(ctx: PipelineContext, d: Draft) -> Draft:
    """DAPO's dynamic sampling (§9): keep only groups whose rewards vary, sampling further rounds (from
    the current weights, ``more_rows``) until ``prompts_per_step`` groups are kept or
    ``max_gen_batches`` rounds are spent."""
    b = ctx.plan.batch
    g, target = d.rollout.num_generations, b.prompts_per_step
    rounds: list[tuple[Draft, list[int]]] = []
    seen, current = 0, d
    for round_idx in range(b.max_gen_batches):
        if round_idx > 0:
            if d.more_rows is None:
                break
            current = Draft(d.more_rows(), d.step, d.version, b.sampling, started=d.started, timings=d.timings,
                            grades=d.grades)
            try:
                current = reward_timed(ctx, generate(ctx, current))
            except (SamplerLost, SamplerGone) as err:  # the next batch's sampling restores the weights, or stops
                raise SkipBatch("dynamic_sampling", f"a further round lost the generation server: {err}") from err
            d.stats.update(current.stats)
            d.dropped.update(current.dropped)
        seen += len(current.rows)
        flat = zero_std_groups(combine_rewards(current.rewards, ctx.reward_spec.weight_tensor()), g)
        rounds.append((current, [i for i in range(len(current.rows)) if not bool(flat[i])]))
        if sum(len(keep) for _, keep in rounds) >= target:
            break
    else:
        log.warning("dynamic sampling: %d of %d groups after %d rounds",
                    sum(len(keep) for _, keep in rounds), target, b.max_gen_batches)
    rows = [r.rows[i] for r, keep in rounds for i in keep][:target]
    if not rows:
        raise SkipBatch("dynamic_sampling", "no group with varied rewards")
    n = len(rows) * g
    d.rollout = select_groups(concat_rollouts([select_groups(r.rollout, keep) for r, keep in rounds]),
                              list(range(len(rows))))
    d.rewards = torch.cat([r.rewards.view(len(r.rows), g, -1)[keep].reshape(-1, r.rewards.shape[1])
                           for r, keep in rounds])[:n]
    d.columns = _kept_columns(rounds, g, n)
    d.rows = rows
    d.stats["dynamic_sampling/groups_seen"] = float(seen)
    return d


def reward_timed(ctx: PipelineContext, d: Draft) -> Draft:
    """:func:`reward` with its seconds added to ``time/reward`` (a round inside dynamic sampling)."""
    t0 = time.perf_counter()
    try:
        return reward(ctx, d)
    finally:
        d.timings["time/reward"] += time.perf_counter() - t0


def _kept_columns(rounds: list[tuple[Draft, list[int]]], g: int, n: int) -> dict[str, list]:
    """The ``log_extra`` columns of the kept groups of each round, in order (None where a round logged none)."""
    names = sorted({c for r, _ in rounds for c in r.columns})
    out: dict[str, list] = {}
    for name in names:
        values: list = []
        for r, keep in rounds:
            column = r.columns.get(name)
            values += [None if column is None else column[i * g + j] for i in keep for j in range(g)]
        out[name] = values[:n]
    return out


# ----------------------------------------------------------------- scoring

@stage("pack", "scoring")
def pack(ctx: PipelineContext, d: Draft) -> Draft:
    """The rollout as padded tensors on the trainer's device; truncated completions masked out when
    ``mask_truncated_completions``."""
    d.packed = pack_rollout(d.rollout, ctx.tokenizer.pad_token_id, device=ctx.dist.device)
    if ctx.plan.batch.mask_truncated_completions:
        d.packed.completion_mask[d.packed.truncated] = 0.0
    return d


@stage("verifier", "scoring", timing="time/reward")
def answer_keys(ctx: PipelineContext, d: Draft) -> Draft:
    """Each completion's answer key (the modebench task's verifier; what listwise methods and SEED group
    by). An answer the verifier cannot score skips the batch: it is never a wrong answer (§18)."""
    g = d.rollout.num_generations
    try:
        d.answer_keys = [answer_key(d.rows[i // g], text, d.grades) for i, text in enumerate(d.rollout.completion_texts)]
    except Unscorable as err:
        raise SkipBatch("verifier", str(err)) from err
    return d


@stage("reward_scaling", "scoring", applies=lambda ctx: ctx.plan.method.reward_scaling is not None,
       timing="time/reward")
def reward_scaling(ctx: PipelineContext, d: Draft) -> Draft:
    """The method's reward scaling (SEED-GRPO's semantic-entropy scales)."""
    try:
        d.seed_scales = ctx.plan.method.reward_scaling(RewardScalingInputs(
            answer_keys=d.answer_keys, behaviour_logps=d.packed.behaviour_logps,
            completion_mask=d.packed.completion_mask, num_generations=d.rollout.num_generations,
        ))
    except ValueError as err:
        raise SkipBatch("reward_scaling", str(err)) from err
    return d


@stage("reward_stats", "scoring", timing="time/reward")
def group_statistics(ctx: PipelineContext, d: Draft) -> Draft:
    """Advantages, the listwise target q and the group statistics (``compute_reward_statistics``)."""
    try:
        d.reward_comp = reward_statistics(
            d.rewards, ctx.reward_spec.weight_tensor(), d.rollout.num_generations, ctx.plan.batch.reward_stats,
            names=ctx.reward_spec.names, truncated=d.packed.truncated.cpu(),
            zero_truncated_completion_rewards=ctx.plan.batch.zero_truncated_completion_rewards,
            seed_grpo=d.seed_scales, token_counts=d.packed.completion_mask.sum(1).cpu(),
        )
    except NonBinaryRewardError as err:  # the reward set does not fit loss.advantage_estimator (maxrl)
        # Skipped on every rank like a failing reward function; max_consecutive_skips stops the run.
        raise SkipBatch("reward", f"{err}; use 0/1 reward functions only (e.g. boxed_accuracy alone)") from err
    return d


@stage("policy_entropy_bonus", "scoring", applies=lambda ctx: ctx.plan.batch.policy_entropy_bonus_coef > 0,
       timing="time/reward")
def policy_entropy_bonus(ctx: PipelineContext, d: Draft) -> Draft:
    """The reward-side entropy bonus: each completion's mean token entropy under the policy, added to its reward."""
    p = d.packed
    _, ent = ctx.plan.scoring.score_rows(ctx.model, p.input_ids, p.attention_mask, p.prompt_length, with_entropy=True)
    m = p.completion_mask
    entropy = ((ent * m).sum(1) / m.sum(1).clamp(min=1)).cpu()
    d.reward_comp = apply_policy_entropy_bonus(d.reward_comp, entropy, ctx.plan.batch.policy_entropy_bonus_coef)
    return d


@stage("reference", "scoring", timing="time/reference")  # its time logged 0 without a reference
def reference(ctx: PipelineContext, d: Draft) -> Draft:
    """The completions' log-probs under the frozen reference (the KL term, and methods that read them)."""
    if ctx.reference_logps is None:
        return d
    p = d.packed
    d.ref_logps = ctx.reference_logps(p.input_ids, p.attention_mask, p.prompt_length)
    if not torch.isfinite(d.ref_logps).all():
        raise SkipBatch("reference", "non-finite reference log-probs")
    return d


@stage("teacher", "scoring", applies=lambda ctx: ctx.teacher_logps is not None, timing="time/teacher")
def teacher(ctx: PipelineContext, d: Draft) -> Draft:
    """The completions' log-probs under on-policy distillation's teacher."""
    p = d.packed
    d.teacher_logps = ctx.teacher_logps(d.rows, p.input_ids, p.attention_mask, p.prompt_length)
    if not torch.isfinite(d.teacher_logps).all():
        raise SkipBatch("teacher", "non-finite teacher log-probs")
    return d


@stage("weighting", "scoring")
def weighting(ctx: PipelineContext, d: Draft) -> Draft:
    """The method's targets: listwise weights, active groups, per-row multipliers (with the live tau and beta)."""
    p = d.packed
    d.targets = ctx.plan.method.targets(TargetInputs(
        weighting=d.weighting, reward_comp=d.reward_comp, completion_texts=d.rollout.completion_texts,
        answer_keys=d.answer_keys, num_generations=d.rollout.num_generations, lengths=p.completion_mask.sum(1).cpu(),
        ref_logp_sum=None if d.ref_logps is None else (d.ref_logps * p.completion_mask).sum(1).cpu(),
    ))
    return d
