"""TRL's reward keywords (rewards/context.py): ``trainer_state``, ``log_extra``, ``log_metric`` and
``environments`` reach reward functions written for TRL, in a real run; a function with a fixed
signature that names none of them keeps working."""

from __future__ import annotations

import json
import textwrap

import pytest

from maxent_grpo.cli import main
from maxent_grpo.rewards.context import RewardContext, TrainerState, accepted_keywords
from maxent_grpo.rewards.registry import RewardSpec, evaluate_rewards
from maxent_grpo.training.metrics import read_metrics
from tiny_runs import tiny_overrides

USER_REWARDS = textwrap.dedent('''
    def progress(prompts, completions, completion_ids, trainer_state, log_extra, log_metric, **kwargs):
        """Shaping by training progress, as a TRL user writes it."""
        log_metric("seen_step", trainer_state.global_step)
        log_metric("max_steps", trainer_state.max_steps)
        log_extra("n_tokens", [len(ids) for ids in completion_ids])
        return [trainer_state.global_step / trainer_state.max_steps] * len(completions)


    def fixed(prompts, completions, **kwargs):
        return [0.5] * len(completions)


    def counts(prompts, completions, environments, **kwargs):
        """TRL's environments: one instance per rollout (the user's own object)."""
        assert len(environments) == len(completions)
        return [1.0 if isinstance(env, Adder) and env.answer.isdigit() else 0.0 for env in environments]


    class Adder:
        def __init__(self):
            self.calls = 0

        def reset(self, **kwargs):
            self.answer = kwargs["answer"]
            return " Use the add tool."

        def add(self, a: int, b: int) -> str:
            """Add two whole numbers.

            Args:
                a: The first number.
                b: The second number.
            """
            self.calls += 1
            return str(a + b)
''')


@pytest.fixture()
def user_file(tmp_path):
    path = tmp_path / "user_rewards.py"
    path.write_text(USER_REWARDS)
    return path


def test_trainer_state_log_extra_and_log_metric_in_a_run(user_file, tiny_model_dir, tmp_path):
    out = tmp_path / "run"
    rewards = f"[{{name: '{user_file}:progress'}}, {{name: '{user_file}:fixed'}}, {{name: length, kwargs: {{max_length: 100}}}}]"
    assert main(["train", *tiny_overrides(tiny_model_dir, out, rewards=rewards, steps=3)]) == 0
    rows = read_metrics(out / "metrics.jsonl")
    assert [r["seen_step"] for r in rows] == [0, 1, 2] and all(r["max_steps"] == 3 for r in rows)
    assert [r["rewards/user_rewards.py:progress/mean"] for r in rows] == pytest.approx([0, 1 / 3, 2 / 3])
    assert all(r["rewards/user_rewards.py:fixed/mean"] == 0.5 for r in rows)
    table = [json.loads(line) for line in (out / "completions" / "step-1.jsonl").read_text().splitlines()]
    assert all(isinstance(t["n_tokens"], int) and t["n_tokens"] == t["length"] for t in table)


def test_environments_are_the_users_instances(user_file, tiny_model_dir, tmp_path):
    data = tmp_path / "rows.jsonl"
    data.write_text("".join(json.dumps({"prompt": f"What is {i} + 1?", "answer": str(i + 1), "environment": "adder"})
                            + "\n" for i in range(8)))
    out = tmp_path / "run"
    args = tiny_overrides(tiny_model_dir, out, rewards=f"[{{name: '{user_file}:counts'}}]", extra=[
        f"data.source={data}", f"environment.classes={{adder: {user_file}:Adder}}", "environment.name=adder",
        "environment.max_turns=2", "data.task_kwargs={}", "data.few_shot=[]"])
    assert main(["train", *args]) == 0
    rows = read_metrics(out / "metrics.jsonl")
    # Each instance is the user's own Adder, reset with its row's answer: every reward is 1.
    assert [r["rewards/user_rewards.py:counts/mean"] for r in rows] == [1.0, 1.0]


def test_only_the_keywords_a_function_takes():
    def named(prompts, completions, answer, trainer_state):
        return [float(trainer_state.global_step)] * len(completions)

    def plain(prompts, completions, answer):
        return [1.0] * len(completions)

    def anything(prompts, completions, **kwargs):
        assert {"trainer_state", "environments", "log_extra", "log_metric"} <= set(kwargs)
        return [2.0] * len(completions)

    assert accepted_keywords(named) == ("trainer_state",) and accepted_keywords(plain) == ()

    spec = RewardSpec(("named", "plain", "anything"), (named, plain, anything), (1.0, 1.0, 1.0))
    context = RewardContext(2, TrainerState(global_step=4, max_steps=10, epoch=0.5))
    out = evaluate_rewards(spec, ["p", "p"], ["a", "b"], {"answer": ["1", "2"]}, context)
    assert out.tolist() == [[4.0, 1.0, 2.0], [4.0, 1.0, 2.0]]
    with pytest.raises(ValueError, match="3 values for 2"):
        context.log_extra("x", [1, 2, 3])
