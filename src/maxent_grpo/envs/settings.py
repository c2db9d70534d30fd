"""The ``environment:`` section of the run configuration, and the episode limits it compiles to."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from maxent_grpo.envs.episodes import EpisodeLimits
from maxent_grpo.envs.protocol import ENVIRONMENT_COLUMN, ENVIRONMENTS, EnvironmentFactory, RowEnvironments
from maxent_grpo.envs.tool_env import ToolEnvironment
from maxent_grpo.envs.trl_compat import TRLEnvironment, is_trl_environment
from maxent_grpo.errors import ConfigError, DataError
from maxent_grpo.rewards.user_code import RewardImportError, import_reference


@dataclass(frozen=True)
class EnvironmentConfig:
    # A registered environment (maxent_grpo.envs) each row plays over several turns; null with no
    # tools: one-shot prompts. A dataset column `environment` names one per row, over this default.
    name: str | None = field(default=None, metadata={"help": (
        "registered environment each row plays over several turns (maxent_grpo.envs, e.g. calculator); "
        "null with no tools = one-shot prompts; a dataset column 'environment' picks one per row")})
    # module:function or file.py:function tools; with no name they make the "tools" environment.
    tools: list[str] = field(default_factory=list, metadata={"help": (
        "module:function or file.py:function tools the model may call (Hermes <tool_call> JSON); with no name"
        " they make the 'tools' environment")})
    # This run's own environments, name -> module:Class or file.py:Class: a class of this package's
    # protocol (reset, step, tools) or a TRL environment_factory class (reset, public methods as tools,
    # optional get_reward), used unchanged.
    classes: dict[str, str] = field(default_factory=dict, metadata={"help": (
        "this run's environments, name -> module:Class or file.py:Class (this package's protocol, or a TRL "
        "environment_factory class used unchanged)")})
    max_turns: int = field(default=4, metadata={"help": "most model turns in an episode"})
    # Sampled tokens over all turns (null: max_turns x generation.max_new_tokens, the per-turn cap).
    max_model_tokens: int | None = field(default=None, metadata={"help": (
        "most sampled tokens over an episode's turns (null = max_turns x generation.max_new_tokens)")})
    # Model plus environment tokens after the prompt.
    max_episode_tokens: int = field(default=1024, metadata={"help": (
        "most model plus environment tokens after the prompt")})
    # Seconds a reset or step may take before the episode fails (null: no limit).
    step_timeout_s: float | None = field(default=30.0, metadata={"help": (
        "seconds an environment's reset or step may take before the episode fails (null = no limit)")})
    # Seconds one tool call may take before the model is told it timed out.
    tool_timeout_s: float | None = field(default=10.0, metadata={"help": (
        "seconds a tool call may take before the model is told it timed out (null = no limit)")})

    @property
    def enabled(self) -> bool:
        return self.name is not None or bool(self.tools) or bool(self.classes)

    @property
    def default_name(self) -> str:
        if self.name is not None:
            return self.name
        return next(iter(self.classes)) if self.classes and not self.tools else "tools"


def episode_limits(env: EnvironmentConfig, max_new_tokens: int) -> EpisodeLimits | None:
    """The limits a run's episodes play under; None for one-shot prompts."""
    if not env.enabled:
        return None
    model = env.max_model_tokens if env.max_model_tokens is not None else env.max_turns * max_new_tokens
    return EpisodeLimits(max_turns=env.max_turns, max_model_tokens=model, max_episode_tokens=env.max_episode_tokens,
                         step_timeout_s=env.step_timeout_s)


def row_environments(env: EnvironmentConfig, column: Sequence[Any] | None, *, tools: Sequence[Any] | None = None,
                     classes: Mapping[str, Any] | None = None) -> RowEnvironments:
    """Which environment each row plays: its ``environment`` column, else ``env``'s default.

    ``tools`` and ``classes`` are ``env.tools`` and ``env.classes`` as the plan holds them (None: ``env``'s
    own): each a reference, imported here, or the object a Python caller gave. Checks every row's name,
    so a bad one stops the run before the model loads (one line naming the row and the column).
    """
    tools = env.tools if tools is None else tools
    classes = env.classes if classes is None else classes
    table = dict(ENVIRONMENTS)
    if tools:
        functions = []
        for i, ref in enumerate(tools):
            if not isinstance(ref, str):
                functions.append(ref)
                continue
            try:
                functions.append(import_reference(ref, "tool"))
            except RewardImportError as err:
                raise ConfigError(f"environment.tools[{i}]: {err}") from None
        table["tools"] = lambda: ToolEnvironment(functions, call_timeout_s=env.tool_timeout_s)
    for name, ref in classes.items():
        table[name] = _environment_factory(name, ref, env.tool_timeout_s)
    default = env.default_name
    if default not in table:
        raise ConfigError(f"environment.name: no environment {default!r}; registered: {', '.join(sorted(table))}")
    for row, name in enumerate(column or ()):
        if name is not None and name not in table:
            raise DataError(f"row {row}: column {ENVIRONMENT_COLUMN!r} names {name!r}, which is no environment; "
                            f"registered: {', '.join(sorted(table))}")
    return RowEnvironments(table, default)


def _environment_factory(name: str, ref: Any, timeout_s: float | None) -> EnvironmentFactory:
    """The factory of ``environment.classes.NAME``: a class of this package's protocol, or a TRL
    ``environment_factory`` (a class, or any callable returning an instance, used unchanged)."""
    if isinstance(ref, str):
        try:
            ref = import_reference(ref, "environment class")
        except RewardImportError as err:
            raise ConfigError(f"environment.classes.{name}: {err}") from None
        if not isinstance(ref, type):
            raise ConfigError(f"environment.classes.{name}: {type(ref).__name__} is not a class")
    elif not callable(ref):
        raise ConfigError(f"environment.classes.{name}: a {type(ref).__name__} object is not a class or factory")
    if isinstance(ref, type):
        return _trl_factory(ref, timeout_s) if is_trl_environment(ref) else ref
    # A factory function, as TRL takes one: its instances tell which protocol they follow.
    probe = type(ref())
    if not hasattr(probe, "reset"):
        raise ConfigError(f"environment.classes.{name}: the factory's {probe.__name__} instances have no reset()")
    return _trl_factory(ref, timeout_s) if is_trl_environment(probe) else ref


def _trl_factory(cls: type, timeout_s: float | None) -> EnvironmentFactory:
    return lambda: TRLEnvironment(cls(), call_timeout_s=timeout_s)
