"""The staleness bound of asynchronous rollouts (ALGORITHMS.md §15, item 1).

A sample's policy version ``v_i`` is the number of optimizer steps the weights
that sampled it had taken; a sample whose tokens came from several versions (a
weight update landed mid-generation) has the OLDEST of them, prime-rl's
definition, which stays correct under in-flight updates. Trained at optimizer
step ``step`` (the weights' version before the update), its staleness is
``step - v_i``; it is admissible iff that is at most ``k`` (``rollout.max_staleness``).

Our weight pushes wait for the batch being sampled (training/rollout_queue.py), so
every token of a batch comes from one version and a batch's samples share it.
"""

from __future__ import annotations

import torch


def staleness(step: int, versions: torch.Tensor) -> torch.Tensor:
    """``[N]`` optimizer steps between each sample's weights and the step that trains on it."""
    lag = step - versions.long()
    if bool((lag < 0).any()):
        raise ValueError(f"a sample's version is newer than step {step}: {int(versions.max())}")
    return lag


def admissible(step: int, versions: torch.Tensor, max_staleness: int) -> torch.Tensor:
    """``[N]`` bool: ``step - v_i <= max_staleness`` (the boundary is kept, one more is dropped)."""
    if isinstance(max_staleness, bool) or not isinstance(max_staleness, int) or max_staleness < 0:
        raise ValueError(f"max_staleness must be an integer >= 0, got {max_staleness!r}")
    return staleness(step, versions) <= max_staleness
