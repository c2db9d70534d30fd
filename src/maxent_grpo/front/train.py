"""``maxent_grpo.train``: a run from Python, with objects where the command line takes names.

::

    import maxent_grpo

    summary = maxent_grpo.train(
        {"method": "grpo", "training": {"max_steps": 20}},   # a path, a dict of sections, or a TrainConfig
        model=model,                  # a folder, a hub id, or a loaded model (peft-wrapped included)
        reward_funcs=[my_reward, "format"],   # callables, built-in names, module:function
        train_dataset=dataset,        # a datasets.Dataset / IterableDataset, or a list of row dicts
    )

The config is read as ``maxent-grpo train --config`` reads it (presets, each key's checks), the
objects become ``python:`` references in it and values in the plan (front/objects.py), and the run
is the command line's: the same compile, progress bar, checkpoints, resume, signals and metrics.
"""

from __future__ import annotations

import copy
import dataclasses
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

from maxent_grpo.config.load import config_from_tree, parse_override, read_yaml, to_dict
from maxent_grpo.config.schema import DEFAULT_SOURCE, TrainConfig
from maxent_grpo.errors import ConfigError
from maxent_grpo.front.objects import Given, gather

__all__ = ["compile_given", "train"]


def train(
    config: str | Path | Mapping[str, Any] | TrainConfig | None = None,
    *,
    model: Any = None,
    processing_class: Any = None,
    reward_funcs: Any = None,
    train_dataset: Any = None,
    eval_dataset: Any = None,
    environment_factory: Any = None,
    tools: Sequence[Callable] | None = None,
    callbacks: Sequence[Any] = (),
    overrides: Sequence[str] | Mapping[str, Any] | None = None,
    resume: str | Path | bool | None = None,
    overwrite: bool = False,
    allow_config_change: bool = False,
):
    """Train, and return the run's :class:`~maxent_grpo.training.loop.RunSummary` (output folder, steps,
    final checkpoint, every step's metrics).

    ``config``: a YAML path, a dict of sections (``{"training": {"max_steps": 20}}``, dotted keys too),
    a :class:`TrainConfig`, or None for the built-in default run. Each object argument replaces the
    config's key: ``model`` (``model.name_or_path``; a model object is trained in place, in its
    dtype), ``processing_class`` (its tokenizer), ``reward_funcs`` (``rewards``: callables, reward
    models, or names as the config takes them), ``train_dataset`` (``data.source``; TRL's formats,
    every column reaching the rewards), ``eval_dataset`` (held-out prompts for ``eval.every_steps``),
    ``environment_factory`` and ``tools`` (``environment``; TRL's conventions). ``callbacks``:
    ``transformers.TrainerCallback`` objects (``on_log``, ``on_step_end`` with each step's metrics) or
    objects with a tracker's ``log(metrics, step)``, ``log_table`` and ``close``. ``overrides``:
    ``KEY=VALUE`` strings or a dict of dotted keys, as ``--set``. ``resume``, ``overwrite`` and
    ``allow_config_change`` are the CLI's ``--resume [PATH|auto]``, ``--overwrite`` and
    ``--allow-config-change``: ``resume="auto"`` (or True) continues from the latest complete checkpoint in
    the output folder, or starts afresh when there is none; a path resumes from that checkpoint.
    Raises :class:`~maxent_grpo.errors.UserError` (one line naming the key, argument, file or row) on bad
    input, before any model loads where it can be known then.
    """
    from maxent_grpo.front.callbacks import observers
    from maxent_grpo.training.loop import train as run

    given = Given(model=model, processing_class=processing_class, reward_funcs=reward_funcs,
                  train_dataset=train_dataset, eval_dataset=eval_dataset, environment_factory=environment_factory,
                  tools=tools, callbacks=observers(callbacks, None))
    plan = compile_given(config, given, overrides, trl_conventions=False)
    return run(plan, resume=resume, overwrite=overwrite, allow_config_change=allow_config_change)


def compile_given(config, given: Given, overrides=None, *, trl_conventions: bool):
    """The plan of ``config`` with ``given``'s objects, compiled once as the command line compiles."""
    from maxent_grpo.config.compile import compile_run
    from maxent_grpo.training.precision import Machine

    tree, config_dir = _tree(config)
    keys, objects = gather(given, trl_conventions=trl_conventions)
    if objects.train_dataset is not None and tree.get("data", {}).get("source", DEFAULT_SOURCE) == DEFAULT_SOURCE:
        # The default task's generator options and solved example mean nothing for the given rows.
        for key in ("task_kwargs", "few_shot"):
            tree.get("data", {}).pop(key, None)
    items = dict(overrides) if isinstance(overrides, Mapping) else dict(parse_override(o) for o in overrides or ())
    cfg = config_from_tree(tree, config_dir, {**items, **keys})
    return compile_run(cfg, Machine.here(), objects)


def _tree(config) -> tuple[dict, Path | None]:
    """The config as a tree of sections, and the folder its references are relative to."""
    if config is None:
        return {}, None
    if isinstance(config, (str, Path)):
        return read_yaml(Path(config)), Path(config).resolve().parent
    if isinstance(config, TrainConfig):
        return to_dict(config), None
    if isinstance(config, Mapping):
        tree: dict = {}
        for key, value in copy.deepcopy(dict(config)).items():
            node = tree
            *parents, leaf = str(key).split(".")
            for part in parents:
                node = node.setdefault(part, {})
            if isinstance(value, Mapping) and isinstance(node.get(leaf), dict):
                node[leaf].update(value)
            else:
                node[leaf] = value
        return tree, None
    if dataclasses.is_dataclass(config):
        raise ConfigError(f"config: a {type(config).__name__}; maxent_grpo.train takes a path, a dict or a "
                          "TrainConfig (a TRL GRPOConfig goes to maxent_grpo.GRPOTrainer)")
    raise ConfigError(f"config: expected a path, a dict of sections or a TrainConfig, got {type(config).__name__}")
