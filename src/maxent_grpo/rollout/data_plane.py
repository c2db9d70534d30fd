"""The rollout data plane: where a step's rollouts wait between the sampler and the trainer.

The lifecycle follows NeMo-RL's ``grpo_sync`` (the seed page): the step's
partition is registered, the producer puts the step's rollouts into it, the
trainer fetches its shard, and the partition is cleared at the end of the step.
Validation uses its own partition (``val/<step>``). The loop does not know
which plane it talks to (``rollout.data_plane``):

* ``local``: an in-process dict (the default);
* ``transferqueue``: the TransferQueue library (``rollout/transferqueue_plane.py``,
  the ``transferqueue`` extra).

Each process owns its plane and fetches the rows it produced (our processes each
sample their own prompts); ``fetch`` does not consume, so a checkpoint can read
what is still in flight, and ``clear`` removes it.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Protocol

import torch

from maxent_grpo.rollout.backend import RolloutBatch
from maxent_grpo.tasks.modebench_package import Grades


@dataclass(frozen=True)
class Skipped:
    """A batch that does not train: the stage that failed (the ``skipped/<stage>`` counter it counts
    in) and why. ``other_rank``: this process's batch was fine and another process's failed."""

    stage: str
    reason: str

    def __str__(self) -> str:
        return f"{self.stage}: {self.reason}"


@dataclass
class RolloutRecord:
    """One step's rollouts as the producer leaves them: sampled and scored, not yet trained on.

    ``version`` is the number of optimizer steps the sampling weights had taken
    (the policy version); the trainer uses it for the staleness bound
    (ALGORITHMS.md §15). A failed production keeps ``failure`` (a :class:`Skipped`)
    and no rollout, so the trainer counts the skip like a synchronous run.
    """

    step: int  # the optimizer step these rollouts are for (0-based: the step that trains on them)
    version: int
    rows: list[dict]
    rollout: RolloutBatch | None
    rewards: torch.Tensor | None  # [P*G, F] per reward function, NaN where a function returned None
    stats: dict[str, float] = field(default_factory=dict)
    timings: dict[str, float] = field(default_factory=dict)
    failure: Skipped | None = None
    # Columns the reward functions added for the completion table (TRL's log_extra), one value per completion.
    extra_columns: dict[str, list] = field(default_factory=dict)
    # Groups the producer dropped, by cause ("incomplete_groups", "failed_episodes"): the trainer adds
    # them to the run's skip counts when it takes the record.
    dropped: dict[str, int] = field(default_factory=dict)
    # The batch's modebench grades, made by the reward and read again by the answer keys and replay
    # admission (each completion graded once). A memo only: not saved, and a plane that ships the
    # record to another process hands over an empty one (the trainer then grades again).
    grades: Grades = field(default_factory=Grades, compare=False, repr=False)

    def __post_init__(self) -> None:
        if (self.failure is None) == (self.rollout is None):
            raise ValueError("a RolloutRecord holds either a rollout or a failure")
        if self.rollout is not None:
            n = self.rollout.num_completions
            if self.rewards is None or self.rewards.dim() != 2 or self.rewards.shape[0] != n:
                raise ValueError(f"rewards must be [{n}, F] for {n} completions")
            if len(self.rows) != self.rollout.num_prompts:
                raise ValueError(f"{len(self.rows)} rows for {self.rollout.num_prompts} prompts")

    def to_state(self) -> dict:
        """The record as JSON types (a checkpoint's ``trainer_state.json``); floats round-trip exactly."""
        state = dataclasses.asdict(dataclasses.replace(self, grades=Grades()))
        del state["grades"]
        state["rewards"] = None if self.rewards is None else {"dtype": str(self.rewards.dtype).removeprefix("torch."),
                                                              "values": self.rewards.tolist()}
        state["failure"] = None if self.failure is None else [self.failure.stage, self.failure.reason]
        return state

    @classmethod
    def from_state(cls, state: dict) -> "RolloutRecord":
        rewards = state["rewards"]
        return cls(
            **{**state,
               "rollout": None if state["rollout"] is None else RolloutBatch(**state["rollout"]),
               "rewards": None if rewards is None else torch.tensor(rewards["values"], dtype=getattr(torch, rewards["dtype"])),
               "failure": None if state["failure"] is None else Skipped(*state["failure"])},
        )


class DataPlane(Protocol):
    def register(self, partition: str) -> None:
        """Open ``partition`` (a step's, or ``val/<step>``); an error if it is open already."""
        ...

    def put(self, partition: str, record: RolloutRecord) -> None:
        """Store ``record`` in the registered ``partition`` (one record per partition)."""
        ...

    def fetch(self, partition: str) -> RolloutRecord | None:
        """The partition's record, or None while none was put; reading does not remove it."""
        ...

    def clear(self, partition: str) -> None:
        """Drop the partition and its record."""
        ...

    def partitions(self) -> list[str]:
        """The open partitions, in the order they were registered."""
        ...

    def close(self) -> None:
        """Release what the plane holds (processes, sockets); the plane is unusable afterwards."""
        ...


class LocalDataPlane:
    """The in-process plane: a dict from partition to record."""

    def __init__(self) -> None:
        self._records: dict[str, RolloutRecord | None] = {}

    def register(self, partition: str) -> None:
        if partition in self._records:
            raise ValueError(f"partition {partition!r} is registered already")
        self._records[partition] = None

    def put(self, partition: str, record: RolloutRecord) -> None:
        if partition not in self._records:
            raise KeyError(f"partition {partition!r} is not registered")
        if self._records[partition] is not None:
            raise ValueError(f"partition {partition!r} holds a record already")
        self._records[partition] = record

    def fetch(self, partition: str) -> RolloutRecord | None:
        if partition not in self._records:
            raise KeyError(f"partition {partition!r} is not registered")
        return self._records[partition]

    def clear(self, partition: str) -> None:
        self._records.pop(partition, None)

    def partitions(self) -> list[str]:
        return list(self._records)

    def close(self) -> None:
        self._records.clear()

