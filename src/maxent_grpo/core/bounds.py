"""The one way a setting's bound is checked: ``require(ok, setting, problem)`` raises :class:`SpecError`.

Each bound is written once, in the record or pure function that holds the value
(``ClipSettings``, ``LossSpec``, a loss's params, ``check_rollout_correction``...);
``config.compile.compile_run`` re-raises a ``SpecError`` as one ``ConfigError``
naming the dotted config key.
"""

from __future__ import annotations


class SpecError(ValueError):
    """A setting out of its bounds. ``setting`` names it (``epsilon_low``, ``tau_pos``...), so
    ``config.compile.compile_run`` can name the config key; the message says the bound once."""

    def __init__(self, setting: str, problem: str):
        super().__init__(f"{setting} {problem}")
        self.setting, self.problem = setting, problem


def require(ok: bool, setting: str, problem: str) -> None:
    if not ok:
        raise SpecError(setting, problem)
