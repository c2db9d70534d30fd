"""The built-in reward functions by name: each factory registers itself where it is defined.

``@register_reward("name")`` on a factory (keyword options in, a TRL-style reward function out) puts it in
:data:`REWARD_FUNCTIONS`, the table a config's ``rewards: [{name: ...}]`` is read against
(``rewards/registry.py``, which imports every module that registers one).
"""

from __future__ import annotations

from collections.abc import Callable

# f(prompts=..., completions=..., **columns) -> one float (or None: not scored) per completion: TRL's signature.
RewardFunction = Callable[..., list[float | None]]
RewardFactory = Callable[..., RewardFunction]

REWARD_FUNCTIONS: dict[str, RewardFactory] = {}


def register_reward(name: str) -> Callable[[RewardFactory], RewardFactory]:
    """Register a reward factory under ``name`` (what the config's ``rewards[].name`` says)."""

    def deco(factory: RewardFactory) -> RewardFactory:
        if name in REWARD_FUNCTIONS:
            raise ValueError(f"reward {name!r} is registered twice")
        REWARD_FUNCTIONS[name] = factory
        return factory

    return deco
