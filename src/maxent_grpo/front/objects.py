"""Python objects as config keys plus the objects themselves (config/python_objects.py).

Both front doors call :func:`gather`: each object becomes a ``python:`` reference at the key the
command line would have used (so the run's saved ``config.yaml`` says what it was given) and an
entry of :class:`PythonObjects`, which ``compile_run`` puts into the plan.
"""

from __future__ import annotations

import functools
import os
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from maxent_grpo.config.python_objects import PYTHON_PREFIX, PythonObjects
from maxent_grpo.errors import ConfigError, UserError

__all__ = ["Given", "callable_name", "gather"]


@dataclass
class Given:
    """What the front door was handed, before it becomes keys and objects."""

    model: Any = None  # a path or hub id (str), or a loaded model
    processing_class: Any = None
    reward_funcs: Any = None  # one or a list: callables, reward-model objects, names (see gather)
    reward_weights: Sequence[float] | None = None
    reward_processing_classes: Any = None
    train_dataset: Any = None
    eval_dataset: Any = None
    environment_factory: Any = None  # a class or factory, or a dict name -> one (rows pick by 'environment')
    tools: Sequence[Callable] | None = None
    callbacks: Sequence[Any] = field(default_factory=tuple)  # tracker-like observers


def callable_name(func: Callable) -> str:
    """TRL's display name of a reward function: a partial's function, else ``__name__``, else the class."""
    while isinstance(func, functools.partial):
        func = func.func
    return getattr(func, "__name__", type(func).__name__)


def gather(given: Given, *, trl_conventions: bool) -> tuple[dict[str, Any], PythonObjects]:
    """``(dotted config keys, objects)``. With ``trl_conventions`` (``GRPOTrainer``) the rewards are
    ``reward_funcs`` alone (and an environment's ``get_reward``), and a ``str`` reward is a reward
    model's id; without (``maxent_grpo.train``) a ``str`` reward is a name as the config's ``rewards``
    takes (a built-in or ``module:function``), and no ``reward_funcs`` leaves the config's rewards."""
    keys: dict[str, Any] = {}
    model, tokenizer = given.model, given.processing_class
    if isinstance(model, os.PathLike):
        model = os.fspath(model)
    if model is not None and not isinstance(model, str):
        keys.update(_model_keys(model))
        if tokenizer is None:
            tokenizer = _tokenizer_of(model)
    elif isinstance(model, str):
        keys["model.name_or_path"] = model
    rewards: dict[str, Callable] = {}
    if trl_conventions or given.reward_funcs is not None:
        keys["rewards"], rewards = _rewards(given, trl_conventions)
    if given.train_dataset is not None:
        keys["data.source"] = f"{PYTHON_PREFIX}train_dataset"
    if isinstance(given.eval_dataset, Mapping):
        raise ConfigError("eval_dataset: a dict of datasets is not supported here; give one dataset")
    environments, env_keys = _environments(given)
    keys.update(env_keys)
    objects = PythonObjects(
        model=None if isinstance(model, str) else model, tokenizer=tokenizer, rewards=rewards,
        train_dataset=given.train_dataset, eval_dataset=given.eval_dataset, environments=environments,
        callbacks=tuple(given.callbacks),
    )
    return keys, objects


# ------------------------------------------------------------------ the model

def _model_keys(model: Any) -> dict[str, Any]:
    if not isinstance(model, torch.nn.Module):
        raise ConfigError(f"model: expected a path, a hub id or a loaded causal LM, got {type(model).__name__}")
    from maxent_grpo.models import is_peft_model

    dtypes = {p.dtype for p in model.parameters()}

    keys: dict[str, Any] = {"model.name_or_path": f"{PYTHON_PREFIX}{type(model).__name__}"}
    if is_peft_model(model):
        keys.update(_peft_keys(model))
        base = {p.dtype for n, p in model.named_parameters() if "lora_" not in n}
        dtypes = base or dtypes
    dtype = next(iter(dtypes)) if len(dtypes) == 1 else None
    names = {torch.float32: "float32", torch.bfloat16: "bfloat16"}
    if dtype not in names:
        found = ", ".join(sorted(str(d).removeprefix("torch.") for d in dtypes))
        raise ConfigError(f"model: the {type(model).__name__} object's weights are {found}; trained here in float32 "
                          "or bfloat16 (model.to(torch.float32))")
    keys["model.dtype"] = names[dtype]
    return keys


def _peft_keys(model: Any) -> dict[str, Any]:
    """A peft model's LoRA adapter as the model.lora keys (the record of the run; the adapters are the model's)."""
    configs = dict(model.peft_config)
    if len(configs) != 1:
        raise ConfigError(f"model: the peft model holds {len(configs)} adapters ({', '.join(configs)}); one is trained here")
    config = next(iter(configs.values()))
    return {**lora_keys(config, "model"), "model.lora.enabled": True}


# The LoraConfig fields the model.lora keys hold; any other that differs from peft's default is refused.
_LORA_FIELDS = {"r": "r", "lora_alpha": "alpha", "lora_dropout": "dropout", "target_modules": "target_modules",
                "use_rslora": "use_rslora"}
_LORA_FREE = {"task_type", "peft_type", "base_model_name_or_path", "revision", "inference_mode", "auto_mapping",
              "peft_version", "fan_in_fan_out", "init_lora_weights"}


def lora_keys(config: Any, name: str) -> dict[str, Any]:
    """``model.lora`` keys from a peft ``LoraConfig`` (``name``: the argument, for errors)."""
    from peft import LoraConfig

    if not isinstance(config, LoraConfig):
        raise ConfigError(f"{name}: a {type(config).__name__} adapter; only LoRA adapters are trained here")
    if config.task_type not in (None, "CAUSAL_LM"):
        raise ConfigError(f"{name}: task_type {config.task_type!r}; the policy is a causal LM (CAUSAL_LM)")
    default = LoraConfig()
    for f in vars(default):
        if f in _LORA_FIELDS or f in _LORA_FREE or f.startswith("_"):
            continue
        if getattr(config, f, None) != getattr(default, f):
            raise ConfigError(f"{name}: LoraConfig.{f}={getattr(config, f)!r} has no counterpart here (model.lora "
                              "takes r, lora_alpha, lora_dropout, target_modules, use_rslora)")
    targets = config.target_modules
    keys = {f"model.lora.{ours}": getattr(config, theirs) for theirs, ours in _LORA_FIELDS.items() if theirs != "target_modules"}
    keys["model.lora.alpha"] = int(config.lora_alpha) if float(config.lora_alpha).is_integer() else config.lora_alpha
    if targets is not None:
        keys["model.lora.target_modules"] = [targets] if isinstance(targets, str) else sorted(targets)
    return keys


def _tokenizer_of(model: Any):
    """TRL's default processing class: the tokenizer of the folder the model object came from."""
    from maxent_grpo.models import load_tokenizer

    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    source = getattr(base.config, "_name_or_path", "") or ""
    try:
        return load_tokenizer(source)
    except (UserError, OSError, ValueError) as err:
        raise ConfigError(f"processing_class: none given, and the tokenizer of the model object's folder "
                          f"({source!r}) cannot be loaded ({err}); pass processing_class=tokenizer") from None


# ------------------------------------------------------------------ rewards

def _rewards(given: Given, strings_are_models: bool) -> tuple[list[dict], dict[str, Callable]]:
    funcs = given.reward_funcs
    funcs = [] if funcs is None else list(funcs) if isinstance(funcs, (list, tuple)) else [funcs]
    processing = given.reward_processing_classes
    processing = [None] * len(funcs) if processing is None else (
        list(processing) if isinstance(processing, (list, tuple)) else [processing])
    if len(processing) != len(funcs):
        raise ConfigError(f"reward_processing_classes: {len(processing)} for {len(funcs)} reward functions")
    entries, table = [], {}
    for i, (func, tokenizer) in enumerate(zip(funcs, processing)):
        if isinstance(func, str) and not strings_are_models:
            entries.append({"name": func})
            continue
        if isinstance(func, str) or isinstance(func, torch.nn.Module):
            name, func = _reward_model(func, tokenizer, i)
        elif callable(func):
            name = callable_name(func)
        else:
            raise ConfigError(f"reward_funcs[{i}]: expected a function, a reward model or its id, got "
                              f"{type(func).__name__}")
        name = _unique(name, table)
        table[f"{PYTHON_PREFIX}{name}"] = func
        entries.append({"name": f"{PYTHON_PREFIX}{name}"})
    weights = given.reward_weights
    if weights is not None:
        if len(weights) != len(entries):
            raise ConfigError(f"reward_weights: {len(weights)} weights for {len(entries)} reward functions")
        for entry, weight in zip(entries, weights):
            entry["weight"] = float(weight)
    if _environment_reward(given.environment_factory):
        entries.append({"name": "environment"})  # TRL: an environment's get_reward, weight 1
    if not entries:
        raise ConfigError("reward_funcs: no reward function (and no environment with get_reward)")
    return entries, table


def _unique(name: str, taken: Mapping[str, Any]) -> str:
    base = name.replace("<lambda>", "lambda")
    name, n = base, 1
    while f"{PYTHON_PREFIX}{name}" in taken:
        n += 1
        name = f"{base}_{n}"
    return name


def _reward_model(model: Any, tokenizer: Any, index: int) -> tuple[str, Callable]:
    """A sequence classifier (an id, or the object) as a reward function, as TRL scores with one."""
    from maxent_grpo.rewards.reward_model import make_reward_model, reward_model_function

    if isinstance(model, str):
        if tokenizer is None:
            return model.rstrip("/").split("/")[-1], make_reward_model(model=model)
        from transformers import AutoModelForSequenceClassification

        model = AutoModelForSequenceClassification.from_pretrained(model, num_labels=1)
    source = getattr(model.config, "_name_or_path", "") or type(model).__name__
    if tokenizer is None:
        from transformers import AutoTokenizer

        tokenizer = AutoTokenizer.from_pretrained(source)
    return source.rstrip("/").split("/")[-1], reward_model_function(model, tokenizer)


# ------------------------------------------------------------------ environments

def _factories(factory: Any) -> dict[str, Any]:
    if factory is None:
        return {}
    if isinstance(factory, Mapping):
        return dict(factory)
    name = factory.__name__ if isinstance(factory, type) else callable_name(factory)
    return {name: factory}


def _environment_reward(factory: Any) -> bool:
    return any(hasattr(f if isinstance(f, type) else type(f()), "get_reward") for f in _factories(factory).values())


def _environments(given: Given) -> tuple[dict[str, Any], dict[str, Any]]:
    objects, keys = {}, {}
    factories = _factories(given.environment_factory)
    for name, factory in factories.items():
        if not callable(factory):
            raise ConfigError(f"environment_factory: {name!r} is a {type(factory).__name__}, not a class or factory")
        objects[f"{PYTHON_PREFIX}{name}"] = factory
    if factories:
        keys["environment.classes"] = {name: f"{PYTHON_PREFIX}{name}" for name in factories}
        if len(factories) == 1:
            keys["environment.name"] = next(iter(factories))
    tools = list(given.tools or [])
    for i, tool in enumerate(tools):
        if not callable(tool):
            raise ConfigError(f"tools[{i}]: a {type(tool).__name__} is not a function")
        objects[f"{PYTHON_PREFIX}{callable_name(tool)}"] = tool
    if tools:
        keys["environment.tools"] = [f"{PYTHON_PREFIX}{callable_name(t)}" for t in tools]
    return objects, keys
