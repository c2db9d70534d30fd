"""Which weights sample each step's batch, where the sampling runs, and where the batch waits.

``rollout.max_staleness = k`` (ALGORITHMS.md §15, docs/ASYNC.md). The policy's
version is the number of optimizer steps its weights have taken; at the start
of step ``s`` it is ``s``. Batch ``j`` is sampled by version ``max(0, j - k)``:

* ``k = 0``: step ``s`` samples batch ``s`` and trains on it (the synchronous loop). On the local
  plane the loop makes it with ``pipeline.prepare_training_batch`` from the rows :meth:`RolloutQueue.draw`
  gives (:attr:`RolloutQueue.synchronous`); on another plane the batch goes through it as below;
* ``k >= 1``: step ``s`` starts batch ``s + k`` from version ``s`` and trains on
  batch ``s``, sampled ``k`` steps earlier (the first ``k`` batches all come from
  version 0). A sampler in another process (``vllm_server``) samples while the
  trainer trains; one that shares the trainer's devices (hf, a colocated vLLM
  engine) samples first, then the step trains: the same batches, no overlap.

The weights are pushed only after the batch being sampled is complete
(:meth:`RolloutQueue.end_step`), so every token of a batch comes from one
version and a run is deterministic: a resumed run restores the batches that
were waiting (:meth:`in_flight`, saved in the checkpoint) and continues as the
uninterrupted run would. Batches wait on the data plane (``rollout/data_plane.py``)
in the partition ``train/<j>``, registered when the batch is put and cleared once
trained on.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from dataclasses import replace

import torch

from maxent_grpo.core.staleness import admissible
from maxent_grpo.errors import UserError
from maxent_grpo.rollout.backend import SamplerGone, SamplerLost
from maxent_grpo.rollout.data_plane import DataPlane, LocalDataPlane, RolloutRecord, Skipped
from maxent_grpo.training.distributed import Dist
from maxent_grpo.training.pipeline import complete_rollouts, produce_rollouts, sampling_outcome, settle_sampling
from maxent_grpo.training.stages import Draft, PipelineContext
from maxent_grpo.training.seeding import seed_step, step_seed


class RolloutsLost(UserError, RuntimeError):
    """The sampler did not deliver a step's rollouts in time; the message says which and how long."""


def partition(step: int) -> str:
    return f"train/{step}"


class _Job:
    """One batch sampled in a daemon thread (a thread that outlives a stopped run must not keep
    the process alive: it only waits on a server)."""

    def __init__(self, step: int, version: int, make_draft: Callable[[], Draft],
                 work: Callable[[], Draft | Skipped | SamplerLost | SamplerGone]):
        self.step, self.version, self.make_draft = step, version, make_draft
        self.started = time.perf_counter()
        self.finished: float | None = None
        self.result: Draft | Skipped | SamplerLost | SamplerGone | None = None
        self.error: BaseException | None = None
        self._done = threading.Event()
        self._thread = threading.Thread(target=self._run, args=(work,), daemon=True, name=f"rollouts-{step}")
        self._thread.start()

    def _run(self, work) -> None:
        try:
            self.result = work()
        except BaseException as err:  # handed to the trainer's thread, which re-raises it
            self.error = err
        finally:
            self.finished = time.perf_counter()
            self._done.set()

    def wait(self, timeout_s: float) -> Draft | Skipped | SamplerLost | SamplerGone:
        if not self._done.wait(timeout_s):
            # What it waited for, and whether the producer is still at it (a hung server) or gone.
            producer = (f"the sampling thread is alive, {time.perf_counter() - self.started:.0f} s into the batch "
                        "(a generation request that never returned)" if self._thread.is_alive()
                        else "the sampling thread has ended without handing a result over")
            raise RolloutsLost(
                f"no rollouts for step {self.step + 1} (partition {partition(self.step)}, sampled by weights version "
                f"{self.version}) after {timeout_s:.0f} s (rollout.wait_timeout_s): {producer}"
            )
        if self.error is not None:
            raise self.error
        return self.result


class RolloutQueue:
    """The batches of the coming steps: ``begin_step`` / ``take`` / ``end_step`` around each step."""

    def __init__(
        self, ctx: PipelineContext, draw_rows: Callable[[], list[dict]], plane: DataPlane, *,
        max_staleness: int, beside: bool, seed: int, wait_timeout_s: float,
    ):
        self.ctx, self.draw_rows, self.plane = ctx, draw_rows, plane
        self.k, self.beside, self.seed, self.wait_timeout_s = max_staleness, beside and max_staleness > 0, seed, wait_timeout_s
        self._job: _Job | None = None
        self._exhausted_at: int | None = None  # the first batch the data could not fill
        self._last_finish: float | None = None
        self.dropped_stale = 0
        self.timings: dict[str, float] = {}

    # ------------------------------------------------------------ the step

    @property
    def synchronous(self) -> bool:
        """Each step samples its own batch and nothing waits on a plane that another process reads:
        the loop makes the batch in a row (``prepare_training_batch``) from :meth:`draw`'s rows."""
        return self.k == 0 and isinstance(self.plane, LocalDataPlane)

    def draw(self, step: int) -> list[dict]:
        """Batch ``step``'s prompt rows, under the step's seed (what :meth:`begin_step` samples from);
        ``StopIteration`` when the data ran out."""
        self.timings = {"time/wait_rollouts": 0.0}
        seed_step(self.seed, self.ctx.dist.rank, step)
        return self.draw_rows()

    def begin_step(self, step: int) -> None:
        """Batches ``step .. step+k-1`` on the plane (sampled now, by the current weights, where
        missing: the first steps, or after a resume that changed k), and batch ``step + k`` started."""
        self.timings = {"time/wait_rollouts": 0.0}
        for j in range(step, step + self.k + 1):
            if self._have(j) or self._exhausted_at is not None:
                continue
            try:
                if j < step + self.k or not self.beside:
                    self._put(self._produce_now(j, version=step))
                else:
                    self._start(j, version=step)
            except StopIteration:  # the data ran out while drawing batch j: steps before it still train
                self._exhausted_at = j

    def _start(self, j: int, *, version: int) -> None:
        seed_step(self.seed, self.ctx.dist.rank, version)  # the trainer thread's own draws this step
        rows = self.draw_rows()
        params = replace(self.ctx.plan.batch.sampling, seed=step_seed(self.seed, self.ctx.dist.rank, j))
        if self._last_finish is not None:
            self.timings["time/sampler_idle"] = time.perf_counter() - self._last_finish

        def draft() -> Draft:
            return Draft(rows, j, version, params, self._more_rows)

        self._job = _Job(j, version, draft, lambda: _sampled(self.ctx, draft()))

    def take(self, step: int) -> RolloutRecord:
        """The record of batch ``step``; ``StopIteration`` when the data ran out before it.

        A batch staler than ``k`` (a resumed run with a smaller k) is dropped and sampled again now."""
        if self._exhausted_at is not None and step >= self._exhausted_at:
            raise StopIteration
        record = self.plane.fetch(partition(step))
        if record is None:
            raise RuntimeError(f"batch {step} (partition {partition(step)}) was never put on the data plane")
        if not bool(admissible(step, torch.tensor([record.version]), self.k)[0]):
            self.dropped_stale += 1
            self.plane.clear(partition(step))
            self._put(self._produce_now(step, version=step))
            record = self.plane.fetch(partition(step))
        return record

    def end_step(self, step: int) -> None:
        """After the optimizer step, before its weights are pushed: wait for the batch being sampled
        (its tokens must all come from the old weights), score it, put it on the plane; clear ``step``'s."""
        self.plane.clear(partition(step))
        job, self._job = self._job, None
        if job is None:
            return
        t0 = time.perf_counter()
        try:
            sampled = job.wait(self.wait_timeout_s)
        except UserError as err:
            if not self.ctx.recovers_lost_server:
                raise
            sampled = err  # agreed on below: every process raises
        self.timings["time/wait_rollouts"] += time.perf_counter() - t0
        self._last_finish = job.finished
        # Rewards, and any dynamic-sampling rounds (which generate again), inside a rollout phase too.
        with self.ctx.backend.rollout_phase(self.ctx.model):
            if self.ctx.recovers_lost_server:  # a batch whose server was lost is sampled again here
                sampled = settle_sampling(self.ctx, sampled, job.make_draft)
            self._put(complete_rollouts(self.ctx, sampled, step=job.step, version=step))

    def metrics(self, step: int, version: int) -> dict[str, float]:
        """Of step ``step``'s batch, sampled by weights ``version``."""
        lag = float(step - version)
        return {"async/version": float(version), "async/staleness_mean": lag, "async/staleness_max": lag,
                "async/dropped_stale": float(self.dropped_stale), **self.timings}

    # ------------------------------------------------------------ checkpoints

    def in_flight(self, step: int) -> list[RolloutRecord]:
        """What a checkpoint of ``step`` keeps: the batches ``step .. step+k-1``, sampled and not yet trained
        on, oldest first (a batch ``step + k`` put by a step cut short was drawn after the saved sampler state)."""
        records = (self.plane.fetch(p) for p in self.plane.partitions() if p.startswith("train/"))
        return [r for r in records if r is not None and r.step < step + self.k]

    def state_dict(self, step: int, dist: Dist) -> dict:
        """The queue's part of checkpoint ``step``'s ``trainer_state.json`` (a collective: every rank's
        batches are gathered)."""
        return {
            # Each rank's batches sampled and not yet trained on: a resumed run restores them rather
            # than sampling them again from weights it no longer has.
            "rollouts_in_flight": dist.gather_objects([[r.to_state() for r in self.in_flight(step)]]),
            # The count async/dropped_stale logs "so far": it goes on from here after a resume.
            "rollouts_dropped_stale": self.dropped_stale,
        }

    def load_state_dict(self, saved: dict, dist: Dist) -> None:
        """From a checkpoint's ``trainer_state.json``. Checkpoints written before asynchronous rollouts hold
        no batches; with another number of processes the batches are sampled again (from the resumed weights)."""
        in_flight = saved.get("rollouts_in_flight") or []
        if len(in_flight) == dist.world_size:
            for state in in_flight[dist.rank]:
                self._put(RolloutRecord.from_state(state))
        self.dropped_stale = int(saved.get("rollouts_dropped_stale", 0))  # absent before it was saved

    def close(self) -> None:
        self._job = None  # a thread still sampling is a daemon: it ends with the process
        self.plane.close()

    # ------------------------------------------------------------ helpers

    def _have(self, j: int) -> bool:
        return partition(j) in self.plane.partitions()

    def _put(self, record: RolloutRecord) -> None:
        self.plane.register(partition(record.step))
        self.plane.put(partition(record.step), record)

    def _produce_now(self, j: int, *, version: int) -> RolloutRecord:
        seed_step(self.seed, self.ctx.dist.rank, j)
        return produce_rollouts(self.ctx, self.draw_rows(), self._more_rows, step=j, version=version)


    def _more_rows(self) -> list[dict]:  # dynamic sampling's further rounds, drawn in the trainer's thread
        return self.draw_rows()


def _sampled(ctx: PipelineContext, draft: Draft) -> Draft | Skipped | SamplerLost | SamplerGone:
    """The producer thread's sampling stages, inside the backend's rollout phase as a step's are."""
    with ctx.backend.rollout_phase(ctx.model):
        return sampling_outcome(ctx, draft)
