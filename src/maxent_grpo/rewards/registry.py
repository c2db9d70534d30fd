"""Reward functions by name, the configured set of them, and their checked evaluation.

`REWARD_FUNCTIONS` maps each built-in name to its factory (each registers itself where it is
defined: ``rewards/catalog.py``). A config entry names a
built-in or any importable `module:function`; `evaluate_rewards` calls every
function the way TRL's GRPOTrainer does (`f(prompts=..., completions=...,
**columns)`), so reward functions written for TRL run unchanged, and checks what
comes back before it becomes a `[N, K]` float64 matrix (NaN where a function
returned None).
"""

from __future__ import annotations

import dataclasses
import importlib
import difflib
import functools
import math
import numbers
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from maxent_grpo.errors import UserError
from maxent_grpo.rewards import builtin
from maxent_grpo.rewards.catalog import REWARD_FUNCTIONS, RewardFunction
from maxent_grpo.rewards.context import RewardContext, accepted_keywords
from maxent_grpo.rewards.invoke import call_all
from maxent_grpo.rewards.user_code import import_reference, split_reference
from maxent_grpo.rollout.backend import RolloutBatch

# The modules whose reward factories register themselves where they are defined (rewards/catalog.py),
# besides builtin: imported for that alone.
for _module in ("code", "modebench", "reward_model"):
    importlib.import_module(f"maxent_grpo.rewards.{_module}")


@dataclass
class RewardEntry:
    """One entry of the config's ``rewards:`` list: a reward function by name, its weight in the
    weighted sum, its keyword arguments, and the seconds one call may take (None: no limit; a call
    that runs longer fails the batch)."""

    name: str
    weight: float = 1.0
    kwargs: dict[str, Any] = dataclasses.field(default_factory=dict)
    timeout_s: float | None = None


@dataclass(frozen=True)
class GivenReward:
    """A reward function given as a Python object (``maxent_grpo.train``, ``GRPOTrainer``): used as it
    is, under ``name`` in the metrics; the config records it as ``python:NAME``."""

    name: str
    func: Callable
    weight: float = 1.0
    timeout_s: float | None = None


class RewardConfigError(UserError, ValueError):
    """A ``rewards`` entry names no usable function; the message names the entry."""


class RewardFunctionError(UserError, ValueError):
    """A reward function failed or returned something unusable; the message names it."""

    def __init__(self, function_name: str, message: str):
        super().__init__(f"reward function '{function_name}': {message}")
        self.function_name = function_name


def resolve_reward_function(name_or_path: str, **kwargs: Any) -> RewardFunction:
    """The reward function for a registry name, built by its factory with `kwargs`,
    or the object at `module:function`. For an imported object, `kwargs` mean that
    it is a factory: it is called with them and must return the reward function."""
    if ":" in name_or_path:
        obj = import_reference(name_or_path)
        fn = obj(**kwargs) if kwargs else obj
    elif name_or_path in REWARD_FUNCTIONS:
        fn = REWARD_FUNCTIONS[name_or_path](**kwargs)
    else:
        close = difflib.get_close_matches(name_or_path, list(REWARD_FUNCTIONS), n=1)
        hint = f"did you mean '{close[0]}'? " if close else ""
        raise RewardConfigError(
            f"unknown reward function {name_or_path!r}: {hint}"
            f"valid names: {sorted(REWARD_FUNCTIONS)}, or an importable 'module:function'"
        )
    if not callable(fn):
        raise RewardConfigError(f"reward function {name_or_path!r} resolved to a non-callable {type(fn).__name__}")
    return fn


@dataclass(frozen=True)
class RewardSpec:
    """The configured reward functions, their names (for logs) and weights."""

    names: tuple[str, ...]
    funcs: tuple[RewardFunction, ...]
    weights: tuple[float, ...]
    # Seconds each call may take (None: no limit); empty means no limits at all.
    timeouts: tuple[float | None, ...] = ()

    def __post_init__(self) -> None:
        if not self.names:
            raise RewardConfigError("names: at least one reward function is needed")
        if not len(self.names) == len(self.funcs) == len(self.weights):
            raise RewardConfigError(
                f"names, funcs and weights must have one entry per function, got "
                f"{len(self.names)}, {len(self.funcs)} and {len(self.weights)}"
            )
        duplicates = sorted({n for n in self.names if self.names.count(n) > 1})
        if duplicates:
            raise RewardConfigError(f"names: each reward function may appear once, repeated: {duplicates}")
        for name, weight in zip(self.names, self.weights):
            if not math.isfinite(weight):
                raise RewardConfigError(f"weights: reward '{name}' has a non-finite weight {weight}")

    def weight_tensor(self) -> torch.Tensor:
        """Weights as a float64 tensor [K], aligned with the columns of `evaluate_rewards`."""
        return torch.tensor(self.weights, dtype=torch.float64)


_ENTRY_KEYS = {"name", "weight", "kwargs", "timeout_s"}


def _entry_fields(entry: Any, index: int) -> tuple[str, float, dict[str, Any], float | None]:
    if isinstance(entry, str):
        return entry, 1.0, {}, None
    if dataclasses.is_dataclass(entry) and not isinstance(entry, type):
        entry = {f.name: getattr(entry, f.name) for f in dataclasses.fields(entry)}
    if isinstance(entry, Mapping):
        unknown = sorted(set(entry) - _ENTRY_KEYS)
        if unknown:
            raise RewardConfigError(f"rewards[{index}]: unknown keys {unknown}; allowed: {sorted(_ENTRY_KEYS)}")
        if "name" not in entry:
            raise RewardConfigError(f"rewards[{index}]: 'name' is required")
        name, weight, kwargs = entry["name"], entry.get("weight", 1.0), entry.get("kwargs") or {}
        timeout = entry.get("timeout_s")
    else:
        raise RewardConfigError(
            f"rewards[{index}] must be a name, a mapping or a dataclass with {sorted(_ENTRY_KEYS)}, "
            f"got {type(entry).__name__}"
        )
    if not isinstance(name, str) or not name:
        raise RewardConfigError(f"rewards[{index}].name must be a non-empty str, got {name!r}")
    if isinstance(weight, bool) or not isinstance(weight, numbers.Real):
        raise RewardConfigError(f"rewards[{index}].weight must be a number, got {weight!r}")
    if not isinstance(kwargs, Mapping):
        raise RewardConfigError(f"rewards[{index}].kwargs must be a mapping, got {type(kwargs).__name__}")
    if timeout is not None and (isinstance(timeout, bool) or not isinstance(timeout, numbers.Real) or timeout <= 0):
        raise RewardConfigError(f"rewards[{index}].timeout_s must be a positive number of seconds, got {timeout!r}")
    return name, float(weight), dict(kwargs), None if timeout is None else float(timeout)


def build_reward_spec(entries: Sequence[Any]) -> RewardSpec:
    """A RewardSpec from config entries: `{"name": ..., "weight": 1.0, "kwargs": {...}}`
    mappings, dataclasses with those fields (:class:`RewardEntry`), or bare names (weight 1);
    and functions given as objects (:class:`GivenReward`)."""
    if isinstance(entries, (str, Mapping)) or not isinstance(entries, Sequence):
        raise RewardConfigError(f"rewards must be a list of entries, got {type(entries).__name__}")
    names, funcs, weights, timeouts = [], [], [], []
    for index, entry in enumerate(entries):
        if isinstance(entry, GivenReward):
            names.append(entry.name)
            funcs.append(entry.func)
            weights.append(entry.weight)
            timeouts.append(entry.timeout_s)
            continue
        name, weight, kwargs, timeout = _entry_fields(entry, index)
        try:
            fn = resolve_reward_function(name, **kwargs)
        except TypeError as exc:  # a factory given an option it does not take
            raise RewardConfigError(f"rewards[{index}] ({name}): bad kwargs {sorted(kwargs)}: {exc}") from exc
        names.append(display_name(name))
        funcs.append(fn)
        weights.append(weight)
        timeouts.append(timeout)
    return RewardSpec(tuple(names), tuple(funcs), tuple(weights), tuple(timeouts))


def display_name(name: str) -> str:
    """The name metrics use: ``file.py:function`` for a file path, else the configured name."""
    if ":" in name:
        module, attr = split_reference(name)
        if module.endswith(".py"):
            return f"{Path(module).name}:{attr}"
    return name


def _check_output(name: str, values: Any, n: int) -> list[float]:
    if not isinstance(values, (list, tuple)):
        raise RewardFunctionError(name, f"returned {type(values).__name__}, expected a list of {n} floats or None")
    if len(values) != n:
        raise RewardFunctionError(name, f"returned {len(values)} values for {n} completions")
    out = []
    for row, value in enumerate(values):
        if value is None:
            out.append(math.nan)
            continue
        if isinstance(value, bool) or not isinstance(value, numbers.Real):
            raise RewardFunctionError(name, f"row {row}: returned {value!r} ({type(value).__name__}), not a number")
        if not math.isfinite(value):
            raise RewardFunctionError(name, f"row {row}: returned non-finite {value}; return None for 'not applicable'")
        out.append(float(value))
    return out


def grouped_reward_inputs(
    rows: list[dict], completion_texts: list[str], completion_ids: list[list[int]], num_generations: int
) -> tuple[list, list, dict[str, list]]:
    """``(prompts, completions, columns)`` for :func:`evaluate_rewards`, the way TRL builds them.

    ``rows`` are the P dataset rows; completions are prompt-major, ``num_generations`` per row.
    Conversational prompts get conversational completions; every dataset column (and
    ``completion_ids``) is repeated per completion.
    """
    g = num_generations
    conversational = isinstance(rows[0]["prompt"], list)
    prompts = [r["prompt"] for r in rows for _ in range(g)]
    completions = (
        [[{"role": "assistant", "content": t}] for t in completion_texts] if conversational else list(completion_texts)
    )
    columns = {k: [r[k] for r in rows for _ in range(g)] for k in rows[0] if k != "prompt"}
    columns["completion_ids"] = [list(ids) for ids in completion_ids]
    return prompts, completions, columns


def rollout_reward_inputs(rows: list[dict], rollout: RolloutBatch) -> tuple[list, list, dict[str, list]]:
    """:func:`grouped_reward_inputs` of a rollout, with its episodes' own scores (``environment_reward``)
    for the ``environment`` reward function when it holds multi-turn episodes."""
    prompts, completions, columns = grouped_reward_inputs(
        rows, rollout.completion_texts, rollout.completion_ids, rollout.num_generations)
    if rollout.env_rewards is not None:
        columns[builtin.ENV_REWARD_COLUMN] = list(rollout.env_rewards)
    return prompts, completions, columns


def evaluate_rewards(
    spec: RewardSpec, prompts: list, completions: list, columns: Mapping[str, list],
    context: RewardContext | None = None,
) -> torch.Tensor:
    """Rewards as a float64 tensor [N, K] (K = functions in `spec`), NaN where a
    function returned None. Raises `RewardFunctionError` naming the function when
    one raises, returns the wrong number of values, or a non-finite / non-number.
    ``context``: TRL's keywords (``rewards/context.py``), each passed to the functions that take it."""
    n = len(completions)
    if len(prompts) != n:
        raise ValueError(f"prompts has {len(prompts)} entries for {n} completions")
    for key, values in columns.items():
        if key in ("prompts", "completions"):
            raise ValueError(f"columns: '{key}' is reserved for the reward functions' own argument")
        if len(values) != n:
            raise ValueError(f"columns['{key}'] has {len(values)} values for {n} completions")
    out = torch.empty((n, len(spec.funcs)), dtype=torch.float64)
    timeouts = spec.timeouts or (None,) * len(spec.funcs)
    funcs = spec.funcs
    if context is not None:
        extra = context.keywords()
        funcs = tuple(functools.partial(fn, **{k: extra[k] for k in accepted_keywords(fn)}) for fn in funcs)
    outputs = call_all(funcs, timeouts, dict(prompts=prompts, completions=completions, **columns))
    for k, (name, result) in enumerate(zip(spec.names, outputs)):
        if result.error is not None:
            raise RewardFunctionError(name, result.error) from result.exception
        out[:, k] = torch.tensor(_check_output(name, result.value, n), dtype=torch.float64)
    return out
