"""The few collectives the trainer needs, over torch.distributed (a no-op with one process)."""

from __future__ import annotations

import gc
import logging
import os
import re
import shutil
import subprocess
import time
import traceback
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager, contextmanager, nullcontext
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist

from maxent_grpo.errors import UserError

log = logging.getLogger("maxent_grpo")

# How long the ranks left after a failed collective wait for each other's answer before naming the rest lost.
ROLL_CALL_S = 10.0
# A gloo or NCCL transport failure (a peer gone, a collective timed out): gloo raises plain RuntimeErrors.
_TRANSPORT_ERROR = re.compile(r"gloo/transport|ProcessGroupGloo|NCCL")
_INCARNATION = ["0"]  # under torchrun: this group's number among the run's restarts (_incarnation_store)


class LostRankError(UserError):
    """A collective failed because other ranks stopped answering; the message names them."""


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
            joined = _incarnation_store(timeout)
            if torch.cuda.is_available():
                device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))
                torch.cuda.set_device(device)
                # device_id: NCCL connects now, so a broken rank fails here and not at the first collective.
                dist.init_process_group(backend="nccl", timeout=timeout, device_id=device, **joined)
            else:
                dist.init_process_group(backend="gloo", timeout=timeout, **joined)
            log.info("process group: %s, %s processes; a collective waits at most %g min for the others "
                     "(training.dist_timeout_minutes), then the run stops naming the ranks that did not answer",
                     dist.get_backend(), dist.get_world_size(), timeout_minutes)
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
    group = None
    try:
        group = Dist.init(timeout_minutes)
        yield group
    except BaseException as err:
        if joined_here:
            traceback.clear_frames(err.__traceback__)  # the finished frames' locals; the lines stay for printing
            if group is not None and _transport_failed(err):
                raise LostRankError(_lost_ranks_line(group, timeout_minutes, err)) from err
        raise
    finally:
        if joined_here and dist.is_initialized():
            gc.collect()  # the run's objects that sit in reference cycles
            dist.destroy_process_group()


def _incarnation_store(timeout: timedelta) -> dict:
    """``init_process_group``'s store, rank and world size under torchrun's shared rendezvous store (empty:
    the launcher's ``env://`` as it is).

    That store outlives a restart (``--max-restarts``), and with it the dead incarnation's keys, among them
    each rank's address: a restarted worker that reads its predecessor's before the new one is written fails
    to connect (and the restart with it). Each incarnation therefore gets keys of its own, numbered by how
    often this rank has joined: the same number on every rank, since a restart restarts every worker."""
    if os.environ.get("TORCHELASTIC_USE_AGENT_STORE") != "True":
        return {}
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    client = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), world, is_master=False,
                           timeout=timeout)
    incarnation = client.add(f"maxent_grpo/joins/{world}/{rank}", 1)
    _INCARNATION[0] = str(incarnation)
    return {"store": dist.PrefixStore(f"maxent_grpo/incarnation/{incarnation}", client), "rank": rank,
            "world_size": world}


def _transport_failed(err: BaseException) -> bool:
    """Whether ``err`` is a collective that failed for want of another rank (not a bug of this one)."""
    if isinstance(err, dist.DistError):
        return True
    return isinstance(err, RuntimeError) and _TRANSPORT_ERROR.search(str(err)) is not None


def _lost_ranks_line(group: Dist, timeout_minutes: float, err: BaseException) -> str:
    """One line naming the ranks that did not answer a roll call of the ranks left, through torchrun's
    rendezvous store (which outlives any worker), or saying that the store itself is gone."""
    first = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
    limit = f"training.dist_timeout_minutes={timeout_minutes:g}"
    try:
        lost = _roll_call(group, ROLL_CALL_S)
    except (RuntimeError, OSError, KeyError, ValueError) as store_err:  # DistStoreError is a RuntimeError
        return (f"rank {group.rank} of {group.world_size}: a collective failed ({first}) and the rendezvous store "
                f"does not answer either ({type(store_err).__name__}); the node holding it is lost ({limit})")
    if not lost:
        return f"rank {group.rank} of {group.world_size}: a collective failed ({first}); every rank is still there"
    named = ", ".join(str(r) for r in lost)
    return (f"lost rank{'s' if len(lost) > 1 else ''} {named} of {group.world_size}: rank {group.rank}'s collective "
            f"failed ({first}; {limit}) and {'they' if len(lost) > 1 else 'it'} did not answer within "
            f"{ROLL_CALL_S:g} s; restart the run with --resume auto (torchrun --max-restarts does it)")


def _roll_call(group: Dist, grace_s: float) -> list[int]:
    """The ranks that did not check in within ``grace_s``; the keys are this incarnation's, so an earlier
    one's (in torchrun's store, which outlives restarts) do not count."""
    store = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), is_master=False,
                          timeout=timedelta(seconds=grace_s), wait_for_workers=False)
    scope = f"maxent_grpo/roll_call/{_INCARNATION[0]}"
    store.set(f"{scope}/{group.rank}", "here")
    deadline = time.monotonic() + grace_s
    while True:
        missing = [r for r in range(group.world_size) if not store.check([f"{scope}/{r}"])]
        if not missing or time.monotonic() > deadline:
            return missing
        time.sleep(0.2)


class DataParallelPolicy(torch.nn.parallel.DistributedDataParallel):
    """DDP that still exposes the wrapped model's ``config`` (the log-prob code reads the vocab size)."""

    @property
    def config(self):
        return self.module.config


def ddp_gradient_sync(model: torch.nn.parallel.DistributedDataParallel) -> Callable[[bool], AbstractContextManager]:
    """``grpo_step``'s ``gradient_sync`` for DDP: ``no_sync`` on every micro-batch but the last, so
    the accumulated gradients are all-reduced once per optimizer step."""
    return lambda is_last: nullcontext() if is_last else model.no_sync()
