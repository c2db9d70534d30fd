"""The run configuration: YAML loading, overrides, method presets, validation.

One YAML file maps onto :class:`TrainConfig`. Every problem (unknown key, wrong
type, out-of-range value) raises :class:`ConfigError` with a one-line message
naming the dotted key, before any model is loaded.
"""

from __future__ import annotations

import dataclasses
import types
import typing
from pathlib import Path
from typing import Any, Literal

import yaml

from maxent_grpo.core.advantages import advantage_settings_problem
from maxent_grpo.envs.settings import episode_limits
from maxent_grpo.errors import ConfigError
from maxent_grpo.methods import METHODS, get_method
from maxent_grpo.rewards.user_code import resolve_reference
from maxent_grpo.config.python_objects import is_python_reference
from maxent_grpo.config.rules import config_keys, require, suggest
from maxent_grpo.rollout.open_plane import check_data_plane
from maxent_grpo.training.trackers import TRACKER_NAMES
# The sections live in config/schema.py; imported here so that ``config.load``
# stays the one import for the whole configuration.
from maxent_grpo.config.schema import (
    DEFAULT_SOURCE,
    CheckpointConfig,
    DataConfig,
    EvalConfig,
    FewShotExample,
    GenerationConfig,
    LoggingConfig,
    LoraConfig,
    LossSection,
    ModelConfig,
    RewardEntry,
    TrainConfig,
    TrainingConfig,
    VllmConfig,
)


__all__ = [
    "CheckpointConfig", "ConfigError", "DataConfig", "EvalConfig", "FewShotExample", "GenerationConfig",
    "LoggingConfig", "LoraConfig", "LossSection", "ModelConfig", "RewardEntry",
    "TrainConfig", "TrainingConfig", "VllmConfig",
    "build_config", "config_from_tree", "load_config", "parse_override", "read_yaml", "to_dict", "validate",
]


# ---------------------------------------------------------------- conversion

def _coerce(value: Any, hint: Any, key: str) -> Any:
    origin = typing.get_origin(hint)
    args = typing.get_args(hint)
    if hint is Any:
        return value
    if origin in (typing.Union, types.UnionType):
        if value is None and type(None) in args:
            return None
        inner = [a for a in args if a is not type(None)]
        for literal in (a for a in inner[1:] if typing.get_origin(a) is Literal):
            if value in typing.get_args(literal):  # int | Literal["auto"]: the word, else the number
                return value
        return _coerce(value, inner[0], key)
    if origin is Literal:
        if value not in args:
            raise ConfigError(f"{key}: {value!r} is not one of {', '.join(map(str, args))}{suggest(value, args)}")
        return value
    if origin is list:
        if isinstance(value, (str, dict)) or not isinstance(value, (list, tuple)):
            raise ConfigError(f"{key}: expected a list, got {type(value).__name__} {value!r}")
        return [_coerce(v, args[0], f"{key}[{i}]") for i, v in enumerate(value)]
    if origin is dict:
        if not isinstance(value, dict):
            raise ConfigError(f"{key}: expected a mapping, got {type(value).__name__}")
        return dict(value)
    if dataclasses.is_dataclass(hint):
        if isinstance(value, hint):
            return value
        if hint is RewardEntry and isinstance(value, str):
            value = {"name": value}  # a bare name is short for {name: NAME}
        if hint is RewardEntry and isinstance(value, dict) and "model" in value:
            value = _reward_model_entry(value, key)
        if not isinstance(value, dict):
            raise ConfigError(f"{key}: expected a mapping, got {type(value).__name__} {value!r}")
        return _build(hint, value, key)
    if hint is bool:
        if not isinstance(value, bool):
            raise ConfigError(f"{key}: expected true or false, got {value!r}")
        return value
    if hint is int:
        if isinstance(value, bool) or not isinstance(value, int):
            raise ConfigError(f"{key}: expected an integer, got {value!r}")
        return value
    if hint is float:
        if isinstance(value, str):
            # YAML 1.1 reads 5e-5 (no dot) as a string; accept any float literal.
            try:
                value = float(value)
            except ValueError:
                raise ConfigError(f"{key}: expected a number, got {value!r}") from None
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise ConfigError(f"{key}: expected a number, got {value!r}")
        return float(value)
    if hint is str:
        if not isinstance(value, str):
            raise ConfigError(f"{key}: expected a string, got {value!r}")
        return value
    raise TypeError(f"unsupported config type {hint} for {key}")


def _reward_model_entry(value: dict, key: str) -> dict:
    """``{model: PATH_OR_ID, weight: W, kwargs: {...}}`` is short for ``{name: reward_model, weight: W,
    kwargs: {model: PATH_OR_ID, ...}}`` (TRL's ``reward_funcs="org/model"``)."""
    if "name" in value:
        raise ConfigError(f"{key}: give name or model, not both (model is short for name: reward_model)")
    kwargs = value.get("kwargs") or {}
    if not isinstance(kwargs, dict):
        raise ConfigError(f"{key}.kwargs: expected a mapping, got {type(kwargs).__name__}")
    if "model" in kwargs:
        raise ConfigError(f"{key}.kwargs.model: the model is given once, as {key}.model")
    rest = {k: v for k, v in value.items() if k not in ("model", "kwargs")}
    return {"name": "reward_model", **rest, "kwargs": {"model": value["model"], **kwargs}}


def _resolve_model_path(model: Any, config_dir: Path | None) -> Any:
    """A reward model's relative folder beside the config file, else from the current folder, made
    absolute; a hub id (no such folder) stays as it is."""
    if not isinstance(model, str) or Path(model).is_absolute():
        return model
    for base in (config_dir, Path.cwd()):
        if base is not None and (base / model).is_dir():
            return str((base / model).resolve())
    return model


def _build(cls, data: dict, prefix: str):
    hints = typing.get_type_hints(cls)
    names = [f.name for f in dataclasses.fields(cls)]
    for key in data:
        if key not in names:
            where = f"{prefix}.{key}" if prefix else key
            full = [f"{prefix}.{n}" if prefix else n for n in names]
            raise ConfigError(f"unknown config key {where!r}{suggest(where, full)}")
    kwargs = {}
    for f in dataclasses.fields(cls):
        if f.name in data:
            where = f"{prefix}.{f.name}" if prefix else f.name
            kwargs[f.name] = _coerce(data[f.name], hints[f.name], where)
    missing = [
        f.name for f in dataclasses.fields(cls)
        if f.name not in kwargs and f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING
    ]
    if missing:
        raise ConfigError(f"{prefix + '.' if prefix else ''}{missing[0]}: required key is missing")
    return cls(**kwargs)


def to_dict(cfg) -> dict:
    return dataclasses.asdict(cfg)


def _set_dotted(tree: dict, dotted: str, value: Any) -> None:
    parts = dotted.split(".")
    node = tree
    for part in parts[:-1]:
        nxt = node.setdefault(part, {})
        if not isinstance(nxt, dict):
            raise ConfigError(f"{dotted}: {part!r} is not a section")
        node = nxt
    node[parts[-1]] = value


def _merge(base: dict, top: dict) -> dict:
    out = dict(base)
    for key, value in top.items():
        if isinstance(value, dict) and isinstance(out.get(key), dict):
            out[key] = _merge(out[key], value)
        else:
            out[key] = value
    return out


def parse_override(text: str) -> tuple[str, Any]:
    """``KEY=VALUE`` with VALUE parsed as YAML (so 0.1, true, [a, b], {a: 1} and null work).

    Only the flow forms ``[...]`` and ``{...}`` make a list or mapping: a value
    such as ``Answer: \\boxed{5}`` stays the string it was typed as, rather than
    YAML's block mapping ``{"Answer": "\\boxed{5}"}``.
    """
    if "=" not in text:
        raise ConfigError(f"--set {text!r}: expected KEY=VALUE")
    key, raw = text.split("=", 1)
    key = key.strip()
    if not key:
        raise ConfigError(f"--set {text!r}: empty key")
    if not raw.strip():
        return key, ""
    flow = raw.lstrip()[:1] in ("[", "{")
    try:
        value = yaml.safe_load(raw)
    except yaml.YAMLError as exc:
        if flow:
            raise ConfigError(f"--set {key}: value {raw!r} is not valid YAML: {str(exc).splitlines()[0]}") from None
        return key, raw
    if isinstance(value, (dict, list)) and not flow:
        return key, raw
    return key, value


def read_yaml(p: Path) -> dict:
    if not p.is_file():
        raise ConfigError(f"config file not found: {p}")
    try:
        loaded = yaml.safe_load(p.read_text())
    except UnicodeDecodeError as err:
        raise ConfigError(f"{p}: not a text file ({err.reason} at byte {err.start})") from None
    except yaml.MarkedYAMLError as err:
        # problem_mark is where the parser gave up; problem says why (e.g. "found character '\t'").
        where = f" line {err.problem_mark.line + 1}" if err.problem_mark is not None else ""
        raise ConfigError(f"{p}{where}: invalid YAML: {err.problem or err.context}") from None
    except yaml.YAMLError as err:
        raise ConfigError(f"{p}: invalid YAML: {err}") from None
    if loaded is not None and not isinstance(loaded, dict):
        raise ConfigError(f"{p}: the top level must be a mapping of sections")
    return loaded or {}


def load_config(path: str | Path | None = None, overrides: list[str] | dict[str, Any] | None = None) -> TrainConfig:
    """Read YAML over the built-in default run's values (``path`` None: the default run itself),
    apply overrides and the method's preset, validate."""
    user = read_yaml(Path(path)) if path is not None else {}
    return config_from_tree(user, Path(path).resolve().parent if path is not None else None, overrides)


def build_config(keys: dict[str, Any], config_dir: Path | None, overrides: list[str] | dict[str, Any] | None = None) -> TrainConfig:
    """A config from dotted keys (a converted TRL file: config/trl.py) over the default run's
    values, as :func:`load_config` reads a YAML file; references resolve against ``config_dir``."""
    tree: dict = {}
    for key, value in keys.items():
        _set_dotted(tree, key, value)
    return config_from_tree(tree, config_dir, overrides)


def config_from_tree(user: dict, config_dir: Path | None, overrides) -> TrainConfig:
    """A config from a tree of sections (a YAML file's mapping, or a dict from Python), as
    :func:`load_config` reads one; ``user`` is changed in place."""
    items = overrides.items() if isinstance(overrides, dict) else [parse_override(o) for o in overrides or []]
    for key, value in items:
        _set_dotted(user, key, value)
    data = user.get("data")
    if isinstance(data, dict) and data.get("source", DEFAULT_SOURCE) != DEFAULT_SOURCE:
        # The default task's generator options and solved example mean nothing for another source.
        data.setdefault("task_kwargs", {})
        data.setdefault("few_shot", [])
    method = user.get("method", TrainConfig.method)
    if not isinstance(method, str) or method not in METHODS:
        raise ConfigError(f"method: unknown method {method!r}{suggest(method, METHODS)}; methods: {', '.join(sorted(METHODS))}")
    preset: dict = {}
    # The defaults each method brings; the user's YAML and --set overrides win over them.
    for key, value in get_method(method).preset.items():
        _set_dotted(preset, key, value)
    cfg = _build(TrainConfig, _merge(preset, user), "")
    validate(cfg)
    # References to code beside the config file are made absolute; python: ones name objects a Python
    # caller gives (config/python_objects.py).
    for entry in cfg.rewards:
        if ":" in entry.name and not is_python_reference(entry.name):
            entry.name = resolve_reference(entry.name, config_dir)
        if entry.name == "reward_model" and "model" in entry.kwargs:
            entry.kwargs["model"] = _resolve_model_path(entry.kwargs["model"], config_dir)
    env = cfg.environment
    cfg.environment = dataclasses.replace(
        env,
        tools=[tool if is_python_reference(tool) else resolve_reference(tool, config_dir, "tool") for tool in env.tools],
        classes={k: v if is_python_reference(v) else resolve_reference(v, config_dir, "environment class")
                 for k, v in env.classes.items()},
    )
    cfg.data.source = _resolve_data_file(cfg.data.source, config_dir)
    return cfg


def _resolve_data_file(source: str, config_dir: Path | None) -> str:
    """A relative data file from the current folder, else from the config's folder, made absolute
    (so the saved config works from anywhere); hub names and task sources stay as they are."""
    if Path(source).suffix not in (".jsonl", ".json", ".parquet") or Path(source).is_absolute():
        return source
    for base in (Path.cwd(), config_dir):
        if base is not None and (base / source).is_file():
            return str((base / source).resolve())
    return source  # the data loader names the missing file


def _positive_int(value) -> bool:
    return not isinstance(value, bool) and isinstance(value, int) and value >= 1


def _ray_address(address: str) -> bool:
    """``auto``, or a host and a port: ``HOST:PORT`` (an IPv6 host in brackets: ``[::1]:6379``)."""
    host, _, port = address.rpartition(":")
    return address == "auto" or (bool(host.strip("[]")) and port.isdigit() and 0 < int(port) < 65536)


def validate(cfg: TrainConfig) -> None:
    """Each key's own checks (a range, a known name, a package that must be installed); each failure
    names its key. The rules between sections are ``compile_run``'s (config/rules.py)."""
    g, t, lo = cfg.generation, cfg.training, cfg.loss
    require(g.num_generations >= 2, "generation.num_generations", f"must be >= 2 (a group needs two completions), got {g.num_generations}")
    require(g.max_new_tokens >= 1, "generation.max_new_tokens", f"must be >= 1, got {g.max_new_tokens}")
    require(g.temperature > 0, "generation.temperature", f"must be > 0, got {g.temperature}")
    require(0 < g.top_p <= 1, "generation.top_p", f"must be in (0, 1], got {g.top_p}")
    require(g.top_k >= 0, "generation.top_k", f"must be >= 0, got {g.top_k}")
    require(g.max_retry_rounds >= 0, "generation.max_retry_rounds", "must be >= 0")
    v = g.vllm
    require(0 < v.gpu_memory_utilization <= 1, "generation.vllm.gpu_memory_utilization", "must be in (0, 1]")
    for key, value in (("max_num_seqs", v.max_num_seqs), ("max_num_batched_tokens", v.max_num_batched_tokens)):
        require(value is None or value >= 1, f"generation.vllm.{key}", f"must be >= 1 or null, got {value}")
    require(v.request_timeout_s > 0, "generation.vllm.request_timeout_s", "must be > 0")
    require(v.server_wait_s >= 0, "generation.vllm.server_wait_s", "must be >= 0")
    # Meanwhile the other processes wait for the main one in a collective.
    require(g.backend != "vllm_server" or v.server_wait_s < t.dist_timeout_minutes * 60, "generation.vllm.server_wait_s",
            f"must be under training.dist_timeout_minutes ({t.dist_timeout_minutes:g} min): the other processes "
            "wait for the main one in a collective meanwhile")
    require(v.server_url.startswith(("http://", "https://")), "generation.vllm.server_url",
           f"must start with http:// or https://, got {v.server_url!r}")
    require(t.max_steps is None or t.max_steps >= 1, "training.max_steps", f"must be >= 1 or null, got {t.max_steps}")
    require(t.max_steps is not None or cfg.data.num_epochs is not None, "training.max_steps",
           "null counts the run in passes over the data: set data.num_epochs")
    require(t.dist_timeout_minutes > 0, "training.dist_timeout_minutes", f"must be > 0, got {t.dist_timeout_minutes}")
    require(t.batch_size is None or t.batch_size > 0, "training.batch_size", f"must be > 0 or null, got {t.batch_size}")
    require(t.prompts_per_step >= 1, "training.prompts_per_step", f"must be >= 1, got {t.prompts_per_step}")
    require(t.micro_batch_size == "auto" or t.micro_batch_size >= 1, "training.micro_batch_size", "must be >= 1 or auto")
    require(cfg.method in METHODS, "method", f"unknown method {cfg.method!r}; methods: {', '.join(sorted(METHODS))}")
    require(t.learning_rate >= 0, "training.learning_rate", "must be >= 0")
    require(t.num_iterations >= 1, "training.num_iterations", "must be >= 1")
    require(t.warmup_steps >= 0, "training.warmup_steps", "must be >= 0")
    require(0 <= t.warmup_ratio < 1, "training.warmup_ratio", f"must be in [0, 1), got {t.warmup_ratio}")
    require(not (t.warmup_ratio and t.warmup_steps), "training.warmup_ratio",
           "give warmup_steps or warmup_ratio, not both")
    require(lo.max_gen_batches >= 1, "loss.max_gen_batches", "must be >= 1")
    problem = advantage_settings_problem(lo.advantage_estimator, lo.scale_rewards)
    require(problem is None, "loss.scale_rewards", (problem or "").removeprefix("scale_rewards "))
    r = cfg.rollout
    require(r.max_staleness >= 0, "rollout.max_staleness", f"must be >= 0 (0: synchronous), got {r.max_staleness}")
    require(r.wait_timeout_s > 0, "rollout.wait_timeout_s", f"must be > 0, got {r.wait_timeout_s}")
    check_data_plane(r.data_plane)  # its package, before any model loads
    require(r.transferqueue_ray_address is None or _ray_address(r.transferqueue_ray_address),
            "rollout.transferqueue_ray_address",
            f"must be HOST:PORT (the head node's ray start --port), auto or null, got {r.transferqueue_ray_address!r}")
    _environment_keys(cfg)
    require(cfg.logging.collapse_window >= 0, "logging.collapse_window", "must be >= 0 (0: off)")
    require(cfg.checkpoint.save_steps >= 0, "checkpoint.save_steps", "must be >= 0")
    require(cfg.checkpoint.save_minutes >= 0, "checkpoint.save_minutes", "must be >= 0")
    require(t.max_consecutive_skips >= 1, "training.max_consecutive_skips", f"must be >= 1, got {t.max_consecutive_skips}")
    require(cfg.checkpoint.keep_last is None or cfg.checkpoint.keep_last >= 1, "checkpoint.keep_last", "must be >= 1")
    require(bool(cfg.rewards), "rewards", "at least one reward function is needed")
    for i, r in enumerate(cfg.rewards):
        require(bool(r.name), f"rewards[{i}].name", "must not be empty")
        require(r.timeout_s is None or r.timeout_s > 0, f"rewards[{i}].timeout_s", f"must be > 0, got {r.timeout_s}")
    e = cfg.eval
    require(e.k is None or _positive_int(e.k), "eval.k", f"must be a positive int or null, got {e.k!r}")
    require(e.draws is None or _positive_int(e.draws), "eval.draws", f"must be a positive int or null, got {e.draws!r}")
    require(_positive_int(e.min_defined_prompts), "eval.min_defined_prompts",
           f"must be a positive int, got {e.min_defined_prompts!r}")
    known = {*TRACKER_NAMES, "none", "all"}
    for i, name in enumerate(cfg.logging.report_to):
        require(name in known, f"logging.report_to[{i}]", f"unknown tracker {name!r}{suggest(name, known)}")


def _environment_keys(cfg: TrainConfig) -> None:
    """Multi-turn episodes: the limits' own bounds, and references that name what to import."""
    e = cfg.environment
    with config_keys("environment"):
        episode_limits(e, cfg.generation.max_new_tokens)
    require(e.tool_timeout_s is None or e.tool_timeout_s > 0, "environment.tool_timeout_s",
           f"must be > 0 or null, got {e.tool_timeout_s!r}")
    for i, tool in enumerate(e.tools):
        require(":" in tool, f"environment.tools[{i}]", f"must look like 'module:function' or 'file.py:function', got {tool!r}")
    for name, ref in e.classes.items():
        require(":" in ref, f"environment.classes.{name}", f"must look like 'module:Class' or 'file.py:Class', got {ref!r}")
