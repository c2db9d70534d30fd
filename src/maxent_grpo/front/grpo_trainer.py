"""``GRPOTrainer``: TRL 1.16's trainer signature over this library's run.

A TRL script runs with its import line changed::

    from maxent_grpo import GRPOConfig, GRPOTrainer   # was: from trl import GRPOConfig, GRPOTrainer

    trainer = GRPOTrainer(model="Qwen/Qwen2-0.5B-Instruct", reward_funcs=my_reward, train_dataset=dataset)
    trainer.train()

The constructor reads everything as TRL's does and compiles the run's plan at once, so bad input is
one line (a :class:`~maxent_grpo.errors.UserError` naming the argument or ``GRPOConfig`` field)
before any model loads: ``args`` through ``--from-trl``'s field table (config/trl_fields.py), the
model, rewards, data, environments and callbacks as objects (front/objects.py). ``train()`` runs this
library's engine (progress bar, checkpoints, resume, Ctrl-C, metrics.jsonl); the loss is TRL's for the
same ``loss_type`` (tests/test_trl_update_parity.py). Under ``torchrun`` every process runs the same
script, as with TRL, so lambdas and closures are never pickled.

What differs from TRL, each refused in one line: a custom ``optimizers`` pair, ``quantization_config``,
``rollout_func``; a dict ``eval_dataset``. A ``str`` reward is a reward model's id, as in TRL.
"""

from __future__ import annotations

import os
import shutil
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from maxent_grpo.config.trl import convert_with_origin, name_trl_field
from maxent_grpo.errors import ConfigError
from maxent_grpo.front.callbacks import TrainerState, observers
from maxent_grpo.front.grpo_config import FIELDS, GRPOConfig
from maxent_grpo.front.objects import Given, lora_keys

__all__ = ["GRPOTrainer"]

# TRL feeds a dataset's prompt column as it is: no instruction, system prompt or solved example added.
_AS_GIVEN = {"data.size": None, "data.instruction": None, "data.system_prompt": None, "data.few_shot": [],
             "data.task_kwargs": {}}
# Files of a checkpoint that are the trainer's state, not the model (save_model leaves them out).
_STATE_FILES = {"optimizer.pt", "optimizer", "scheduler.pt", "rng_state.pt", "trainer_state.json", "manifest.json",
                "reference.safetensors"}


def _config_keys(trl_fields: dict, model: Any, peft_config: Any) -> tuple[dict, list, dict]:
    """Our config keys for a TRL script's fields (and ``peft_config``), the converter's notes, and which TRL
    field each key came from."""
    keys, notes, origin = convert_with_origin(trl_fields, FIELDS)
    keys.update(_AS_GIVEN)
    if peft_config is not None:
        from maxent_grpo.models import is_peft_model

        if is_peft_model(model):
            raise ConfigError("peft_config: the model is a peft model already; give its base model with a "
                              "peft_config, or the peft model alone")
        keys.update({**lora_keys(peft_config, "peft_config"), "model.lora.enabled": True})
    return keys, notes, origin


class GRPOTrainer:
    """TRL's ``GRPOTrainer(model, reward_funcs, args, train_dataset, eval_dataset, processing_class,
    reward_processing_classes, callbacks, optimizers, quantization_config, peft_config, tools,
    rollout_func, environment_factory)``, then ``train()``, ``evaluate()``, ``save_model()`` and
    ``state.log_history``."""

    def __init__(
        self,
        model: Any,
        reward_funcs: Any = None,
        args: GRPOConfig | None = None,
        train_dataset: Any = None,
        eval_dataset: Any = None,
        processing_class: Any = None,
        reward_processing_classes: Any = None,
        callbacks: Sequence[Any] | None = None,
        optimizers: tuple = (None, None),
        quantization_config: Any = None,
        peft_config: Any = None,
        tools: Sequence[Callable] | None = None,
        rollout_func: Callable | None = None,
        environment_factory: Any = None,
    ):
        if isinstance(model, os.PathLike):
            model = os.fspath(model)
        if args is None:
            name = model if isinstance(model, str) else getattr(model.config, "_name_or_path", "") or "model"
            args = GRPOConfig(f"{name.rstrip('/').split('/')[-1]}-GRPO")
        if not isinstance(args, GRPOConfig):
            raise ConfigError(f"args: a {type(args).__name__}; give maxent_grpo.GRPOConfig (TRL's fields, names and defaults)")
        _refuse_what_has_no_counterpart(optimizers, quantization_config, rollout_func, train_dataset)
        self.args = args
        trl_fields = args.given()
        keys, self.notes, origin = _config_keys(trl_fields, model, peft_config)
        # Each step's metrics reach the main process's state (the one that writes metrics.jsonl).
        self.state = TrainerState(is_world_process_zero=os.environ.get("RANK", "0") == "0",
                                  is_local_process_zero=os.environ.get("LOCAL_RANK", "0") == "0")
        given = Given(model=model, processing_class=processing_class, reward_funcs=reward_funcs,
                      reward_weights=args.reward_weights, reward_processing_classes=reward_processing_classes,
                      train_dataset=train_dataset, eval_dataset=eval_dataset, environment_factory=environment_factory,
                      tools=tools, callbacks=observers(callbacks or (), self.state, args))
        self._observer = given.callbacks[0]
        from maxent_grpo.front.train import compile_given

        try:
            self.plan = compile_given({}, given, keys, trl_conventions=True)
        except ConfigError as err:
            raise name_trl_field(err, origin, trl_fields) from None
        self.model = None if isinstance(model, str) else model
        self.processing_class = self.plan.model.given_tokenizer  # given, or a model object's (None: its folder's)
        self.train_dataset, self.eval_dataset = train_dataset, eval_dataset
        self.summary = None

    @property
    def output_dir(self) -> Path:
        return Path(self.plan.logging.output_dir)

    def train(self, resume_from_checkpoint: str | bool | None = None, **kwargs: Any):
        """Train (TRL's ``resume_from_checkpoint``: True for the latest complete checkpoint in
        ``output_dir``, or a checkpoint folder); return TRL's ``TrainOutput(global_step, training_loss,
        metrics)``. ``state.log_history`` holds each step's metrics and the run's totals."""
        from transformers.trainer_utils import TrainOutput

        from maxent_grpo.training.loop import train as run

        if kwargs:
            raise ConfigError(f"train: {sorted(kwargs)[0]} is not taken here (resume_from_checkpoint only)")
        main = os.environ.get("RANK", "0") == "0"
        for note in self.notes if main else ():
            print(f"maxent-grpo: GRPOConfig.{note}", file=sys.stderr)
        self.state.max_steps = self.plan.schedule.max_steps or 0
        if hasattr(self.train_dataset, "__len__"):
            processes = int(os.environ.get("WORLD_SIZE", "1"))
            self.state.steps_per_epoch = len(self.train_dataset) / (self.plan.batch.prompts_per_step * processes)
        self._observer.event("on_train_begin")
        t0 = time.perf_counter()
        self.summary = run(self.plan, resume=resume_from_checkpoint or None)
        runtime = time.perf_counter() - t0
        steps = self.summary.steps
        losses = [m["loss"] for m in self.summary.metrics if "loss" in m and m["loss"] is not None]
        train_loss = sum(losses) / len(losses) if losses else 0.0
        metrics = {"train_runtime": runtime, "train_steps_per_second": steps / runtime if runtime else 0.0,
                   "train_loss": train_loss}
        self.state.global_step = steps
        self.state.log_history.append({**metrics, "epoch": self.state.epoch, "step": steps})
        self._observer.event("on_train_end")
        return TrainOutput(steps, train_loss, metrics)

    def evaluate(self, eval_dataset: Any = None, ignore_keys: Any = None, metric_key_prefix: str = "eval") -> dict:
        """This library's evaluation of the current model (the trained one after ``train()``) on
        ``eval_dataset`` (default: the trainer's): ``eval_pass@1``, ``eval_pass@k``, ``eval_mean@k``,
        ``eval_distinct@k``, ``eval_greedy_pass@1`` and each reward's mean (front/evaluation.py), added to
        ``state.log_history``; callbacks get ``on_evaluate``. Written to ``OUTPUT_DIR/eval/trainer-step-N``."""
        from maxent_grpo.front.evaluation import evaluate_trainer_model
        from maxent_grpo.rewards.context import TrainerState as RewardTrainerState

        if self.model is not None:
            model = self.model
        elif self.summary is not None and self.summary.checkpoint is not None:
            model = self.summary.checkpoint
        else:
            model = self.plan.model.name_or_path
        step = self.state.global_step
        metrics = evaluate_trainer_model(self.plan, model, self.processing_class,
                                         self.eval_dataset if eval_dataset is None else eval_dataset,
                                         self.output_dir / "eval" / f"trainer-step-{step}",
                                         RewardTrainerState(step, self.state.max_steps, self.state.epoch),
                                         metric_key_prefix)
        self.state.log_history.append({**metrics, "epoch": self.state.epoch, "step": step})
        self._observer.event("on_evaluate", metrics=metrics)
        return metrics

    def save_model(self, output_dir: str | None = None) -> Path:
        """The trained model (a peft model: its adapter) and tokenizer to ``output_dir`` (default:
        ``args.output_dir``), in Hugging Face format: the final checkpoint's model files."""
        if self.summary is None or self.summary.checkpoint is None:
            raise ConfigError("save_model: no trained model to save yet (call train() first; with "
                              "checkpoint.save_final off there is no final checkpoint)")
        out = Path(output_dir or self.args.output_dir)
        out.mkdir(parents=True, exist_ok=True)
        for path in self.summary.checkpoint.iterdir():
            if path.name in _STATE_FILES:
                continue
            if path.is_dir():
                shutil.copytree(path, out / path.name, dirs_exist_ok=True)
            else:
                shutil.copy2(path, out / path.name)
        return out


def _refuse_what_has_no_counterpart(optimizers, quantization_config, rollout_func, train_dataset) -> None:
    """TRL's arguments this library does not take, each refused in one line naming it."""
    if tuple(optimizers) != (None, None):
        raise ConfigError("optimizers: a custom optimizer and scheduler are not taken here; set GRPOConfig.optim, "
                          "lr_scheduler_type and their fields")
    if quantization_config is not None:
        raise ConfigError("quantization_config: quantised training is not supported here")
    if rollout_func is not None:
        raise ConfigError("rollout_func: a custom rollout is not taken here; multi-turn rollouts run through "
                          "environment_factory or tools")
    if train_dataset is None:
        raise ConfigError("train_dataset: required (a datasets.Dataset or IterableDataset with a prompt column)")
