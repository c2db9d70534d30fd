"""Verified mode replay in the run (ALGORITHMS.md §17): the ``replay:`` section, admission of a
step's fresh groups into the bank, this step's replay batch, and the bank in the checkpoint.

The pure parts live in ``core/``: the bank's rules in ``core/mode_bank.py``, the loss and its
layout in ``core/replay.py``. Here:

* admission reads each completion's deciding reward (the first reward function, as
  evaluation's ``correct``), whether it is in the loss (a completion token in the loss
  mask) and its mode key (``tasks.modebench.mode_info``: the task's verifier); with several
  processes every rank gathers every rank's groups and admits them all in rank order, so
  the banks stay identical and the replay term counts once;
* step ``t`` admits before it replays (a mode found at ``t`` can be replayed at ``t``);
* the bank is a part of ``trainer_state`` and so written atomically with the model and
  optimizer; a resume refuses another capacity, groups per step, coef or compute_only.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

from maxent_grpo.core.mode_bank import ModeBank
from maxent_grpo.core.replay import ReplayBatch, replay_layout, replay_scale
from maxent_grpo.tasks.modebench import mode_info
from maxent_grpo.tasks.modebench_package import Grades
from maxent_grpo.training.distributed import Dist

__all__ = ["ReplayConfig", "admit_batch", "bank_from_state", "bank_state", "check_replay", "replay_batch"]


@dataclass(frozen=True)
class ReplayConfig:
    enabled: bool = field(default=False, metadata={
        "help": "verified mode replay: bank one exemplar per verified mode of each prompt and add a likelihood "
                "term over them every step (Re:Dr, Re:Max; needs a task with mode keys, e.g. modebench_pkg:)"})
    coef: float = field(default=0.1, metadata={
        "help": "alpha; the term is added with weight alpha (G-1)/G^2, as remax's learner applies it"})
    capacity: int = field(default=16, metadata={"help": "exemplars kept per prompt (no eviction, no replacement)"})
    groups_per_step: int = field(default=1, metadata={"help": "banked prompts replayed per optimizer step (round robin)"})
    compute_only: bool = field(default=False, metadata={
        "help": "the control: run every replay pass and keep the bank, with an exactly zero replay gradient"})


def check_replay(cfg: ReplayConfig, num_generations: int) -> list[tuple[str, str]]:
    """Per-key problems of the section, as ``(key, problem)``."""
    out = []
    if not (isinstance(cfg.coef, (int, float)) and math.isfinite(cfg.coef) and cfg.coef > 0):
        out.append(("replay.coef", f"must be finite and > 0, got {cfg.coef!r}"))
    for name in ("capacity", "groups_per_step"):
        value = getattr(cfg, name)
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            out.append((f"replay.{name}", f"must be an int >= 1, got {value!r}"))
    if cfg.enabled and num_generations < 2:
        out.append(("replay.enabled", f"needs generation.num_generations >= 2, got {num_generations}"))
    return out


@dataclass(frozen=True)
class _Group:
    prompt_ids: list[int]
    keys: list[str | None]
    rewards: list[float]
    active: list[bool]
    responses: list[list[int]]


def _groups(rows: Sequence[dict], rollout, deciding: torch.Tensor, active: torch.Tensor,
            grades: Grades | None) -> list[_Group]:
    g = rollout.num_generations
    out = []
    for p, row in enumerate(rows):
        keys = []
        for i in range(p * g, (p + 1) * g):
            info = mode_info(row, rollout.completion_texts[i], grades)
            if info is None:
                raise ValueError("replay needs mode keys: this row's task has none (use data.source modebench_pkg: "
                                 "or modebench:)")
            keys.append(info[0])
        out.append(_Group(list(rollout.prompt_ids[p]), keys,
                          [0.0 if math.isnan(v) else v for v in deciding[p * g : (p + 1) * g].tolist()],
                          [bool(a) for a in active[p * g : (p + 1) * g].tolist()],
                          [list(c) for c in rollout.completion_ids[p * g : (p + 1) * g]]))
    return out


def admit_batch(bank: ModeBank, rows: Sequence[dict], rollout, deciding: torch.Tensor, active: torch.Tensor,
                dist: Dist, grades: Grades | None = None) -> dict[str, float]:
    """Admit this step's fresh groups (every rank's, in rank order); return the ``bank/*`` metrics.

    ``deciding`` ``[N]``: the deciding reward of each completion (NaN: not scored, counts as 0);
    ``active`` ``[N]``: the completion has a token in the loss; ``grades``: the batch's modebench
    grades, so that admission grades no completion again (None: grade here)."""
    groups = dist.gather_objects(_groups(rows, rollout, deciding, active, grades))
    new = disagreements = 0
    for grp in groups:
        stats = bank.admit_group(grp.prompt_ids, grp.keys, grp.rewards, grp.active, grp.responses)
        new += stats.new_modes
        disagreements += stats.disagreements
    return {**bank.stats(), "bank/new_modes": float(new), "bank/disagreements": float(disagreements)}


def replay_batch(bank: ModeBank, cfg: ReplayConfig, num_generations: int, pad_token_id: int, device: torch.device,
                 rows_per_pass: int) -> ReplayBatch | None:
    """This step's replay work (advances the bank's cursor); None while the bank is empty."""
    groups = bank.schedule()
    if not groups:
        return None
    layout = replay_layout([(g.prompt_ids, g.exemplars) for g in groups], pad_token_id, device)
    return ReplayBatch(layout, replay_scale(cfg.coef, num_generations), cfg.compute_only, rows_per_pass)


def bank_state(bank: ModeBank) -> dict:
    """The bank, for ``trainer_state``. The replay settings it was filled under are the checkpoint's
    config, which a resume may not change (``run_dir.FIXED_ON_RESUME``)."""
    return {"bank": bank.state_dict()}


def bank_from_state(state: dict, cfg: ReplayConfig) -> ModeBank:
    """The bank of a checkpoint's ``trainer_state`` entry."""
    bank = ModeBank(cfg.capacity, cfg.groups_per_step)
    bank.load_state_dict(state["bank"])
    return bank
