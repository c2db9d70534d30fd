"""The run configuration's typed sections: one dataclass per YAML section, with its defaults.

The defaults ARE the built-in default run (``maxent-grpo train`` with no
--config): the real SmolLM2-135M-Instruct on reasoning-gym chain_sum (one-digit
sums and differences, generated offline) with MaxEnt listwise weights, 5-7
minutes on 2 CPU cores. A recipe file starts from them and changes what it
names. ``data.task_kwargs`` and ``data.few_shot`` belong to the default task:
a config that names another ``data.source`` starts them empty (config.py).

``training/config.py`` reads YAML onto these records, applies overrides and
method presets, and checks the bounds that are not a record's own
(``validate``); ``training/plan.py`` compiles the config into the typed plan
the run uses. The MaxEnt section lives with the weighting it sets
(``rewards/maxent/settings.py``) and each method's own section in its file.
"""

from __future__ import annotations

from dataclasses import dataclass, field, make_dataclass
from typing import Any, Literal

from maxent_grpo.core.advantages import ADVANTAGE_ESTIMATORS, REWARD_AGGREGATIONS, SCALE_REWARDS
from maxent_grpo.core.losses import IMPORTANCE_SAMPLING_LEVELS, KL_ESTIMATORS, LOSS_AGGREGATIONS
from maxent_grpo.core.rollout_correction import ROLLOUT_CORRECTIONS
from maxent_grpo.data.prompts import FewShotExample
from maxent_grpo.envs.settings import EnvironmentConfig
from maxent_grpo.methods import method_sections
from maxent_grpo.rewards.maxent import MaxEntConfig
from maxent_grpo.rollout.backends import BACKENDS
from maxent_grpo.rollout.settings import RolloutConfig, VllmConfig
from maxent_grpo.training.replay import ReplayConfig
from maxent_grpo.training.strategy import STRATEGIES



@dataclass
class LoraConfig:
    enabled: bool = False
    r: int = 16
    alpha: int = 32
    dropout: float = 0.05
    target_modules: list[str] = field(default_factory=lambda: ["q_proj", "k_proj", "v_proj", "o_proj"])


@dataclass
class ModelConfig:
    name_or_path: str = "smollm2-135m-instruct"
    dtype: Literal["float32", "bfloat16", "float64"] = "float32"
    lora: LoraConfig = field(default_factory=LoraConfig)


DEFAULT_SOURCE = "reasoning_gym:chain_sum"
DEFAULT_TASK_KWARGS = {"min_terms": 2, "max_terms": 2, "max_digits": 1}
# One solved example, given as an earlier chat turn, shows the boxed format: SmolLM2
# then boxes most answers (~80%) and gets ~10% right, so groups disagree and the
# accuracy reward has something to learn from. (Without it, under 10% of completions
# are boxed and 15 steps teach little.)
DEFAULT_FEW_SHOT = (
    "State the final answer to the following arithmetic problem: 7 + 1 =\n\nPut your final answer within \\boxed{}.",
    "7 + 1 = \\boxed{8}",
)


@dataclass
class DataConfig:
    source: str = DEFAULT_SOURCE
    split: str = "train"
    size: int | None = 1000
    # reasoning_gym sources: options of the task's generator, and the line appended to each question.
    task_kwargs: dict[str, Any] = field(default_factory=lambda: dict(DEFAULT_TASK_KWARGS))
    instruction: str | None = "Put your final answer within \\boxed{}."
    prompt_column: str = "prompt"
    answer_column: str = "answer"
    system_prompt: str | None = None
    few_shot: list[FewShotExample] = field(default_factory=lambda: [FewShotExample(*DEFAULT_FEW_SHOT)])
    eval_size: int = 0
    num_epochs: int | None = None
    shuffle: bool = True


@dataclass
class RewardEntry:
    name: str
    weight: float = 1.0
    kwargs: dict[str, Any] = field(default_factory=dict)
    # Seconds one call may take; a call that runs longer fails the batch (null: no limit).
    timeout_s: float | None = None


@dataclass
class GenerationConfig:
    num_generations: int = 8
    max_new_tokens: int = 48
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    stop: list[str] = field(default_factory=list)
    max_retry_rounds: int = 2
    batch_size: int | None = None
    # Sample from a copy of the policy in this dtype (refreshed after every optimizer
    # step); null samples from the policy itself; auto: bfloat16 where the device
    # multiplies it natively, else null (training/precision.py).
    dtype: Literal["float32", "bfloat16", "auto"] | None = "auto"
    # The sampler: hf (transformers generate, in process), vllm (one in-process vLLM
    # engine per process), vllm_server (a vLLM server, e.g. on other GPUs). The choices
    # are the names rollout/backends.py registers.
    backend: Literal[tuple(BACKENDS)] = "hf"
    vllm: VllmConfig = field(default_factory=VllmConfig)


@dataclass
class LossSection:
    loss_type: Literal[tuple(LOSS_AGGREGATIONS)] = "dapo"  # core/losses.py
    epsilon: float = 0.2
    epsilon_high: float | None = None
    delta: float | None = None
    dual_clip: float | None = None
    importance_sampling_level: Literal[IMPORTANCE_SAMPLING_LEVELS] = "token"
    beta: float = 0.0
    kl_estimator: Literal[tuple(KL_ESTIMATORS)] = "k3"
    top_entropy_quantile: float = 1.0
    # The names core/advantages.py registers (grpo, rloo, maxrl, reinforce_pp, reinforce_pp_baseline).
    advantage_estimator: Literal[tuple(ADVANTAGE_ESTIMATORS)] = "grpo"
    scale_rewards: Literal[SCALE_REWARDS] = "group"
    # How several reward functions combine (core/advantages.py): the weighted sum, or GDPO's sum of
    # rewards each normalised over its group first (TRL's multi_objective_aggregation).
    multi_objective_aggregation: Literal[REWARD_AGGREGATIONS] = "sum_then_normalize"
    mask_truncated_completions: bool = False
    zero_truncated_completion_rewards: bool = False
    entropy_coef: float = 0.0
    # Skywork-OR1's adaptive entropy (TRL use_adaptive_entropy; core/entropy_control.py): entropy_coef
    # is the starting coefficient, moved by entropy_coef_delta toward keeping the entropy at entropy_target.
    adaptive_entropy: bool = False
    entropy_target: float = 0.2
    entropy_coef_delta: float = 0.005
    entropy_coef_min: float = 0.0
    entropy_coef_max: float = 1.0
    policy_entropy_bonus_coef: float = 0.0
    dynamic_sampling: bool = False
    max_gen_batches: int = 3
    # Importance weight between the sampler and the trainer on the policy term (ALGORITHMS.md §9,
    # §15). auto: token_truncate when the sampler is not the trainer (a vLLM engine or server, a
    # sampling copy in another dtype), else none (training/precision.py resolves it at start).
    rollout_correction: Literal[("auto", *ROLLOUT_CORRECTIONS)] = "auto"
    rollout_correction_cap: float = 2.0  # verl's threshold (ALGORITHMS.md §15)
    # NeMo-RL's option: a sequence whose mean_t exp(|logp_trainer - logp_sampler|) exceeds this
    # is left out of the policy term (null: off; values are > 1).
    seq_logprob_error_threshold: float | None = None


@dataclass
class TrainingConfig:
    max_steps: int = 15
    # Prompts each process draws per optimizer step (the global batch is this times
    # the number of processes, times num_generations completions).
    prompts_per_step: int = 4
    # Completions each process samples per optimizer step (TRL's per-device convention);
    # when set it must be a multiple of num_generations and replaces prompts_per_step.
    batch_size: int | None = None
    micro_batch_size: int = 8
    learning_rate: float = 1e-5
    lr_scheduler: Literal["constant", "linear", "cosine"] = "constant"
    warmup_steps: int = 0
    weight_decay: float = 0.0
    adam_beta1: float = 0.9
    adam_beta2: float = 0.99
    max_grad_norm: float | None = 1.0
    num_iterations: int = 1
    seed: int = 0
    # Run forward/backward matmuls in bfloat16 (torch.autocast) over float32 weights;
    # auto: where the device multiplies bf16 natively.
    autocast_bf16: Literal[True, False, "auto"] = "auto"
    # Forward each distinct prompt once per micro-batch and let its G completions
    # attend to the shared keys/values (same gradient up to float rounding). auto: on the CPU
    # (it saves the repeated prompt work); off on CUDA, where the KV-cache forward and backward
    # took 1.75x one plain forward (H100, 0.5B, BENCHMARKS.md "GPU"), and with gradient_checkpointing.
    share_prompts: Literal[True, False, "auto"] = "auto"
    packing: bool = field(default=False, metadata={"help": (
        "policy, reference and old-policy passes run padding-free: each row's real tokens packed end to end "
        "into fewer rows (core/packing.py), the same values and gradients as the padded forward; "
        "in place of share_prompts for these passes (generation still shares prompts)")})
    # Keep only each decoder layer's input and recompute the layer in the backward: activation
    # memory of one layer instead of all, for about one more forward of compute. Needs
    # share_prompts: false (a shared prompt's KV cache cannot be recomputed).
    gradient_checkpointing: bool = False
    # How several processes share the work: ddp (each holds the whole model) or fsdp2
    # (each holds 1/world_size of the weights, gradients and optimizer state; training/sharding.py).
    strategy: Literal[tuple(STRATEGIES)] = "ddp"  # training/strategy.py
    # How long a collective may wait for the other processes before the run fails (torch's
    # default of 10 minutes is shorter than hashing a large checkpoint or pushing weights to disk).
    dist_timeout_minutes: float = 60.0
    # Batches in a row that may fail (a stage raised, or no learning signal) before the
    # run saves a checkpoint and stops with the last error.
    max_consecutive_skips: int = 5


@dataclass
class LoggingConfig:
    output_dir: str = "outputs/default"
    report_to: list[str] = field(default_factory=list)
    log_completions_every: int = 1
    progress_bar: bool = True


@dataclass
class CheckpointConfig:
    save_steps: int = 0
    # Also save when this many minutes have passed since the last save (0: only save_steps).
    save_minutes: float = 10.0
    keep_last: int | None = 2
    # Save a checkpoint when the run ends (false: benchmarks that time steps and need no weights).
    save_final: bool = True


@dataclass
class EvalConfig:
    every_steps: int = 0
    num_prompts: int = 32
    # Samples per group; null: 8 on modebench_pkg data (the anchor's, ALGORITHMS.md §18), else 4.
    k: int | None = None
    # Groups of k drawn per prompt (§18); null: 4 on modebench_pkg data (the anchor's), else 1.
    draws: int | None = None
    # ModeBench's PCMD is reportable over at least this many prompts with >= 2 verified answers (§18).
    min_defined_prompts: int = 30


@dataclass
class CoreConfig:
    """The sections every run has; :data:`TrainConfig` adds the methods' own sections."""

    # A name registered in maxent_grpo.methods (checked by training/config.py).
    method: str = "maxent_listwise"
    model: ModelConfig = field(default_factory=ModelConfig)
    data: DataConfig = field(default_factory=DataConfig)
    rewards: list[RewardEntry] = field(
        default_factory=lambda: [RewardEntry("boxed_accuracy", 1.0), RewardEntry("format", 0.5)]
    )
    generation: GenerationConfig = field(default_factory=GenerationConfig)
    environment: EnvironmentConfig = field(default_factory=EnvironmentConfig)
    rollout: RolloutConfig = field(default_factory=RolloutConfig)
    loss: LossSection = field(default_factory=LossSection)
    maxent: MaxEntConfig = field(default_factory=MaxEntConfig)
    training: TrainingConfig = field(default_factory=TrainingConfig)
    logging: LoggingConfig = field(default_factory=LoggingConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    eval: EvalConfig = field(default_factory=EvalConfig)
    # Verified mode replay (Re:Dr, Re:Max; ALGORITHMS.md §17), for any method: training/replay.py.
    replay: ReplayConfig = field(default_factory=ReplayConfig)


# A method's settings section (methods/xdr.py's ``xdr:``...) is declared in its own file; the
# run configuration has one field per registered section, so a new method edits nothing here.
TrainConfig = make_dataclass(
    "TrainConfig",
    [(key, settings, field(default_factory=settings)) for key, settings in method_sections().items()],
    bases=(CoreConfig,),
)
TrainConfig.__module__ = __name__
TrainConfig.__doc__ = "The whole run configuration: the sections of :class:`CoreConfig` and each method's own."
