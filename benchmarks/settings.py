"""One benchmark setting: everything both trainers and the floor must agree on.

A :class:`BenchSetting` is written to JSON by the harness and read back by each
child process, so the three sides cannot drift apart. ``PRESETS`` holds the
named settings of ``benchmarks/run.py --setting``.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
from dataclasses import dataclass, field
from pathlib import Path

LOSS_TYPES = ("dapo", "grpo", "dr_grpo", "bnpo")
LORA_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


@dataclass(frozen=True)
class BenchSetting:
    name: str
    model: str  # "tiny", "smollm2-135m-instruct" or a model folder
    task: str = "chain_sum"  # reasoning-gym task name, or the benchmark's own "pair_sum"
    dataset_size: int = 256
    prompts_per_step: int = 4
    num_generations: int = 8
    max_new_tokens: int = 64
    micro_batch_size: int = 8  # completions per forward/backward; divides P*G
    temperature: float = 1.0
    beta: float = 0.0
    loss_type: str = "dapo"
    learning_rate: float = 1e-6
    # The optimizer on every side: adamw (ours: training.optimizer adamw; TRL: adamw_torch_fused, its
    # default) or adamw_8bit (bitsandbytes' AdamW8bit on both: ours adamw_8bit, TRL adamw_bnb_8bit).
    optimizer: str = "adamw"
    bf16: bool = False  # weights (and compute) in bfloat16 on every side
    seed: int = 0  # data (reasoning-gym), sampling and training seed
    steps: int = 3  # optimizer steps per run; the first is the warm-up
    method: str = "grpo"  # our trainer's method; TRL always runs GRPO
    # Where every side trains: "cpu", or "cuda" (benchmarks/gpu.py), where bf16 means bf16 compute
    # over float32 master weights on every side (ours: model.dtype bfloat16; TRL: bf16=True, AMP).
    device: str = "cpu"
    # Activation checkpointing on every side (ours: training.gradient_checkpointing, which needs
    # share_prompts off; TRL: gradient_checkpointing=True).
    gradient_checkpointing: bool = False
    # The prompts, pinned here so that no side falls back on its own defaults: the task
    # generator's options (reasoning-gym tasks) and the solved examples placed as earlier
    # user/assistant turns, (prompt, completion) pairs. Empty: reasoning-gym's own problems,
    # no example. ``default_task_fields`` gives the built-in default run's.
    task_kwargs: dict = field(default_factory=dict)
    few_shot: tuple[tuple[str, str], ...] = ()
    # Add a third reward on every side, the completion text's digest in [0, 1) (common_rewards.text_digest):
    # a random model's completions all score 0 on the task, so without it no batch has signal and
    # neither side trains on a real gradient (benchmarks/gpu.py).
    digest_reward: bool = False
    # LoRA of this rank on every side (0: full fine-tuning): adapters on every attention and MLP
    # projection (LORA_TARGETS), alpha 2r, no dropout, the base in the compute dtype. How one GPU
    # trains 7B (benchmarks/gpu.py --lora-r).
    lora_r: int = 0
    # TRL's GRPOConfig.cache_implementation (None: its default, the dynamic cache; "static": its best
    # setting for HF generation, which TRL runs uncompiled: it sets disable_compile). TRL's side only.
    trl_cache: str | None = None

    def __post_init__(self) -> None:
        # JSON gives lists back: the pairs are kept as tuples, so a setting read back compares equal.
        object.__setattr__(self, "few_shot", tuple(tuple(pair) for pair in self.few_shot))
        if any(len(pair) != 2 or not all(isinstance(x, str) for x in pair) for pair in self.few_shot):
            raise ValueError(f"few_shot must hold (prompt, completion) string pairs, got {self.few_shot!r}")
        if not isinstance(self.task_kwargs, dict):
            raise ValueError(f"task_kwargs must be a mapping, got {self.task_kwargs!r}")
        positive = ("dataset_size", "prompts_per_step", "micro_batch_size", "max_new_tokens", "steps")
        for key in positive:
            if getattr(self, key) < 1:
                raise ValueError(f"{key} must be >= 1, got {getattr(self, key)}")
        if self.num_generations < 2:
            raise ValueError(f"num_generations must be >= 2, got {self.num_generations}")
        if self.completions_per_step % self.micro_batch_size:
            raise ValueError(
                f"micro_batch_size {self.micro_batch_size} does not divide the "
                f"{self.completions_per_step} completions of a step"
            )
        if self.temperature <= 0:
            raise ValueError(f"temperature must be > 0, got {self.temperature}")
        if self.beta < 0:
            raise ValueError(f"beta must be >= 0, got {self.beta}")
        if self.loss_type not in LOSS_TYPES:
            raise ValueError(f"loss_type must be one of {LOSS_TYPES}, got {self.loss_type!r}")
        if self.device not in ("cpu", "cuda"):
            raise ValueError(f"device must be cpu or cuda, got {self.device!r}")
        if self.learning_rate < 0:
            raise ValueError(f"learning_rate must be >= 0, got {self.learning_rate}")
        if self.lora_r < 0:
            raise ValueError(f"lora_r must be >= 0 (0: full fine-tuning), got {self.lora_r}")

    @property
    def completions_per_step(self) -> int:
        return self.prompts_per_step * self.num_generations

    def replace(self, **changes) -> BenchSetting:
        return dataclasses.replace(self, **changes)

    def to_json(self, path: Path) -> None:
        path.write_text(json.dumps(dataclasses.asdict(self), indent=1))

    @classmethod
    def from_json(cls, path: Path) -> BenchSetting:
        return cls(**json.loads(Path(path).read_text()))


def default_task_fields(task: str) -> dict:
    """``task_kwargs`` and ``few_shot`` of the built-in default run, whose task ``task`` must be."""
    from maxent_grpo.config.schema import DEFAULT_FEW_SHOT, DEFAULT_SOURCE, DEFAULT_TASK_KWARGS

    if DEFAULT_SOURCE != f"reasoning_gym:{task}":
        raise ValueError(f"default task: the default run's task is {DEFAULT_SOURCE!r}, not reasoning_gym:{task}")
    return {"task_kwargs": dict(DEFAULT_TASK_KWARGS), "few_shot": (DEFAULT_FEW_SHOT,)}


PRESETS: dict[str, BenchSetting] = {
    # Seconds on 2 cores: the harness smoke test and quick overhead checks.
    "tiny": BenchSetting(
        name="tiny", model="tiny", dataset_size=64, prompts_per_step=2, num_generations=4,
        max_new_tokens=16, micro_batch_size=8, learning_rate=1e-4,
    ),
    # SmolLM2-135M-Instruct, 4 prompts x 8 completions, the measurements of ENVIRONMENT.md.
    "smollm2-64": BenchSetting(name="smollm2-64", model="smollm2-135m-instruct", max_new_tokens=64),
    "smollm2-256": BenchSetting(name="smollm2-256", model="smollm2-135m-instruct", max_new_tokens=256),
    # The built-in default run's task and sizes (learning comparisons: the model learns it in ~15 steps).
    "smollm2-default": BenchSetting(
        name="smollm2-default", model="smollm2-135m-instruct", max_new_tokens=48, learning_rate=1e-5,
        steps=15, **default_task_fields("chain_sum"),
    ),
    # The method comparison: the benchmark's pair_sum task (many correct answers per prompt).
    "smollm2-pair-sum": BenchSetting(
        name="smollm2-pair-sum", model="smollm2-135m-instruct", task="pair_sum", max_new_tokens=48,
        learning_rate=1e-5, steps=20,
    ),
}


def add_setting_args(parser) -> None:
    """Command-line overrides of a preset's fields (shared by run.py, learning.py, methods.py)."""
    parser.add_argument("--setting", choices=sorted(PRESETS), required=True, help="named preset to start from")
    parser.add_argument("--task", help="reasoning-gym task")
    parser.add_argument("--beta", type=float)
    parser.add_argument("--bf16", action=argparse.BooleanOptionalAction, default=None)
    parser.add_argument("--loss-type", choices=LOSS_TYPES)
    parser.add_argument("--steps", type=int, help="optimizer steps per run")
    parser.add_argument("--dataset-size", type=int)
    parser.add_argument("--prompts-per-step", type=int)
    parser.add_argument("--num-generations", type=int)
    parser.add_argument("--max-new-tokens", type=int)
    parser.add_argument("--micro-batch-size", type=int)
    parser.add_argument("--learning-rate", type=float)
    parser.add_argument("--optimizer", choices=("adamw", "adamw_8bit"), help="the optimizer on every side")
    parser.add_argument("--seed", type=int)
    parser.add_argument("--gradient-checkpointing", action=argparse.BooleanOptionalAction, default=None,
                        help="activation checkpointing on every side")
    parser.add_argument("--default-task", action="store_true",
                        help="the built-in default run's task options and solved example (task chain_sum)")


def setting_from_args(args) -> BenchSetting:
    fields = ("task", "beta", "bf16", "loss_type", "steps", "dataset_size", "prompts_per_step",
              "num_generations", "max_new_tokens", "micro_batch_size", "learning_rate", "optimizer", "seed",
              "gradient_checkpointing")
    overrides = {f: getattr(args, f) for f in fields if getattr(args, f) is not None}
    setting = PRESETS[args.setting].replace(**overrides)
    return setting.replace(**default_task_fields(setting.task)) if args.default_task else setting
