"""The environment protocol: a multi-turn episode, opened from a dataset row and moved on turn by turn.

An :class:`Environment` opens an episode with ``reset(row) -> messages`` (the
chat the model answers first) and answers each assistant turn with ``step``:
the observation messages to append (tool results, a user's reply) or ``None``
when the episode is over. The rollout (``envs/episodes.py``) keeps the episode
as tokens: the model's sampled ids and the environment's messages rendered
through the chat template once, as a suffix. Nothing is re-tokenised from text.

Environments register by name where they are defined (``register_environment``),
like rewards and methods. A factory is called once per episode: an instance
may keep the episode's state (TRL's ``environment_factory`` convention).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

Message = dict[str, Any]
ENVIRONMENT_COLUMN = "environment"  # TRL's dataset column: the name of each row's environment


@dataclass(frozen=True)
class StepResult:
    """What an environment answers to one assistant turn.

    ``observation``: messages appended after the assistant's (``None`` ends the episode);
    ``info``: counters summed per episode into the step's metrics (``tool_calls``,
    ``tool_parse_failures``, ...).
    """

    observation: list[Message] | None
    info: dict[str, float] = field(default_factory=dict)

    @property
    def done(self) -> bool:
        return self.observation is None

    def __post_init__(self) -> None:
        if self.observation is not None:
            if not self.observation or not all(isinstance(m, Mapping) and isinstance(m.get("role"), str)
                                               and isinstance(m.get("content"), str) for m in self.observation):
                raise ValueError("observation must be None or a non-empty list of {'role', 'content'} messages")


class Environment(Protocol):
    # Plain Python functions described to the model through the chat template's ``tools=``
    # (empty: no tools). Their docstrings follow transformers' ``get_json_schema`` format.
    tools: Sequence[Callable[..., Any]]

    def reset(self, row: Mapping[str, Any]) -> list[Message]:
        """The episode's opening messages (system and user turns) for this dataset row."""
        ...

    def step(self, messages: Sequence[Message], assistant: Message) -> StepResult:
        """Answer the assistant's newest turn; ``messages`` is the conversation before it."""
        ...

    def get_reward(self) -> float | None:
        """The environment's score of the episode, asked once when it ends however it ended (TRL's
        ``get_reward``; the ``environment`` reward function reads it); None: the environment does not score."""
        ...


EnvironmentFactory = Callable[[], Environment]
ENVIRONMENTS: dict[str, EnvironmentFactory] = {}


def register_environment(name: str) -> Callable[[EnvironmentFactory], EnvironmentFactory]:
    """Register a factory (a class, or any callable returning an :class:`Environment`) under ``name``."""

    def deco(factory: EnvironmentFactory) -> EnvironmentFactory:
        if name in ENVIRONMENTS:
            raise ValueError(f"environment {name!r} is registered twice")
        ENVIRONMENTS[name] = factory
        return factory

    return deco


@dataclass(frozen=True)
class RowEnvironments:
    """Which environment each dataset row plays: its ``environment`` column, else ``default``."""

    table: Mapping[str, EnvironmentFactory]
    default: str

    def name(self, row: Mapping[str, Any]) -> str:
        named = row[ENVIRONMENT_COLUMN] if ENVIRONMENT_COLUMN in row else None
        return named if named is not None else self.default

    def factory(self, row: Mapping[str, Any]) -> EnvironmentFactory:
        return self.table[self.name(row)]
