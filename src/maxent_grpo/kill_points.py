"""Named points where a crash-safety test can kill the process with certainty.

A test that sends SIGKILL at a moment chosen by the clock only sometimes lands
inside the window it means (a save, a step): on a fast machine the window has
passed, on a loaded one it has not yet opened. Instead the test names the point
and the step in the environment, and the process kills itself there::

    MAXENT_GRPO_KILL_AT=save.between_files@3 maxent-grpo train ...

dies by SIGKILL (exit -9, nothing flushed, no handler run: what ``kill -9`` or
the OOM killer does) when the save of step 3 has written its first files and
not the rest. ``POINT@STEP:rankR`` kills only the process of rank R (``$RANK``,
torchrun's): one worker of several. A worker that torchrun restarted
(``--max-restarts``, ``$TORCHELASTIC_RESTART_COUNT`` above 0) is never killed: it
replays the step that killed its first incarnation and must get through it. Unset,
which is always the case outside the tests, every point is one dictionary lookup.

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
    """SIGKILL this process if ``$MAXENT_GRPO_KILL_AT`` is ``name@step`` (or ``name@step:rankR`` and this
    process is rank R), unless torchrun restarted it."""
    if name not in KILL_POINTS:
        raise ValueError(f"unknown kill point {name!r}")  # a call site out of step with the list
    wanted = os.environ.get(ENV)
    if wanted is None:
        return
    point, sep, rest = wanted.partition("@")
    at, colon, rank = rest.partition(":")
    if (point not in KILL_POINTS or not sep or not at.isdigit()
            or (colon and not (rank.startswith("rank") and rank[4:].isdigit()))):
        raise ValueError(f"{ENV}={wanted!r}: expected POINT@STEP or POINT@STEP:rankR with POINT one of "
                         f"{', '.join(KILL_POINTS)}")
    if point != name or int(at) != step or os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") != "0":
        return
    if not colon or rank[4:] == os.environ.get("RANK", "0"):
        os.kill(os.getpid(), signal.SIGKILL)
