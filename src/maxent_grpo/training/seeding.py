"""Where each step's randomness comes from: (run seed, rank, step), so a resumed run or any
number of processes samples exactly what an uninterrupted run would."""

from __future__ import annotations

import random

import numpy as np
import torch


def seed_everything(seed: int) -> None:
    random.seed(seed)
    torch.manual_seed(seed)


def step_seed(seed: int, rank: int, step: int) -> int:
    """A 63-bit seed of its own for (seed, rank, step)."""
    return int(np.random.SeedSequence([seed, rank, step]).generate_state(1, np.uint64)[0] >> 1)


def seed_step(seed: int, rank: int, step: int) -> None:
    """Seed python and torch for one optimizer step's batch from (seed, rank, step)."""
    seed_everything(step_seed(seed, rank, step))
