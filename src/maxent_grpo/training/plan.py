"""``compile_run(cfg) -> RunPlan``: the configuration, compiled once into the typed records the run uses.

The CLI and ``load_config`` read YAML into :class:`TrainConfig`; ``compile_run``
turns it, after presets and coercion, into plain records: the method's plan (its
:class:`LossSpec` and hooks), how the model is scored, and how a batch is
prepared. The loop and the pipeline read these, never the config's loss, method
or generation sections. Each bound lives in the record that holds the value
(``ClipSettings``, ``LossSpec``, a loss's params); a violation is re-raised here
as one :class:`ConfigError` naming the dotted key the user wrote.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from maxent_grpo.core.logprobs import Scoring
from maxent_grpo.core.bounds import SpecError
from maxent_grpo.core.losses import ClipSettings
from maxent_grpo.core.step import LossSpec
from maxent_grpo.data.prompts import FewShotExample
from maxent_grpo.envs.episodes import EpisodeLimits
from maxent_grpo.envs.settings import episode_limits
from maxent_grpo.errors import ConfigError
from maxent_grpo.methods import MethodPlan, PlanInputs, get_method
from maxent_grpo.rewards.maxent import RewardStatsSettings
from maxent_grpo.rollout.backend import SamplingParams
from maxent_grpo.training.config_schema import TrainConfig


@dataclass(frozen=True)
class BatchPlan:
    """How the pipeline prepares one batch (``training/pipeline.py``)."""

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


@dataclass(frozen=True)
class RunPlan:
    """Everything below the CLI needs from the configuration, in typed records.

    ``method.loss`` is the step's :class:`LossSpec` (its ``beta`` is the configured one; the KL
    controller's live value replaces it each step when ``method.kl_in_token_loss``).
    """

    method: MethodPlan
    scoring: Scoring
    batch: BatchPlan
    micro_batch_size: int
    num_iterations: int
    max_grad_norm: float | None


# The LossSpec / ClipSettings field each loss key of the config sets (the rest are loss.<field>).
_KEYS = {
    "epsilon_low": "loss.epsilon",
    "listwise_clip_coef": "maxent.listwise_clip_coef",
    "max_completion_length": "generation.max_new_tokens",
}


def completion_budget(cfg: TrainConfig) -> int:
    """The most tokens a completion's loss counts: the model's tokens of an episode, else max_new_tokens."""
    limits = episode_limits(cfg.environment, cfg.generation.max_new_tokens)
    return cfg.generation.max_new_tokens if limits is None else limits.max_model_tokens


_SPEC_FIELDS = {f.name for f in dataclasses.fields(LossSpec)}


def _base_loss(cfg: TrainConfig) -> LossSpec:
    lo = cfg.loss
    try:
        clip = ClipSettings(
            epsilon_low=lo.epsilon, epsilon_high=lo.epsilon if lo.epsilon_high is None else lo.epsilon_high,
            delta=lo.delta, dual_clip=lo.dual_clip, importance_sampling_level=lo.importance_sampling_level,
        )
        return LossSpec(
            loss_type=lo.loss_type, clip=clip, beta=lo.beta, kl_estimator=lo.kl_estimator,
            entropy_coef=lo.entropy_coef, top_entropy_quantile=lo.top_entropy_quantile,
            # "auto" is resolved by training/precision.py before the run compiles; a config
            # checked before that (load_config) has its bounds checked as if it were off.
            rollout_correction="none" if lo.rollout_correction == "auto" else lo.rollout_correction,
            rollout_correction_cap=lo.rollout_correction_cap,
            seq_logprob_error_threshold=lo.seq_logprob_error_threshold,
            max_completion_length=completion_budget(cfg),
        )
    except SpecError as err:
        raise ConfigError(f"{_KEYS.get(err.setting, 'loss.' + err.setting)}: {err.problem}") from None


def plan_inputs(cfg: TrainConfig) -> PlanInputs:
    """The plain values the configured method plans from."""
    method = get_method(cfg.method)
    return PlanInputs(
        loss=_base_loss(cfg),
        settings=getattr(cfg, method.section) if method.section is not None else None,
        maxent=cfg.maxent, num_generations=cfg.generation.num_generations,
        micro_batch_size=cfg.training.micro_batch_size, max_new_tokens=completion_budget(cfg),
    )


def compile_method(cfg: TrainConfig) -> MethodPlan:
    """The configured method's plan; its checks and its loss's bounds raise one ConfigError naming the key."""
    method = get_method(cfg.method)
    inputs = plan_inputs(cfg)
    for key, problem in method.check(inputs):
        raise ConfigError(f"{key}: {problem}")
    try:
        return method.plan(inputs)
    except SpecError as err:
        # The clip was checked with the loss: section; a LossSpec field the method set is still a
        # loss: key (its combination with the method failed), anything else is the method's own.
        if err.setting in _SPEC_FIELDS or method.section is None:
            key = _KEYS.get(err.setting, f"loss.{err.setting}")
        else:
            key = f"{method.section}.{err.setting}"
        raise ConfigError(f"{key}: {err.problem}") from None


def compile_run(cfg: TrainConfig) -> RunPlan:
    """Compile ``cfg`` (presets applied, values coerced: ``load_config``'s result) into a :class:`RunPlan`."""
    g, t, lo = cfg.generation, cfg.training, cfg.loss
    batch = BatchPlan(
        num_generations=g.num_generations,
        prompts_per_step=t.prompts_per_step,
        system_prompt=cfg.data.system_prompt,
        few_shot=tuple(cfg.data.few_shot),
        sampling=SamplingParams(max_new_tokens=g.max_new_tokens, temperature=g.temperature, top_p=g.top_p,
                                top_k=g.top_k, stop=tuple(g.stop)),
        max_retry_rounds=g.max_retry_rounds,
        dynamic_sampling=lo.dynamic_sampling,
        max_gen_batches=lo.max_gen_batches,
        mask_truncated_completions=lo.mask_truncated_completions,
        zero_truncated_completion_rewards=lo.zero_truncated_completion_rewards,
        reward_stats=RewardStatsSettings(
            q_temperature=cfg.maxent.q_temperature, q_epsilon=cfg.maxent.q_epsilon,
            scale_rewards=lo.scale_rewards, advantage_estimator=lo.advantage_estimator,
        ),
        policy_entropy_bonus_coef=lo.policy_entropy_bonus_coef,
        episodes=episode_limits(cfg.environment, g.max_new_tokens),
    )
    return RunPlan(
        method=compile_method(cfg),
        # autocast_bf16 and share_prompts are resolved from "auto" by training/precision.py before the run compiles.
        scoring=Scoring(temperature=g.temperature, share_prompts=t.share_prompts is True,
                        autocast_bf16=t.autocast_bf16 is True, rows_per_pass=t.micro_batch_size),
        batch=batch,
        micro_batch_size=t.micro_batch_size,
        num_iterations=t.num_iterations,
        max_grad_norm=t.max_grad_norm,
    )


def with_beta(plan: RunPlan, beta: float) -> LossSpec:
    """The step's loss spec with the KL controller's current beta (unchanged when beta acts in the targets)."""
    loss = plan.method.loss
    return dataclasses.replace(loss, beta=beta) if plan.method.kl_in_token_loss else loss


def describe_rollout_correction(loss: LossSpec) -> str:
    """One line for the start of a run: which sampler -> trainer weight the policy term gets."""
    if loss.rollout_correction == "none":
        return "none (the policy term uses no sampler -> trainer importance weight)"
    action = "truncated at" if loss.rollout_correction.endswith("truncate") else "masked above"
    level = loss.rollout_correction.split("_")[0]
    return f"{loss.rollout_correction}: {level}-level ratio trainer/sampler {action} C={loss.rollout_correction_cap:g}"
