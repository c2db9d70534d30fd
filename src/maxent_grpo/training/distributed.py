"""The few collectives the trainer needs, over torch.distributed (a no-op with one process)."""

from __future__ import annotations

import gc
import logging
import os
import shutil
import subprocess
import traceback
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager, contextmanager, nullcontext
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist

log = logging.getLogger("maxent_grpo")


@dataclass(frozen=True)
class Dist:
    rank: int = 0
    world_size: int = 1

    @classmethod
    def init(cls, timeout_minutes: float) -> "Dist":
        """Join the process group that torchrun / accelerate launch describe in the environment;
        a collective that waits longer than ``timeout_minutes`` for the others fails."""
        if int(os.environ.get("WORLD_SIZE", "1")) > 1 and not dist.is_initialized():
            timeout = timedelta(minutes=timeout_minutes)
            if torch.cuda.is_available():
                device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))
                torch.cuda.set_device(device)
                # device_id: NCCL connects now, so a broken rank fails here and not at the first collective.
                dist.init_process_group(backend="nccl", timeout=timeout, device_id=device)
            else:
                dist.init_process_group(backend="gloo", timeout=timeout)
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

    def max_over_ranks(self, values: list[int]) -> list[int]:
        """Each integer's largest value over ranks, in one collective."""
        if self.world_size == 1:
            return [int(v) for v in values]
        t = torch.tensor([float(v) for v in values], dtype=torch.float64, device=self.device)
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
        return [int(v) for v in t.tolist()]

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


def log_device(d: Dist) -> None:
    """Say where the run trains; warn when a GPU is there (``nvidia-smi`` lists one) but this torch
    cannot use it (a CPU-only build, a driver too old for its CUDA), since the run would go on
    on the CPU, many times slower, without a word."""
    log.info("training on %s (%d process%s, torch %s)", d.device, d.world_size, "es" if d.world_size > 1 else "",
             torch.__version__)
    if d.device.type == "cuda" or shutil.which("nvidia-smi") is None:
        return
    try:
        listed = subprocess.run(["nvidia-smi", "-L"], capture_output=True, text=True, timeout=30).stdout
    except (OSError, subprocess.TimeoutExpired):
        return  # no answer from the driver: nothing to say about the GPU
    gpus = [line for line in listed.splitlines() if line.startswith("GPU ")]
    if gpus:
        log.warning("nvidia-smi lists %d GPU(s) but torch %s cannot use them (torch.version.cuda=%s): training on "
                    "the CPU. Install a CUDA build of torch that matches the driver.",
                    len(gpus), torch.__version__, torch.version.cuda)


@contextmanager
def process_group(timeout_minutes: float) -> Iterator[Dist]:
    """Join the launcher's process group for the block and leave it at the block's end, on
    success and on error alike. Objects of the run made inside the block must be gone by its end
    (return from a function called inside it): see below.

    Two ways a gloo group's end can kill or hang a rank, both races that load makes likely:

    * Left for the interpreter's exit, its worker threads may still hold a finished
      collective's tensors, whose Python objects they free while Python is torn down:
      ``terminate called without an active exception``, SIGABRT (pytorch #179291, #190489).
    * Destroyed by a C++ owner that outlives ``destroy_process_group`` (DDP's reducer), its
      destructor runs with the GIL held and joins those threads, one of which waits for the
      GIL to free such a tensor: a deadlock. Freed first, the reducer only drops a reference,
      and the group dies in ``destroy_process_group``, whose binding releases the GIL.

    So the group is destroyed here, after the run's objects: those of a failed run, which its
    traceback's frames would keep alive, are let go first.
    """
    joined_here = int(os.environ.get("WORLD_SIZE", "1")) > 1 and not (dist.is_available() and dist.is_initialized())
    try:
        yield Dist.init(timeout_minutes)
    except BaseException as err:
        if joined_here:
            traceback.clear_frames(err.__traceback__)  # the finished frames' locals; the lines stay for printing
        raise
    finally:
        if joined_here and dist.is_initialized():
            gc.collect()  # the run's objects that sit in reference cycles
            dist.destroy_process_group()


class DataParallelPolicy(torch.nn.parallel.DistributedDataParallel):
    """DDP that still exposes the wrapped model's ``config`` (the log-prob code reads the vocab size)."""

    @property
    def config(self):
        return self.module.config


def ddp_gradient_sync(model: torch.nn.parallel.DistributedDataParallel) -> Callable[[bool], AbstractContextManager]:
    """``grpo_step``'s ``gradient_sync`` for DDP: ``no_sync`` on every micro-batch but the last, so
    the accumulated gradients are all-reduced once per optimizer step."""
    return lambda is_last: nullcontext() if is_last else model.no_sync()
