"""``compile_run(cfg, machine) -> RunPlan``: the configuration, compiled once into the typed records the run uses.

The CLI reads YAML into :class:`TrainConfig` (``config/load.py``: presets, coercion, each
key's own checks); ``compile_run`` is the only reader of it after that. It resolves every
``auto`` against the :class:`Machine` (a pure step, ``training/precision.py``), checks the rules
between sections (``config/rules.py``), and builds one record per component, each
defined beside the code that consumes it: the method's plan (its :class:`LossSpec` and hooks),
scoring, the batch, the data, the model, the sampler, the optimizer, the rollout queue, the
loop's schedule, logging, in-loop evaluation and the MaxEnt weighting. Each bound lives in the
record that holds the value (``ClipSettings``, ``LossSpec``, a loss's params); a violation is
re-raised here as one :class:`ConfigError` naming the dotted key the user wrote. The run keeps
the configuration only as data (``RunPlan.source``): saved with the run, its checkpoints and
trackers, and compared on resume.
"""

from __future__ import annotations

import dataclasses

from maxent_grpo.core.distill import DistillTerm
from maxent_grpo.core.entropy_control import AdaptiveEntropy
from maxent_grpo.core.logprobs import Scoring
from maxent_grpo.core.reference_sync import RefSync
from maxent_grpo.core.losses import ClipSettings
from maxent_grpo.core.step import LossSpec
from maxent_grpo.envs.settings import episode_limits
from maxent_grpo.errors import ConfigError
from maxent_grpo.methods import MethodPlan, PlanInputs, get_method
from maxent_grpo.models import master_dtype
from maxent_grpo.rewards.maxent import (
    ControllerMetaSettings, KlControllerSettings, QDistributionSettings, RewardStatsSettings, TauSchedule,
    WeightingSettings, WeightNormalizationSettings,
)
from maxent_grpo.rollout.backend import SamplingParams
from maxent_grpo.rollout.backends import BACKENDS
from maxent_grpo.config.python_objects import (
    PythonObjects, resolve_data, resolve_environment, resolve_model, resolve_rewards,
)
from maxent_grpo.config.rules import check_given_model, check_run, config_keys, prompts_per_step
from maxent_grpo.config.schema import TrainConfig
from maxent_grpo.training.run_plan import BatchPlan, RunPlan, with_steps
from maxent_grpo.training.data import DataPlan
from maxent_grpo.training.micro_batches import auto_rows
from maxent_grpo.training.policy import LoraPlan, ModelPlan, OptimizerPlan
from maxent_grpo.training.precision import Machine, Precision, PrecisionAsked, precision_for
from maxent_grpo.training.sampler import SamplerPlan
from maxent_grpo.training.schedule import LoggingPlan, Schedule
from maxent_grpo.training.strategy import STRATEGIES
from maxent_grpo.training.teacher import TeacherPlan
from maxent_grpo.training.validation import EvalPlan, eval_draws, eval_k


# The LossSpec / ClipSettings field each loss key of the config sets (the rest are loss.<field>).
_KEYS = {
    "epsilon_low": "loss.epsilon",
    "clip_coef": "maxent.listwise_clip_coef",  # ListwiseParams
    "score": "maxent.listwise_score",
    "max_completion_length": "generation.max_new_tokens",
}
_SPEC_FIELDS = {f.name for f in dataclasses.fields(LossSpec)}


def completion_budget(cfg: TrainConfig) -> int:
    """The most tokens a completion's loss counts: the model's tokens of an episode, else max_new_tokens."""
    limits = episode_limits(cfg.environment, cfg.generation.max_new_tokens)
    return cfg.generation.max_new_tokens if limits is None else limits.max_model_tokens


def _base_loss(cfg: TrainConfig, rollout_correction: str) -> LossSpec:
    lo = cfg.loss
    with config_keys(lambda setting: _KEYS.get(setting, f"loss.{setting}")):
        clip = ClipSettings(
            epsilon_low=lo.epsilon, epsilon_high=lo.epsilon if lo.epsilon_high is None else lo.epsilon_high,
            delta=lo.delta, dual_clip=lo.dual_clip, importance_sampling_level=lo.importance_sampling_level,
        )
        return LossSpec(
            loss_type=lo.loss_type, clip=clip, beta=lo.beta, kl_estimator=lo.kl_estimator,
            kl_importance_weighted=lo.kl_importance_weighted,
            entropy_coef=lo.entropy_coef, top_entropy_quantile=lo.top_entropy_quantile,
            rollout_correction=rollout_correction, rollout_correction_cap=lo.rollout_correction_cap,
            seq_logprob_error_threshold=lo.seq_logprob_error_threshold,
            max_completion_length=completion_budget(cfg),
            distill=_distill(cfg),
        )


def _head_note(cfg: TrainConfig) -> tuple[str, ...]:
    """A server samples with the head it was started with: say how to start it with a float32 one."""
    if not (cfg.model.lm_head_fp32 and cfg.generation.backend == "vllm_server"):
        return ()
    return ("model.lm_head_fp32: the vLLM server's LM head is float32 only if it was started with "
            "`maxent-grpo serve MODEL --lm-head-fp32` (vLLM's head_dtype)",)


def _ref_sync(cfg: TrainConfig) -> RefSync | None:
    lo = cfg.loss
    if not lo.sync_ref_model:
        return None
    with config_keys("loss"):
        return RefSync(alpha=lo.ref_model_mixup_alpha, sync_steps=lo.ref_model_sync_steps)


def _distill(cfg: TrainConfig) -> DistillTerm | None:
    """The teacher's loss term (None without a teacher); its bounds raise one ConfigError naming the key."""
    t = cfg.teacher
    if t.name_or_path is None:
        return None
    with config_keys("teacher"):
        return DistillTerm(coef=t.coef, kl_estimator=t.kl_estimator)


def _micro_batch(cfg: TrainConfig, machine: Machine) -> tuple[int, bool, tuple[str, ...]]:
    """(rows per forward/backward, whether each step sizes them from the memory left once the models
    load, the note for ``auto``): ``training/micro_batches.py``."""
    t, g = cfg.training, cfg.generation
    if t.micro_batch_size != "auto":
        return t.micro_batch_size, False, ()
    rows = auto_rows(prompts_per_step(cfg) * g.num_generations, g.num_generations)
    if machine.cuda:
        return rows, True, ("training.micro_batch_size auto: sized at each step from the device memory left once "
                            f"the models load, in whole groups ({rows} rows for the passes without gradients)",)
    return rows, False, (f"training.micro_batch_size auto: {rows} (the CPU: its memory does not limit a micro-batch; "
                         "sized from memory on CUDA)",)


def _compile_method(cfg: TrainConfig, rollout_correction: str, micro_batch_size: int) -> MethodPlan:
    """The configured method's plan; its checks and its loss's bounds raise one ConfigError naming the key."""
    method = get_method(cfg.method)
    inputs = PlanInputs(
        loss=_base_loss(cfg, rollout_correction),
        settings=getattr(cfg, method.section) if method.section is not None else None,
        maxent=cfg.maxent, num_generations=cfg.generation.num_generations,
        micro_batch_size=micro_batch_size, max_new_tokens=completion_budget(cfg),
    )
    for key, problem in method.check(inputs):
        raise ConfigError(f"{key}: {problem}")
    def key(setting: str) -> str:
        # The clip was checked with the loss: section; a LossSpec field the method set is still a
        # loss: key (its combination with the method failed), anything else is the method's own.
        if setting in _SPEC_FIELDS or method.section is None:
            return _KEYS.get(setting, f"loss.{setting}")
        return f"{method.section}.{setting}"

    with config_keys(key):
        return method.plan(inputs)


# The setting each MaxEnt record names in its SpecError -> the config key it comes from.
_WEIGHTING_KEYS = {
    "tau": "maxent.tau",
    "beta": "loss.beta",
    "scale_rewards": "loss.scale_rewards",
    "q_distribution.temperature": "maxent.q_temperature",
    "q_distribution.epsilon": "maxent.q_epsilon",
    **{f"tau_schedule.{f}": f"maxent.tau_{k}" for f, k in (
        ("target_entropy", "target_entropy"), ("target_final", "target_final"), ("horizon", "target_horizon"),
        ("lr", "lr"), ("min", "min"), ("max", "max"), ("warmup_steps", "warmup_steps"))},
    **{f"kl_controller.{f}": f"maxent.kl_{f}" for f in ("target", "horizon", "step_size")},
    **{f"controller_meta.{f}": f"maxent.meta_{f}" for f in ("lr_tau", "lr_beta", "every", "grad_clip")},
}


def _weighting(cfg: TrainConfig) -> WeightingSettings:
    """The run's MaxEnt weighting and controller settings; each record checks its own bounds."""
    m = cfg.maxent
    with config_keys(_WEIGHTING_KEYS.__getitem__):
        return WeightingSettings(
            tau=m.tau, beta=cfg.loss.beta, scale_rewards=cfg.loss.scale_rewards,
            normalization=WeightNormalizationSettings(len_norm_ref=m.length_normalize_ref),
            q_distribution=QDistributionSettings(temperature=m.q_temperature, epsilon=m.q_epsilon),
            tau_schedule=TauSchedule(
                target_entropy=m.tau_target_entropy, target_final=m.tau_target_final, horizon=m.tau_target_horizon,
                lr=m.tau_lr, min=m.tau_min, max=m.tau_max, warmup_steps=m.tau_warmup_steps,
            ),
            kl_controller=KlControllerSettings(target=m.kl_target, horizon=m.kl_horizon, step_size=m.kl_step_size),
            controller_meta=ControllerMetaSettings(lr_tau=m.meta_lr_tau, lr_beta=m.meta_lr_beta, every=m.meta_every,
                                                   grad_clip=m.meta_grad_clip),
        )


def _precision(cfg: TrainConfig, machine: Machine, master: str) -> Precision:
    g, t = cfg.generation, cfg.training
    backend = BACKENDS[g.backend]
    return precision_for(machine, PrecisionAsked(
        compute_dtype=cfg.model.dtype, master=master, sample_dtype=g.dtype,
        autocast_bf16=t.autocast_bf16, share_prompts=t.share_prompts, packing=t.packing,
        inline_prompts=t.inline_prompts,
        rollout_correction=cfg.loss.rollout_correction,
        gradient_checkpointing=t.gradient_checkpointing, engine_owns_weights=backend.owns_weights,
        max_staleness=cfg.rollout.max_staleness, compile_decoding=g.compile, hf_sampler=g.backend == "hf",
        sharded=STRATEGIES[t.strategy].collective_forward,
        # A LoRA policy or an FSDP2 policy sampled by HF samples from itself: no copy to make.
        samples_itself=not backend.owns_weights and (
            cfg.model.lora.enabled or STRATEGIES[t.strategy].collective_forward),
    ))


def compile_run(cfg: TrainConfig, machine: Machine, objects: PythonObjects | None = None) -> RunPlan:
    """Compile ``cfg`` (``load_config``'s result: presets applied, every key checked) for ``machine``.
    ``objects``: what the config's ``python:`` references name (``maxent_grpo.train``, ``GRPOTrainer``)."""
    g, t, lo, m = cfg.generation, cfg.training, cfg.loss, cfg.model
    objects = objects or PythonObjects()
    master = master_dtype(m.dtype, m.lora.enabled)
    given = resolve_model(m.name_or_path, objects)
    if given[0] is not None:  # first: what a model object rules out decides before any other rule
        check_given_model(cfg)
    check_run(cfg, machine, master, eval_rows_given=objects.eval_dataset is not None)
    weighting = _weighting(cfg)  # loss.beta and maxent.*: before the method's own loss bounds
    precision = _precision(cfg, machine, master)
    micro_batch_size, micro_batch_from_memory, micro_note = _micro_batch(cfg, machine)
    episodes = episode_limits(cfg.environment, g.max_new_tokens)
    sampling = SamplingParams(max_new_tokens=g.max_new_tokens, temperature=g.temperature, top_p=g.top_p,
                              top_k=g.top_k, stop=tuple(g.stop))
    plan = RunPlan(
        method=_compile_method(cfg, precision.rollout_correction, micro_batch_size),
        scoring=Scoring(temperature=g.temperature, share_prompts=precision.share_prompts,
                        autocast_bf16=precision.autocast_bf16, rows_per_pass=micro_batch_size,
                        packing=precision.packing, inline_prompts=precision.inline_prompts),
        batch=_batch_plan(cfg, sampling, episodes, weighting),
        micro_batch_size=micro_batch_size,
        micro_batch_from_memory=micro_batch_from_memory,
        release_host_memory=t.release_host_memory,
        num_iterations=t.num_iterations,
        max_grad_norm=t.max_grad_norm,
        data=_data_plan(cfg, episodes, objects),
        model=_model_plan(cfg, master, precision, given),
        sampler=_sampler_plan(cfg, precision, sampling, episodes),
        optimizer=_optimizer_plan(cfg, machine),
        rollout=cfg.rollout,
        schedule=Schedule(
            max_steps=t.max_steps, max_consecutive_skips=t.max_consecutive_skips,
            save_steps=cfg.checkpoint.save_steps, save_minutes=cfg.checkpoint.save_minutes,
            keep_last=cfg.checkpoint.keep_last, save_final=cfg.checkpoint.save_final,
            eval_every_steps=cfg.eval.every_steps, num_epochs=cfg.data.num_epochs,
        ),
        logging=LoggingPlan(
            output_dir=cfg.logging.output_dir, report_to=tuple(cfg.logging.report_to),
            log_completions_every=cfg.logging.log_completions_every, progress_bar=cfg.logging.progress_bar,
            collapse_window=cfg.logging.collapse_window, observers=tuple(objects.callbacks),
        ),
        eval=EvalPlan(num_prompts=cfg.eval.num_prompts, k=eval_k(cfg.eval.k, cfg.data.source), seed=t.seed,
                      draws=eval_draws(cfg.eval.draws, cfg.data.source), min_defined_prompts=cfg.eval.min_defined_prompts),
        weighting=weighting,
        rewards=resolve_rewards(cfg.rewards, objects),
        replay=cfg.replay,
        adaptive_entropy=AdaptiveEntropy(lo.entropy_target, lo.entropy_coef_delta, lo.entropy_coef_min,
                                         lo.entropy_coef_max) if lo.adaptive_entropy else None,
        ref_sync=_ref_sync(cfg),
        teacher=_teacher_plan(cfg),
        strategy=t.strategy,
        dist_timeout_minutes=t.dist_timeout_minutes,
        seed=t.seed,
        source=dataclasses.asdict(cfg),
        notes=precision.notes + micro_note + _head_note(cfg),
    )
    return plan if t.max_steps is None else with_steps(plan, t.max_steps)


def _batch_plan(cfg: TrainConfig, sampling: SamplingParams, episodes, weighting: WeightingSettings) -> BatchPlan:
    g, lo, d = cfg.generation, cfg.loss, cfg.data
    return BatchPlan(
        num_generations=g.num_generations, prompts_per_step=prompts_per_step(cfg), system_prompt=d.system_prompt,
        few_shot=tuple(d.few_shot), sampling=sampling, max_retry_rounds=g.max_retry_rounds,
        dynamic_sampling=lo.dynamic_sampling, max_gen_batches=lo.max_gen_batches,
        mask_truncated_completions=lo.mask_truncated_completions,
        zero_truncated_completion_rewards=lo.zero_truncated_completion_rewards,
        reward_stats=RewardStatsSettings(
            q=weighting.q_distribution, scale_rewards=lo.scale_rewards, advantage_estimator=lo.advantage_estimator,
            aggregation=lo.multi_objective_aggregation,
        ),
        policy_entropy_bonus_coef=lo.policy_entropy_bonus_coef, episodes=episodes,
        reward_advantages=cfg.teacher.rewards or cfg.teacher.name_or_path is None,
    )


def _data_plan(cfg: TrainConfig, episodes, objects: PythonObjects) -> DataPlan:
    d = cfg.data
    given_rows, given_eval = resolve_data(d.source, d.eval_size, objects)
    tools, classes = resolve_environment(cfg.environment.tools, cfg.environment.classes, objects)
    return DataPlan(
        source=d.source, split=d.split, size=d.size, seed=cfg.training.seed, task_kwargs=dict(d.task_kwargs),
        instruction=d.instruction, prompt_column=d.prompt_column, answer_column=d.answer_column,
        eval_size=d.eval_size, num_epochs=d.num_epochs, shuffle=d.shuffle, environment=cfg.environment,
        episodes=episodes, tools=tools, classes=classes, given=given_rows, given_eval=given_eval,
    )


def _model_plan(cfg: TrainConfig, master: str, precision: Precision, given: tuple) -> ModelPlan:
    m, lora = cfg.model, cfg.model.lora
    return ModelPlan(
        name_or_path=m.name_or_path, dtype=m.dtype, master_dtype=master,
        lora=LoraPlan(r=lora.r, alpha=lora.alpha, dropout=lora.dropout,
                      target_modules=tuple(lora.target_modules), use_rslora=lora.use_rslora)
        if lora.enabled else None,
        gradient_checkpointing=cfg.training.gradient_checkpointing, autocast_bf16=precision.autocast_bf16,
        lm_head_fp32=m.lm_head_fp32, given=given[0], given_tokenizer=given[1],
    )


def _sampler_plan(cfg: TrainConfig, precision: Precision, sampling: SamplingParams, episodes) -> SamplerPlan:
    g, d = cfg.generation, cfg.data
    return SamplerPlan(
        backend=g.backend, sample_dtype=precision.sample_dtype, batch_size=g.batch_size,
        share_prompts=precision.share_prompts, compile=precision.compile_decoding, vllm=g.vllm,
        lm_head_fp32=cfg.model.lm_head_fp32,
        size_from_prompts=BACKENDS[g.backend].plans_context and g.vllm.max_model_len is None and episodes is None,
        params=sampling, system_prompt=d.system_prompt, few_shot=tuple(d.few_shot),
    )


def _optimizer_plan(cfg: TrainConfig, machine: Machine) -> OptimizerPlan:
    t = cfg.training
    return OptimizerPlan(
        learning_rate=t.learning_rate, lr_scheduler=t.lr_scheduler, warmup_steps=t.warmup_steps,
        warmup_ratio=t.warmup_ratio, weight_decay=t.weight_decay, betas=(t.adam_beta1, t.adam_beta2),
        total_updates=None,
        name=t.optimizer,
        fused=t.optimizer == "adamw_fused" or (
            t.optimizer == "adamw" and machine.cuda and not STRATEGIES[t.strategy].collective_forward),
    )


def _teacher_plan(cfg: TrainConfig) -> TeacherPlan | None:
    te, d = cfg.teacher, cfg.data
    if te.name_or_path is None:
        return None
    return TeacherPlan(te.name_or_path, te.dtype, own_template=te.chat_template == "teacher",
                       system_prompt=d.system_prompt, few_shot=tuple(d.few_shot))
