"""The compiled plan's records: :class:`RunPlan` and what completes it at run time.

``config/compile.py``'s ``compile_run`` builds a :class:`RunPlan` once, in the CLI; the run (setup,
loop, pipeline, evaluation) reads these records and never the configuration schema. The plan is
completed once the data is read (:func:`with_run_length`), and the step's loss takes the KL
controller's live beta (:func:`with_beta`).
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import Any

from maxent_grpo.core.entropy_control import AdaptiveEntropy
from maxent_grpo.core.logprobs import Scoring
from maxent_grpo.core.reference_sync import RefSync
from maxent_grpo.core.rollout_correction import correction_parts
from maxent_grpo.core.step import LossSpec
from maxent_grpo.data.prompts import FewShotExample
from maxent_grpo.envs.episodes import EpisodeLimits
from maxent_grpo.errors import ConfigError
from maxent_grpo.methods import MethodPlan
from maxent_grpo.rewards.maxent import RewardStatsSettings, WeightingSettings
from maxent_grpo.rewards.registry import RewardEntry
from maxent_grpo.rollout.backend import SamplingParams
from maxent_grpo.rollout.settings import RolloutConfig
from maxent_grpo.training.data import DataPlan
from maxent_grpo.training.policy import ModelPlan, OptimizerPlan
from maxent_grpo.training.replay import ReplayConfig
from maxent_grpo.training.sampler import SamplerPlan
from maxent_grpo.training.schedule import LoggingPlan, Schedule
from maxent_grpo.training.teacher import TeacherPlan
from maxent_grpo.training.validation import EvalPlan


@dataclass(frozen=True)
class BatchPlan:
    """How the stages prepare one batch (``training/stages.py``, run by ``training/pipeline.py``)."""

    num_generations: int
    prompts_per_step: int  # per process
    system_prompt: str | None
    few_shot: tuple[FewShotExample, ...]
    sampling: SamplingParams
    max_retry_rounds: int
    dynamic_sampling: bool
    max_gen_batches: int
    mask_truncated_completions: bool
    zero_truncated_completion_rewards: bool
    reward_stats: RewardStatsSettings
    policy_entropy_bonus_coef: float
    episodes: EpisodeLimits | None = None  # multi-turn episodes (environment:); None: one-shot prompts
    reward_advantages: bool = True  # false (teacher.rewards): the advantages are 0, the teacher's term alone trains


@dataclass(frozen=True)
class RunPlan:
    """Everything below the CLI needs from the configuration, in typed records.

    ``method.loss`` is the step's :class:`LossSpec` (its ``beta`` is the configured one; the KL
    controller's live value replaces it each step when ``method.kl_in_token_loss``). ``weighting``
    holds the MaxEnt settings at the start of the run (the run keeps a live copy). ``source`` is the
    configuration as data, ``notes`` what each ``auto`` became.
    """

    method: MethodPlan
    scoring: Scoring
    batch: BatchPlan
    micro_batch_size: int  # rows per forward/backward; with micro_batch_from_memory, the passes without gradients
    # training.micro_batch_size: auto on CUDA: each step's rows come from the memory left once the models
    # load (training/micro_batches.py; the run's MicroBatchBudget)
    micro_batch_from_memory: bool
    release_host_memory: bool  # training/host_memory.py, before each micro-batch's passes (the CPU)
    num_iterations: int
    max_grad_norm: float | None
    data: DataPlan
    model: ModelPlan
    sampler: SamplerPlan
    optimizer: OptimizerPlan
    rollout: RolloutConfig
    schedule: Schedule
    logging: LoggingPlan
    eval: EvalPlan
    weighting: WeightingSettings
    rewards: tuple[RewardEntry, ...]
    replay: ReplayConfig  # verified mode replay (training/replay.py); replay.enabled false: none
    adaptive_entropy: AdaptiveEntropy | None  # the entropy coefficient's controller (loss.adaptive_entropy)
    ref_sync: RefSync | None  # TR-DPO's reference update (loss.sync_ref_model); None: a frozen reference
    teacher: TeacherPlan | None  # on-policy distillation's teacher (teacher.name_or_path); its term is method.loss.distill
    strategy: str  # a name training/strategy.py registers
    dist_timeout_minutes: float
    seed: int
    source: dict[str, Any]
    notes: tuple[str, ...]

    def global_batch(self, processes: int) -> str:
        """One line for the start of a run: what one optimizer step trains on."""
        p, g = self.batch.prompts_per_step, self.batch.num_generations
        return (f"global batch: {p} prompts x {processes} process(es) x {g} completions = {p * processes * g} "
                f"completions per optimizer step (micro-batches of "
                f"{'whole groups sized from memory' if self.micro_batch_from_memory else self.micro_batch_size}, "
                f"{self.num_iterations} pass(es))")



def with_run_length(plan: RunPlan, train_rows: int, processes: int) -> RunPlan:
    """The plan completed once the data is read: a run whose config left ``training.max_steps`` null
    is ``data.num_epochs`` passes of ``train_rows // (prompts_per_step x processes)`` steps (the
    sampler drops each epoch's last incomplete batch). A plan that has its length is returned as is."""
    s = plan.schedule
    if s.max_steps is not None:
        return plan
    steps = s.num_epochs * (train_rows // (plan.batch.prompts_per_step * processes))
    if steps < 1:
        raise ConfigError(f"training.max_steps: null gives 0 steps: {train_rows} training rows hold no batch of "
                          f"{plan.batch.prompts_per_step} prompts x {processes} process(es)")
    return with_steps(plan, steps)


def with_steps(plan: RunPlan, steps: int) -> RunPlan:
    """``steps`` optimizer steps: the LR schedule spans their updates, and a ``warmup_ratio`` becomes
    warm-up updates (rounded up, as transformers does)."""
    o = plan.optimizer
    updates = steps * plan.num_iterations
    warmup = math.ceil(o.warmup_ratio * updates) if o.warmup_ratio else o.warmup_steps
    return dataclasses.replace(plan, schedule=dataclasses.replace(plan.schedule, max_steps=steps),
                               optimizer=dataclasses.replace(o, total_updates=updates, warmup_steps=warmup))


def with_beta(plan: RunPlan, beta: float) -> LossSpec:
    """The step's loss spec with the KL controller's current beta (unchanged when beta acts in the targets)."""
    loss = plan.method.loss
    return dataclasses.replace(loss, beta=beta) if plan.method.kl_in_token_loss else loss


def describe_rollout_correction(loss: LossSpec) -> str:
    """One line for the start of a run: which sampler -> trainer weight the policy term gets."""
    if loss.rollout_correction == "none":
        return "none (the policy term uses no sampler -> trainer importance weight)"
    level, kind = correction_parts(loss.rollout_correction)
    action = "truncated at" if kind == "truncate" else "masked above"
    return f"{loss.rollout_correction}: {level}-level ratio trainer/sampler {action} C={loss.rollout_correction_cap:g}"
