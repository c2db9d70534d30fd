"""The data plane ``rollout.data_plane`` names.

Not in ``data_plane.py``: the TransferQueue plane imports that module's record, so the choice
between the planes sits above both (tests/test_layers.py counts an import inside a function too).
"""

from __future__ import annotations

import importlib.util

from maxent_grpo.errors import ConfigError
from maxent_grpo.rollout.data_plane import DataPlane, LocalDataPlane
from maxent_grpo.rollout.transferqueue_plane import MISSING_EXTRA, TransferQueuePlane
from maxent_grpo.rollout.transferqueue_ray import ONE_PROCESS, Ranks


def check_data_plane(name: str) -> None:
    """ConfigError when the plane's package is not installed (for the config check: imports nothing)."""
    if name == "transferqueue" and importlib.util.find_spec("transfer_queue") is None:
        raise ConfigError(MISSING_EXTRA)


def open_data_plane(name: str, *, ray: bool, ray_address: str | None = None, ranks: Ranks = ONE_PROCESS) -> DataPlane:
    """A new plane, which the caller closes; ``ray``: TransferQueue's controller and storage as Ray
    actors, else in this process; ``ray_address``: on that Ray cluster, one plane shared by ``ranks``
    (every rank calls this together), else on a private Ray instance. TransferQueue is imported only
    here (it takes seconds)."""
    if name == "local":
        return LocalDataPlane()
    return TransferQueuePlane(ray=ray, ray_address=ray_address, ranks=ranks)
