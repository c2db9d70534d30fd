"""Objects a Python caller hands the compiler beside the config: ``python:NAME`` references.

The command line names everything by string (a model folder, a data source, ``module:function``).
From Python (``maxent_grpo.train`` and ``maxent_grpo.GRPOTrainer``) the same run can take objects
instead: a loaded model (peft-wrapped included) and its tokenizer, reward functions (lambdas,
closures, bound methods, ``async def``), datasets built in memory, an environment class, and
``transformers`` callbacks. The config then records each object by a reference that starts with
``python:`` (``model.name_or_path: python:LlamaForCausalLM``, ``rewards: [{name: python:my_reward}]``,
``data.source: python:train_dataset``, ``environment.classes: {Env: python:Env}``), so its saved copy
says what the run was given, and ``compile_run`` puts each object into the plan record that uses it.
Below the compiler nothing looks an object up by name.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

from maxent_grpo.errors import ConfigError

PYTHON_PREFIX = "python:"


def is_python_reference(value: Any) -> bool:
    return isinstance(value, str) and value.startswith(PYTHON_PREFIX)


@dataclass(frozen=True)
class PythonObjects:
    """What ``python:`` references in a config point to (all empty: a run from the command line)."""

    model: Any = None  # a loaded causal LM (transformers PreTrainedModel, or a peft model around one)
    tokenizer: Any = None  # its tokenizer (TRL's processing_class); None: loaded from the model's folder
    rewards: Mapping[str, Callable] = field(default_factory=dict)  # "python:NAME" -> reward function
    train_dataset: Any = None  # a datasets.Dataset / IterableDataset, or a list of row dicts
    eval_dataset: Any = None  # held-out prompts for in-loop evaluation (in place of data.eval_size)
    # "python:NAME" -> an environment class (or factory) of environment.classes, or a tool of environment.tools
    environments: Mapping[str, Callable] = field(default_factory=dict)
    callbacks: tuple = ()  # transformers TrainerCallback objects, and the trainer's own observers

    def reward(self, reference: str, key: str) -> Callable:
        return _lookup(self.rewards, reference, key, "reward function")

    def environment(self, reference: str, key: str) -> Callable:
        return _lookup(self.environments, reference, key, "environment class")


def _lookup(table: Mapping[str, Any], reference: str, key: str, kind: str) -> Any:
    if reference not in table:
        raise ConfigError(missing_object(key, reference, kind))
    return table[reference]


def missing_object(key: str, reference: str, kind: str) -> str:
    """The line for a ``python:`` reference with no object behind it (a Python run's saved config
    given to the command line, or a dict config written by hand)."""
    return (f"{key}: {reference!r} names a {kind} given as a Python object (maxent_grpo.train or "
            "GRPOTrainer), and none was given; from the command line name it as module:function or a path")


# ------------------------------------------------------------------ resolution (compile_run)

def resolve_rewards(entries, objects: PythonObjects) -> tuple:
    """The plan's reward entries: a ``python:`` one becomes a :class:`GivenReward` holding its function."""
    from maxent_grpo.rewards.registry import GivenReward

    out = []
    for i, entry in enumerate(entries):
        if not is_python_reference(entry.name):
            out.append(entry)
            continue
        if entry.kwargs:
            raise ConfigError(f"rewards[{i}].kwargs: a reward given as a Python object takes no kwargs (bind them "
                              "with functools.partial or a closure)")
        func = objects.reward(entry.name, f"rewards[{i}].name")
        out.append(GivenReward(entry.name.removeprefix(PYTHON_PREFIX), func, entry.weight, entry.timeout_s))
    return tuple(out)


def resolve_model(name_or_path: str, objects: PythonObjects) -> tuple[Any, Any]:
    """``(model, tokenizer)`` given as objects: the model for a ``python:`` one (else None), and the
    tokenizer given (None: read from the model's folder)."""
    if not is_python_reference(name_or_path):
        return None, objects.tokenizer
    if objects.model is None:
        raise ConfigError(missing_object("model.name_or_path", name_or_path, "model"))
    check_model_devices(objects.model)
    return objects.model, objects.tokenizer


def check_model_devices(model: Any) -> None:
    """One line for a model object whose weights are not in one place that can train: on the meta
    device (built, never loaded), or spread over several devices (``device_map``)."""
    devices = {p.device for p in model.parameters()}
    if not devices:
        raise ConfigError(f"model: the {type(model).__name__} object has no parameters")
    if any(d.type == "meta" for d in devices):
        raise ConfigError(f"model: the {type(model).__name__} object's weights are on the meta device (built "
                          "without weights); load it with from_pretrained, or give its folder")
    if len(devices) > 1:
        raise ConfigError(f"model: the {type(model).__name__} object's weights are spread over "
                          f"{', '.join(sorted(map(str, devices)))}; give it on one device (no device_map)")


def resolve_data(source: str, eval_size: int, objects: PythonObjects) -> tuple[Any, Any]:
    """``(training rows, held-out rows)`` given as objects (None where the config names them)."""
    given = None
    if is_python_reference(source):
        if objects.train_dataset is None:
            raise ConfigError(missing_object("data.source", source, "dataset"))
        given = objects.train_dataset
    if objects.eval_dataset is not None and eval_size:
        raise ConfigError(f"data.eval_size: {eval_size} holds rows out of the training data, and an eval_dataset "
                          "is given; give one of them")
    return given, objects.eval_dataset


def resolve_environment(tools, classes, objects: PythonObjects) -> tuple[tuple, dict]:
    """``environment.tools`` and ``environment.classes`` with each ``python:`` reference replaced by its
    object; the others stay references, imported when the run starts."""
    resolved_tools = tuple(
        objects.environment(ref, f"environment.tools[{i}]") if is_python_reference(ref) else ref
        for i, ref in enumerate(tools))
    resolved_classes = {
        name: objects.environment(ref, f"environment.classes.{name}") if is_python_reference(ref) else ref
        for name, ref in classes.items()}
    return resolved_tools, resolved_classes
