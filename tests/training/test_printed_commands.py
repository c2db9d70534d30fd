"""Every command a finished run prints works as printed.

A tiny run through the CLI prints ``plots: maxent-grpo report RUN`` and ``evaluate:
maxent-grpo eval CKPT --config RUN/config.yaml --output RUN/eval/step-N``; each is run
as printed, in a fresh process. (The resume command printed after Ctrl-C is run as
printed by tests/training/test_run_safety.py.)
"""

from __future__ import annotations

import json
import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

from maxent_grpo.cli import main
from tiny_runs import read_jsonl, tiny_overrides

TESTS = Path(__file__).resolve().parents[1]
REWARDS = "[{name: boxed_accuracy}, {name: length, kwargs: {max_length: 100}}]"
PROBLEM = re.compile(r"arithmetic problem: (.*?) =")
OVERLAP_WARNING = "are training rows of reasoning_gym:chain_sum"

# (steps, prompts per step, overrides) of each run.
CASES = {
    # chain_sum with one one-digit term has 10 problems; 4 steps of 16 prompts draw every one of
    # the 64 rows, so the run trained on every problem the task has (before issue 33 the printed
    # eval command stopped: "every problem reasoning_gym:chain_sum generates is one the run trained on").
    "every-problem-trained": (4, 16, ["data.size=64", "data.task_kwargs={min_terms: 1, max_terms: 1, max_digits: 1}"]),
    # The default run's data: 1000 rows of one-digit a + b or a - b hold nearly all of its 200 problems;
    # the run draws a few of them.
    "default-task": (2, 2, ["data.size=1000", "data.task_kwargs={min_terms: 2, max_terms: 2, max_digits: 1}"]),
    # A held-out split.
    "held-out": (2, 2, ["data.eval_size=4"]),
}


def _printed_commands(stdout: str) -> dict[str, list[str]]:
    """The summary's ``plots:`` and ``evaluate:`` lines as argument lists."""
    commands = {}
    for line in stdout.splitlines():
        label, _, command = line.strip().partition(": ")
        if label in ("plots", "evaluate"):
            commands[label] = shlex.split(command)
    return commands


def _run_as_printed(command: list[str], cwd: Path) -> subprocess.CompletedProcess:
    assert command[0] == "maxent-grpo", command
    env = {**os.environ, "MAXENT_GRPO_LOG": "WARNING"}
    return subprocess.run([sys.executable, "-m", "maxent_grpo.cli", *command[1:]], cwd=cwd, env=env,
                          capture_output=True, text=True, timeout=600)


def _problems(records) -> set[str]:
    # The last problem of each rendered prompt: the default task's solved example comes first.
    return {PROBLEM.findall(r["prompt"])[-1] for r in records}


@pytest.mark.slow
@pytest.mark.parametrize("case", CASES)
def test_the_eval_and_report_commands_a_run_prints_work_as_printed(case, tiny_model_dir, tmp_path, capsys):
    steps, prompts, extra = CASES[case]
    out = tmp_path / "run"
    args = tiny_overrides(tiny_model_dir, out, rewards=REWARDS, steps=steps, prompts_per_step=prompts,
                          extra=["eval.num_prompts=4", "eval.k=2", *extra])
    assert main(["train", *args]) == 0
    commands = _printed_commands(capsys.readouterr().out)
    assert set(commands) == {"plots", "evaluate"}, commands

    report = _run_as_printed(commands["plots"], tmp_path)
    assert report.returncode == 0, report.stderr
    assert (out / "report" / "report.html").is_file()

    evaluate = _run_as_printed(commands["evaluate"], tmp_path)
    assert evaluate.returncode == 0, evaluate.stderr
    eval_dir = Path(commands["evaluate"][commands["evaluate"].index("--output") + 1])
    assert eval_dir == out / "eval" / f"step-{steps}"
    assert json.loads((eval_dir / "summary.json").read_text())["num_prompts"] == 4
    trained = _problems(r for s in range(1, steps + 1) for r in read_jsonl(out / "completions" / f"step-{s}.jsonl"))
    evaluated = _problems(read_jsonl(eval_dir / "completions.jsonl"))
    assert len(evaluated) == 4
    if case == "every-problem-trained":
        # Nothing left to hold out: it evaluates problems it trained on, and says so.
        assert trained == {str(i) for i in range(10)}
        assert evaluated <= trained
        assert f"4 of 4 prompts {OVERLAP_WARNING}" in evaluate.stderr
    else:
        assert not evaluated & trained
        assert OVERLAP_WARNING not in evaluate.stderr
