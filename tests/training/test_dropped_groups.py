"""Groups the producer drops (a failed episode takes its row's group with it) are counted by the
step that trains on their batch (``skipped/failed_episodes``), whether that batch was sampled at the
step or ahead of it (``rollout.max_staleness``): the count rides on the batch's record, so a batch
sampled early is not counted early, and a resumed run counts its restored batches once."""

from __future__ import annotations

import textwrap

import pytest

from maxent_grpo.cli import main
from maxent_grpo.rollout.data_plane import RolloutRecord
from maxent_grpo.training.checkpoint import read_trainer_state
from maxent_grpo.training.metrics import read_metrics
from tiny_runs import tiny_overrides

# Episodes are opened in order, all of a batch before its first turn (2 prompts x 4 = 8 per batch):
# the 3rd and the 12th reset fail, one in each of the first two batches.
USER_FILE = textwrap.dedent('''
    import maxent_grpo.envs


    class FailsTwice:
        tools = ()
        opened = 0

        def reset(self, row):
            FailsTwice.opened += 1
            if FailsTwice.opened in (3, 12):
                raise ConnectionError("sandbox unreachable")
            return [{"role": "user", "content": row["prompt"]}]

        def step(self, messages, assistant):
            return maxent_grpo.envs.StepResult(None)

        def get_reward(self):
            return None
''')


@pytest.mark.parametrize("max_staleness", [0, 1])
def test_each_step_counts_the_groups_its_own_batch_dropped(max_staleness, tiny_model_dir, tmp_path):
    user = tmp_path / f"fails_twice_{max_staleness}.py"
    user.write_text(USER_FILE)
    out = tmp_path / "run"
    args = tiny_overrides(tiny_model_dir, out, rewards="[{name: length, kwargs: {max_length: 100}}]", steps=2, extra=[
        f"environment.classes={{fails: {user}:FailsTwice}}", "environment.name=fails", "environment.max_turns=1",
        f"rollout.max_staleness={max_staleness}", "checkpoint.save_steps=1"])
    assert main(["train", *args]) == 0
    rows = read_metrics(out / "metrics.jsonl")
    assert [r["skipped/failed_episodes"] for r in rows] == [1.0, 2.0]
    saved = read_trainer_state(out / "checkpoints" / "step-1")
    assert saved["skips"] == {"failed_episodes": 1}
    # The batch sampled ahead is saved with its own count, for the resumed run to add when it trains on it.
    ahead = [RolloutRecord.from_state(r) for r in saved["rollouts_in_flight"][0]]
    assert [(r.step, r.dropped) for r in ahead] == ([(1, {"failed_episodes": 1})] if max_staleness else [])
