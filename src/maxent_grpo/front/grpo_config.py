"""``GRPOConfig``: TRL 1.16's ``GRPOConfig`` fields, names and defaults, read by ``--from-trl``'s table.

One field per entry of :data:`~maxent_grpo.config.trl_fields.GRPO_FIELDS` and
:data:`~maxent_grpo.config.trl_fields.TRAINING_ARGUMENTS_FIELDS` (``output_dir`` first, so
``GRPOConfig("out")`` works as in TRL), each defaulting to TRL's own default (``tests`` compare them
with the installed TRL's). Its values become this project's config exactly as a ``trl grpo`` YAML
file does: each field is mapped, refused in one line, or ignored with a printed reason (docs/TRL.md's
table); a field TRL has and that table lacks is refused when the object is made. A field counts as
given when its value differs from TRL's default, so ``args.learning_rate = 1e-5`` after construction
counts too.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from maxent_grpo.config.trl_fields import GRPO_FIELDS, TRAINING_ARGUMENTS_FIELDS
from maxent_grpo.errors import ConfigError

__all__ = ["GRPOConfig"]

FIELDS = {"output_dir": TRAINING_ARGUMENTS_FIELDS["output_dir"], **GRPO_FIELDS, **TRAINING_ARGUMENTS_FIELDS}


def _spec(name: str, default: Any) -> tuple:
    kind = type(default) if isinstance(default, (bool, int, float, str)) else Any
    if isinstance(default, (list, dict, set)):
        return name, kind, dataclasses.field(default_factory=lambda: type(default)(default))
    return name, kind, dataclasses.field(default=default)


_Fields = dataclasses.make_dataclass("_Fields", [_spec(name, entry.default) for name, entry in FIELDS.items()])


class GRPOConfig(_Fields):
    """TRL's ``GRPOConfig`` for :class:`~maxent_grpo.GRPOTrainer`: ``GRPOConfig(output_dir, **fields)``."""

    def __init__(self, *args: Any, **kwargs: Any):
        unknown = [name for name in kwargs if name not in FIELDS]
        if unknown:
            raise ConfigError(f"GRPOConfig.{unknown[0]}: not a field of TRL's GRPOConfig that has a counterpart here "
                              "(docs/TRL.md lists each field: mapped, refused or ignored)")
        if len(args) > 1:
            raise ConfigError("GRPOConfig: give output_dir positionally and every other field by name")
        super().__init__(*args, **kwargs)

    def given(self) -> dict[str, Any]:
        """The fields whose value is not TRL's default: what a ``trl grpo`` YAML file would name."""
        return {name: getattr(self, name) for name, entry in FIELDS.items() if getattr(self, name) != entry.default}
