"""Named points where a crash-safety test can kill the process with certainty.

A test that sends SIGKILL at a moment chosen by the clock only sometimes lands
inside the window it means (a save, a step): on a fast machine the window has
passed, on a loaded one it has not yet opened. Instead the test names the point
and the step in the environment, and the process kills itself there::

    MAXENT_GRPO_KILL_AT=save.between_files@3 maxent-grpo train ...

dies by SIGKILL (exit -9, nothing flushed, no handler run: what ``kill -9`` or
the OOM killer does) when the save of step 3 has written its first files and
not the rest. Unset, which is always the case outside the tests, every point is
one dictionary lookup.

A leaf module (standard library only), like ``run_files``.
"""

from __future__ import annotations

import os
import signal

ENV = "MAXENT_GRPO_KILL_AT"

KILL_POINTS = (
    "save.after_first_file",  # the model weights are in the staging folder, nothing else
    "save.between_files",  # weights and optimizer state written; scheduler, RNG and trainer state not
    "save.before_rename",  # the staging folder is complete (manifest too) but not yet step-N
    "step.after_backward",  # every micro-batch's backward done, the optimizer not yet stepped
    "metrics.mid_line",  # half of the step's metrics.jsonl line is written
)


def kill_point(name: str, step: int) -> None:
    """SIGKILL this process if ``$MAXENT_GRPO_KILL_AT`` is ``name@step``."""
    if name not in KILL_POINTS:
        raise ValueError(f"unknown kill point {name!r}")  # a call site out of step with the list
    wanted = os.environ.get(ENV)
    if wanted is None:
        return
    point, sep, at = wanted.partition("@")
    if point not in KILL_POINTS or not sep or not at.isdigit():
        raise ValueError(f"{ENV}={wanted!r}: expected POINT@STEP with POINT one of {', '.join(KILL_POINTS)}")
    if point == name and int(at) == step:
        os.kill(os.getpid(), signal.SIGKILL)
