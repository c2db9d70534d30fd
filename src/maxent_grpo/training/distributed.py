"""The few collectives the trainer needs, over torch.distributed (a no-op with one process)."""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch
import torch.distributed as dist


@dataclass(frozen=True)
class Dist:
    rank: int = 0
    world_size: int = 1

    @classmethod
    def init(cls) -> "Dist":
        """Join the process group that torchrun / accelerate launch describe in the environment."""
        if int(os.environ.get("WORLD_SIZE", "1")) > 1 and not dist.is_initialized():
            dist.init_process_group(backend="nccl" if torch.cuda.is_available() else "gloo")
        return cls.current()

    @classmethod
    def current(cls) -> "Dist":
        if dist.is_available() and dist.is_initialized():
            return cls(dist.get_rank(), dist.get_world_size())
        return cls()

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    def all_reduce_sum(self, t: torch.Tensor) -> torch.Tensor:
        if self.world_size == 1:
            return t
        out = t.clone()
        dist.all_reduce(out, op=dist.ReduceOp.SUM)
        return out

    def mean(self, value: float) -> float:
        """Mean of a scalar over ranks."""
        if self.world_size == 1:
            return float(value)
        return float(self.all_reduce_sum(torch.tensor([float(value)], dtype=torch.float64))[0]) / self.world_size

    def any_rank(self, flag: bool) -> bool:
        if self.world_size == 1:
            return bool(flag)
        return bool(self.all_reduce_sum(torch.tensor([1.0 if flag else 0.0]))[0] > 0)

    def gather_floats(self, values: list[float]) -> list[float]:
        """Concatenate equal-or-unequal length lists of floats from every rank."""
        if self.world_size == 1:
            return list(values)
        out: list = [None] * self.world_size
        dist.all_gather_object(out, list(values))
        return [v for part in out for v in part]


class DataParallelPolicy(torch.nn.parallel.DistributedDataParallel):
    """DDP that still exposes the wrapped model's ``config`` (the log-prob code reads the vocab size)."""

    @property
    def config(self):
        return self.module.config
