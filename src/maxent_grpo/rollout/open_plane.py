"""The data plane the ``rollout`` section asks for (``rollout.data_plane``).

Apart from ``data_plane.py`` because the TransferQueue plane imports that module's record
type: the choice between the planes sits above both.
"""

from __future__ import annotations

import importlib.util

from maxent_grpo.errors import ConfigError
from maxent_grpo.rollout.data_plane import DataPlane, LocalDataPlane
from maxent_grpo.rollout.settings import RolloutConfig
from maxent_grpo.rollout.transferqueue_plane import MISSING_EXTRA, TransferQueuePlane


def check_data_plane(settings: RolloutConfig) -> None:
    """Raise ConfigError if the chosen plane's package is not installed (cheap: nothing is imported)."""
    if settings.data_plane == "transferqueue" and importlib.util.find_spec("transfer_queue") is None:
        raise ConfigError(MISSING_EXTRA)


def open_data_plane(settings: RolloutConfig) -> DataPlane:
    """A new plane; the caller closes it. TransferQueue is imported only when it is chosen (it takes seconds)."""
    if settings.data_plane == "local":
        return LocalDataPlane()
    return TransferQueuePlane(ray=settings.transferqueue_ray)
