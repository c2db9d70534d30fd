"""Ctrl-C and SIGTERM during a run: finish the step, save, say how to resume.

The first SIGINT or SIGTERM only sets :attr:`StopSignals.requested`; the loop
checks it after each optimizer step, writes a checkpoint and stops. A second
one abandons the step in progress (``KeyboardInterrupt``), except inside
:meth:`StopSignals.protected` (the optimizer update and the weight push): there
the step is finished instead, so a checkpoint never holds half an update.
"""

from __future__ import annotations

import logging
import signal
import threading
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

from maxent_grpo.errors import UserError

log = logging.getLogger("maxent_grpo")


class RunInterrupted(UserError):
    """The run stopped on a signal; ``checkpoint`` is where it can be resumed from (None: nowhere)."""

    def __init__(self, message: str, checkpoint: Path | None, step: int):
        super().__init__(message)
        self.checkpoint, self.step = checkpoint, step


@dataclass
class StopSignals:
    requested: bool = False
    _protected: bool = False
    _previous: dict = field(default_factory=dict)

    @classmethod
    def install(cls) -> "StopSignals":
        """Take over SIGINT and SIGTERM (main thread only; elsewhere the defaults stay)."""
        stop = cls()
        if threading.current_thread() is threading.main_thread():
            for sig in (signal.SIGINT, signal.SIGTERM):
                stop._previous[sig] = signal.signal(sig, stop._handle)
        return stop

    def restore(self) -> None:
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)
        self._previous.clear()

    def _handle(self, signum, frame) -> None:
        name = signal.Signals(signum).name
        if not self.requested:
            self.requested = True
            log.warning("%s: stopping after this step and saving a checkpoint (send it again to abandon the step)", name)
            return
        if self._protected:
            return  # the update is under way: finishing it is quicker than undoing it
        raise KeyboardInterrupt(name)

    @contextmanager
    def protected(self):
        """A stretch a second signal must not cut: the step is finished and saved instead."""
        self._protected = True
        try:
            yield
        finally:
            self._protected = False
