"""The ``environment:`` section of the run configuration, and the episode limits it compiles to."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from maxent_grpo.envs.episodes import EpisodeLimits
from maxent_grpo.envs.protocol import ENVIRONMENT_COLUMN, ENVIRONMENTS, EnvironmentFactory, RowEnvironments
from maxent_grpo.envs.tool_env import ToolEnvironment
from maxent_grpo.envs.trl_compat import TRLEnvironment, is_trl_environment
from maxent_grpo.errors import ConfigError, DataError
from maxent_grpo.rewards.user_code import RewardImportError, import_reference


@dataclass
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


def row_environments(env: EnvironmentConfig, column: Sequence[Any] | None) -> RowEnvironments:
    """Which environment each row plays: its ``environment`` column, else ``env``'s default.

    Imports the configured tools and classes and checks every row's name, so a bad one stops
    the run before the model loads (one line naming the row and the column).
    """
    table = dict(ENVIRONMENTS)
    if env.tools:
        tools = []
        for i, ref in enumerate(env.tools):
            try:
                tools.append(import_reference(ref, "tool"))
            except RewardImportError as err:
                raise ConfigError(f"environment.tools[{i}]: {err}") from None
        table["tools"] = lambda: ToolEnvironment(tools, call_timeout_s=env.tool_timeout_s)
    for name, ref in env.classes.items():
        try:
            cls = import_reference(ref, "environment class")
        except RewardImportError as err:
            raise ConfigError(f"environment.classes.{name}: {err}") from None
        if not isinstance(cls, type):
            raise ConfigError(f"environment.classes.{name}: {ref} is a {type(cls).__name__}, not a class")
        table[name] = _trl_factory(cls, env.tool_timeout_s) if is_trl_environment(cls) else cls
    default = env.default_name
    if default not in table:
        raise ConfigError(f"environment.name: no environment {default!r}; registered: {', '.join(sorted(table))}")
    for row, name in enumerate(column or ()):
        if name is not None and name not in table:
            raise DataError(f"row {row}: column {ENVIRONMENT_COLUMN!r} names {name!r}, which is no environment; "
                            f"registered: {', '.join(sorted(table))}")
    return RowEnvironments(table, default)


def _trl_factory(cls: type, timeout_s: float | None) -> EnvironmentFactory:
    return lambda: TRLEnvironment(cls(), call_timeout_s=timeout_s)
