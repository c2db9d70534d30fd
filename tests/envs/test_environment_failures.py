"""An environment that raises on every call, or hangs, ends the run in one line after
``training.max_consecutive_skips`` failed batches, with a checkpoint (issue 22).

The step timeout (1.5 s) only has to separate a call that returns at once from one that never
does: generous for a loaded machine, short enough for the 16 hung calls the test waits out."""

from __future__ import annotations

import textwrap

import pytest

from maxent_grpo.cli import main
from maxent_grpo.training.checkpoint import list_checkpoints
from maxent_grpo.training.metrics import read_metrics
from tiny_runs import tiny_overrides

# Healthy for the first 16 episodes (two steps of 2 prompts x 4), then broken on every call.
USER_FILE = textwrap.dedent('''
    import threading


    class Breaks:
        tools = ()
        opened = 0

        def reset(self, row):
            Breaks.opened += 1
            if Breaks.opened > 16:
                {failure}
            return [{{"role": "user", "content": row["prompt"]}}]

        def step(self, messages, assistant):
            return None if False else __import__("maxent_grpo.envs").envs.StepResult(None)

        def get_reward(self):
            return None
''')
FAILURES = {
    "raises": ('raise ConnectionError("sandbox unreachable")', "reset raised ConnectionError: sandbox unreachable"),
    "hangs": ("threading.Event().wait(60)", "reset: no answer within 1.5 s"),
}


@pytest.mark.parametrize("kind", sorted(FAILURES))
def test_a_broken_environment_stops_the_run_with_a_checkpoint(kind, tiny_model_dir, tmp_path, capsys):
    code, message = FAILURES[kind]
    user = tmp_path / f"breaks_{kind}.py"
    user.write_text(USER_FILE.format(failure=code))
    out = tmp_path / "run"
    args = tiny_overrides(tiny_model_dir, out, rewards="[{name: length, kwargs: {max_length: 100}}]", steps=20, extra=[
        f"environment.classes={{breaks: {user}:Breaks}}", "environment.name=breaks", "environment.max_turns=2",
        "environment.step_timeout_s=1.5", "training.max_consecutive_skips=2",
        "checkpoint.save_steps=0", "checkpoint.save_minutes=0"])
    assert main(["train", *args]) == 1
    err = capsys.readouterr().err.strip()
    last = err.splitlines()[-1]
    assert "Traceback" not in err
    assert "2 batches in a row failed" in err and message in err and "at step 2" in err, err
    assert [p.name for p in list_checkpoints(out)] == ["step-2"] and f"checkpoint {out}/checkpoints/step-2" in err
    assert [r["step"] for r in read_metrics(out / "metrics.jsonl")] == [1, 2]
    assert last.startswith("maxent-grpo: ")
