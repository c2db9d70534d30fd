"""The few collectives the trainer needs, over torch.distributed (a no-op with one process)."""

from __future__ import annotations

import os
from collections.abc import Iterator
from contextlib import contextmanager
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
            if torch.cuda.is_available():
                torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
            dist.init_process_group(backend="nccl" if torch.cuda.is_available() else "gloo")
        return cls.current()

    @classmethod
    def current(cls) -> "Dist":
        if dist.is_available() and dist.is_initialized():
            return cls(dist.get_rank(), dist.get_world_size())
        return cls()

    @property
    def device(self) -> torch.device:
        """This process's accelerator (cuda:LOCAL_RANK) when there is one, else the CPU."""
        if torch.cuda.is_available():
            return torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))
        return torch.device("cpu")

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    def barrier(self) -> None:
        if self.world_size > 1:
            dist.barrier()

    def all_reduce_sum(self, t: torch.Tensor) -> torch.Tensor:
        if self.world_size == 1:
            return t
        out = t.to(self.device, copy=True)
        dist.all_reduce(out, op=dist.ReduceOp.SUM)
        return out.to(t.device)

    def mean(self, value: float) -> float:
        """Mean of a scalar over ranks."""
        if self.world_size == 1:
            return float(value)
        return float(self.all_reduce_sum(torch.tensor([float(value)], dtype=torch.float64))[0]) / self.world_size

    def any_rank(self, flag: bool) -> bool:
        if self.world_size == 1:
            return bool(flag)
        return bool(self.all_reduce_sum(torch.tensor([1.0 if flag else 0.0]))[0] > 0)

    def any_and_min(self, flag: bool, count: int) -> tuple[bool, int]:
        """(flag on any rank, smallest count over ranks) in one collective."""
        if self.world_size == 1:
            return bool(flag), int(count)
        t = torch.tensor([1.0 if flag else 0.0, -float(count)], dtype=torch.float64, device=self.device)
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
        return bool(t[0] > 0), int(-t[1])

    def broadcast_object(self, value):
        """The main process's ``value`` on every rank (any picklable object)."""
        if self.world_size == 1:
            return value
        box = [value]
        dist.broadcast_object_list(box, src=0)
        return box[0]

    def gather_objects(self, values: list) -> list:
        """Every rank's list of picklable objects, concatenated in rank order."""
        if self.world_size == 1:
            return list(values)
        out: list = [None] * self.world_size
        dist.all_gather_object(out, list(values))
        return [v for part in out for v in part]

    def gather_floats(self, values: list[float]) -> list[float]:
        """Concatenate equal-or-unequal length lists of floats from every rank."""
        if self.world_size == 1:
            return list(values)
        out: list = [None] * self.world_size
        dist.all_gather_object(out, list(values))
        return [v for part in out for v in part]


@contextmanager
def process_group() -> Iterator[Dist]:
    """Join the launcher's process group for the block and leave it at the block's end, on
    success and on error alike.

    A gloo group left for the interpreter's exit to destroy can abort the process
    (``terminate called without an active exception``, SIGABRT): its worker threads still
    hold work objects whose tensors are freed while Python is being torn down (pytorch
    #179291, #190489). Destroying it while the interpreter is whole avoids that. A group
    that was already joined when the block started (by the caller) is the caller's to leave.
    """
    joined_here = int(os.environ.get("WORLD_SIZE", "1")) > 1 and not (dist.is_available() and dist.is_initialized())
    try:
        yield Dist.init()
    finally:
        if joined_here and dist.is_initialized():
            dist.destroy_process_group()


class DataParallelPolicy(torch.nn.parallel.DistributedDataParallel):
    """DDP that still exposes the wrapped model's ``config`` (the log-prob code reads the vocab size)."""

    @property
    def config(self):
        return self.module.config
