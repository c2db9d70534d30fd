"""TRL's ``environment_factory`` classes, used unchanged.

TRL's convention (``GRPOTrainer(environment_factory=...)``): an instance per
rollout; ``reset(**row)`` returns ``None`` or a string appended to the prompt's
last user message; every public method is a tool the model may call; an
optional ``get_reward()`` scores the finished rollout (here: the ``environment``
reward function reads it). The episode ends on a turn with no tool call, as
in TRL.
"""

from __future__ import annotations

import inspect
from collections.abc import Mapping, Sequence
from typing import Any

from maxent_grpo.envs.protocol import ENVIRONMENT_COLUMN, Message, StepResult
from maxent_grpo.envs.tool_env import ToolEnvironment, prompt_messages


def is_trl_environment(cls: type) -> bool:
    """A class with ``reset`` and no ``step``: TRL's convention, not this package's protocol."""
    members = dict(inspect.getmembers(cls, predicate=inspect.isfunction))
    return "reset" in members and "step" not in members


class TRLEnvironment:
    """One of our :class:`~maxent_grpo.envs.protocol.Environment` around a TRL environment instance."""

    def __init__(self, instance: Any, *, call_timeout_s: float | None):
        members = dict(inspect.getmembers(type(instance), predicate=inspect.isfunction))
        self.instance = instance
        self.tools = [getattr(instance, name) for name in sorted(members)
                      if name not in ("reset", "get_reward") and not name.startswith("_")]
        self.has_reward = "get_reward" in members
        self._calls = ToolEnvironment(self.tools, call_timeout_s=call_timeout_s)

    def reset(self, row: Mapping[str, Any]) -> list[Message]:
        # TRL passes the row's columns (without the environment's name) as keyword arguments.
        observation = self.instance.reset(**{k: v for k, v in row.items() if k != ENVIRONMENT_COLUMN})
        messages = prompt_messages(row)
        if observation is not None and not isinstance(observation, str):
            raise TypeError(f"{type(self.instance).__name__}.reset must return None or a str, got "
                            f"{type(observation).__name__}")
        if not messages:
            # A row without a prompt: the environment owns the data, its text is the prompt.
            if not observation:
                raise ValueError(f"the row has no prompt and {type(self.instance).__name__}.reset gave none")
            return [{"role": "user", "content": observation}]
        if observation is None:
            return messages
        last = messages[-1]
        return [*messages[:-1], {**last, "content": last["content"] + observation}]

    def step(self, messages: Sequence[Message], assistant: Message) -> StepResult:
        return self._calls.step(messages, assistant)

    def get_reward(self) -> float | None:
        return float(self.instance.get_reward()) if self.has_reward else None


def user_environment(env: Any) -> Any:
    """What a reward function's ``environments`` keyword holds for ``env``: the user's own instance of a
    TRL class, else the environment itself."""
    return env.instance if isinstance(env, TRLEnvironment) else env
