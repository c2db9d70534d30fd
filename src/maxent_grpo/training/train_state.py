"""The run's live state: one record, owned by the loop, saved and restored whole.

Everything that changes as a run trains, and that a resumed run must get back to
go on as the uninterrupted run would, is a field of :class:`TrainState`:

* ``step``: optimizer steps done;
* ``data``: the prompt sampler's position (epoch, order, cursor);
* ``controllers``: the live tau, beta and the rest of the controllers' state (ALGORITHMS.md §8),
  a value each step replaces (``core.controllers.step_controllers``); the step's
  ``WeightingSettings`` is the plan's with this state (``rewards.maxent.weighting_at``);
* ``skips``: batches and groups skipped so far, by stage, and the run of batches skipped in a row
  (training/skip_counts.py);
* ``bank``: verified mode replay's bank (``replay.enabled``);
* ``entropy``: the adaptive entropy coefficient (``loss.adaptive_entropy``);
* ``collapse`` and ``constant_rewards``: the watches behind the run's collapse and constant-reward
  warnings (the steps they compare, what they have said).

The weights, optimizer, scheduler, random generators and a reference that follows
the policy are saved beside it by the checkpoint (training/checkpoint.py), and so are
the batches the rollout queue sampled ahead and has not trained on (the running
service itself is the run's, ``Run.rollouts``: ``RolloutQueue.state_dict``); what a
resume may not change of the config is ``run_dir.FIXED_ON_RESUME``.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from pathlib import Path

from maxent_grpo.core.entropy_control import EntropyCoefState
from maxent_grpo.core.mode_bank import ModeBank
from maxent_grpo.data.datasets import PromptSampler
from maxent_grpo.core.controllers import ControllerState
from maxent_grpo.training.checkpoint import CheckpointError
from maxent_grpo.training.collapse import CollapseWatch
from maxent_grpo.training.learning_signal import ConstantRewardWatch
from maxent_grpo.training.replay import ReplayConfig, bank_from_state, bank_state
from maxent_grpo.training.skip_counts import SkipCounts

log = logging.getLogger("maxent_grpo")


@dataclass
class TrainState:
    """What a run changes as it trains (module docstring); ``to_dict`` / ``restore`` for checkpoints."""

    data: PromptSampler
    controllers: ControllerState
    collapse: CollapseWatch
    constant_rewards: ConstantRewardWatch = field(default_factory=ConstantRewardWatch)
    bank: ModeBank | None = None
    entropy: EntropyCoefState | None = None
    step: int = 0
    skips: SkipCounts = field(default_factory=SkipCounts)
    start_step: int = 0  # where this process began: 0, or the resumed checkpoint's step
    resumed: bool = False

    def to_dict(self, config: dict, data_state: dict | None = None) -> dict:
        """This state's part of the checkpoint's ``trainer_state.json``. ``data_state``: the sampler's
        position from before a step that was abandoned half-way."""
        return {
            "step": self.step,
            "sampler": self.data.state_dict() if data_state is None else data_state,
            "controller": self.controllers.to_dict(),
            **self.skips.state_dict(),
            "config": config,
            # Saved with the weights at the same step, so a resumed run replays what the uninterrupted one does.
            "replay": None if self.bank is None else bank_state(self.bank),
            "entropy_control": None if self.entropy is None else self.entropy.to_dict(),
            "watches": {"collapse": self.collapse.state_dict(), "constant_rewards": self.constant_rewards.state_dict()},
        }

    def restore(self, saved: dict, *, replay: ReplayConfig, where: Path) -> None:
        """Take back the state of checkpoint ``where`` (``saved``: its ``trainer_state.json``)."""
        self.data.load_state_dict(saved["sampler"])
        self.controllers = ControllerState.from_dict(saved["controller"])
        self.skips.load_state_dict(saved)
        if "watches" in saved:  # absent from checkpoints written before the watches were saved
            self.collapse.load_state_dict(saved["watches"]["collapse"])
            self.constant_rewards.load_state_dict(saved["watches"]["constant_rewards"])
        if self.entropy is not None and saved.get("entropy_control") is not None:
            self.entropy = EntropyCoefState.from_dict(saved["entropy_control"])
        if self.bank is not None:
            if saved.get("replay") is None:
                raise CheckpointError(f"--resume: replay.enabled but {where} holds no replay bank (its run had no replay)")
            try:
                self.bank = bank_from_state(saved["replay"], replay)
            except ValueError as err:
                raise CheckpointError(f"--resume: {err}") from err
        self.step = self.start_step = int(saved["step"])
        self.resumed = True
