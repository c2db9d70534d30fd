"""Admission of a step's groups into the replay bank (training/replay.py) on real modebench rows,
the replay batch it schedules, and the bank through trainer_state."""

from __future__ import annotations

import json
import math

import pytest
import torch

from maxent_grpo.core.mode_bank import ModeBank
from maxent_grpo.rollout.backend import RolloutBatch
from maxent_grpo.tasks.modebench_package import package_rows
from maxent_grpo.training.distributed import Dist
from maxent_grpo.training.run_dir import RunDirError, resume_changes
from maxent_grpo.training.replay import ReplayConfig, admit_batch, bank_from_state, bank_state, check_replay, replay_batch


def _rollout(rows, texts, g):
    return RolloutBatch(prompts=["p"] * len(rows), prompt_ids=[[10 + p, 11] for p in range(len(rows))],
                        completion_ids=[[len(t), 7, 2] for t in texts], completion_texts=texts,
                        finish_reasons=["stop"] * len(texts), behaviour_logps=None, num_generations=g)


def test_admission_keys_by_the_package_verifier_and_replays_what_it_banked():
    rows = package_rows("countdown", size=2, seed=0)
    good = rows[0]["answer"][len("\\boxed{"):-1]
    texts = [f"\\boxed{{{good}}}", f"\\boxed{{{good}}}", "\\boxed{1}", "no",   # prompt 0: one mode twice
             "x", "y", "z", "w"]                                                  # prompt 1: nothing
    deciding = torch.tensor([1.0, 1.0, 0.0, 0.0, 0.0, 0.0, 0.0, float("nan")], dtype=torch.float64)
    active = torch.tensor([1, 1, 1, 1, 1, 1, 1, 1], dtype=torch.bool)
    bank = ModeBank(capacity=4)
    metrics = admit_batch(bank, rows, _rollout(rows, texts, 4), deciding, active, Dist())
    assert metrics["bank/prompts"] == 1 and metrics["bank/modes"] == 1 and metrics["bank/new_modes"] == 1
    assert metrics["bank/disagreements"] == 0
    cfg = ReplayConfig(enabled=True, coef=0.1)
    batch = replay_batch(bank, cfg, 4, pad_token_id=0, device=torch.device("cpu"), rows_per_pass=2)
    assert batch.layout.input_ids.tolist() == [[10, 11, len(texts[0]), 7, 2]]
    assert batch.scale == pytest.approx(0.1 * 3 / 16) and not batch.compute_only


def test_a_row_without_mode_keys_is_refused_in_one_line():
    rows = [{"prompt": "2+2?", "answer": "4"}]
    with pytest.raises(ValueError, match="replay needs mode keys"):
        admit_batch(ModeBank(), rows, _rollout(rows, ["4", "5"], 2), torch.ones(2, dtype=torch.float64),
                    torch.ones(2, dtype=torch.bool), Dist())


def test_the_bank_through_trainer_state_and_a_resume_with_other_settings():
    """The bank round-trips through JSON; a checkpoint's bank with another capacity is refused (the
    config comparison refuses any replay change first, --allow-config-change or not: FIXED_ON_RESUME)."""
    bank = ModeBank(capacity=2)
    bank.admit_group((1, 2), ["a", "b"], [1.0, 1.0], [True, True], [(3,), (4,)])
    cfg = ReplayConfig(enabled=True, capacity=2)
    state = json.loads(json.dumps(bank_state(bank)))
    assert bank_from_state(state, cfg).state_dict() == bank.state_dict()
    with pytest.raises(ValueError, match="capacity"):
        bank_from_state(state, ReplayConfig(enabled=True, capacity=3))
    for key, old, new in (("coef", 0.1, 0.2), ("compute_only", False, True), ("groups_per_step", 1, 2)):
        with pytest.raises(RunDirError, match=f"replay.{key}"):
            resume_changes({"replay": {key: old}}, {"replay": {key: new}}, allow_change=True)


def test_section_checks():
    assert check_replay(ReplayConfig(), 4) == []
    problems = dict(check_replay(ReplayConfig(enabled=True, coef=math.inf, capacity=0, groups_per_step=True), 1))
    assert set(problems) == {"replay.coef", "replay.capacity", "replay.groups_per_step", "replay.enabled"}
