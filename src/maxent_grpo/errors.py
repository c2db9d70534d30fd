"""The project's user-error base class.

A :class:`UserError` means bad input (a config key, a file, a dataset row, an
unreachable server, an output folder in use): the command line prints its
message on one line and exits non-zero. Every other exception is a bug and
keeps its traceback. Each layer defines its own subclasses (``CheckpointError``,
``RewardConfigError``, ...) next to the code that raises them; ``ConfigError`` and
``DataError`` are here because several layers raise them.
"""

from __future__ import annotations


class UserError(Exception):
    """Bad input; the message names the key, file, line or row and says what to do."""


class ConfigError(UserError, ValueError):
    """A configuration problem; the message names the offending dotted key."""


class DataError(UserError, ValueError):
    """A dataset cannot be used; the one-line message names the file, column or row."""
