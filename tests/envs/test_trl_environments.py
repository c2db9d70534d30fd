"""A TRL ``environment_factory`` class from a user's file trains unchanged (issue 22)."""

from __future__ import annotations

import json
import textwrap

from maxent_grpo.cli import main
from maxent_grpo.envs.trl_compat import TRLEnvironment, is_trl_environment
from maxent_grpo.training.metrics import read_metrics
from tiny_runs import tiny_overrides

# TRL's convention: reset(**row) -> str | None, public methods are tools, get_reward() scores the rollout.
USER_FILE = textwrap.dedent('''
    import random


    class Adder:
        def __init__(self):
            self.calls = 0
            self.rng = random.Random(0)

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

        def _private(self):
            return "not a tool"

        def get_reward(self) -> float:
            return self.calls + self.rng.random()
''')


def _adder(tmp_path):
    path = tmp_path / "my_envs.py"
    path.write_text(USER_FILE)
    namespace: dict = {}
    exec(compile(USER_FILE, str(path), "exec"), namespace)
    return path, namespace["Adder"]


def test_a_trl_class_is_adapted_its_public_methods_are_tools(tmp_path):
    _, adder = _adder(tmp_path)
    assert is_trl_environment(adder)
    env = TRLEnvironment(adder(), call_timeout_s=5.0)
    assert [t.__name__ for t in env.tools] == ["add"]
    opening = env.reset({"prompt": "What is 2 + 3?", "answer": "5", "environment": "adder"})
    assert opening == [{"role": "user", "content": "What is 2 + 3? Use the add tool."}]
    call = '<tool_call>{"name": "add", "arguments": {"a": 2, "b": 3}}</tool_call>'
    step = env.step(opening, {"role": "assistant", "content": call})
    assert step.observation == [{"role": "tool", "name": "add", "content": "5"}]
    assert env.step(opening, {"role": "assistant", "content": "\\boxed{5}"}).done
    assert 1.0 <= env.get_reward() < 2.0  # one call, plus the class's own noise


def test_a_trl_environment_factory_class_trains_unchanged_beside_a_registered_one(tmp_path, tiny_model_dir):
    """Rows name their environment (TRL's column): the user's TRL class on odd rows, the built-in
    calculator (the default) on the others; validation reports each task on its own."""
    path, _ = _adder(tmp_path)
    data = tmp_path / "rows.jsonl"
    data.write_text("".join(json.dumps({"prompt": f"What is {i} + 1?", "answer": str(i + 1),
                                        "environment": "adder" if i % 2 else None}) + "\n" for i in range(16)))
    out = tmp_path / "run"
    args = tiny_overrides(tiny_model_dir, out, rewards="[{name: environment}, {name: boxed_accuracy}]", extra=[
        f"data.source={data}", f"environment.classes={{adder: {path}:Adder}}", "environment.name=calculator",
        "environment.max_turns=2", "data.task_kwargs={}", "data.few_shot=[]", "data.eval_size=8",
        "eval.every_steps=1", "eval.num_prompts=8", "eval.k=2"])
    assert main(["train", *args]) == 0
    rows = read_metrics(out / "metrics.jsonl")
    assert [r["step"] for r in rows] == [1, 2]
    # No completion of the tiny model calls a tool: the adder's score is its own noise in [0, 1)
    # and the calculator gives none, so the mean is over the adder's episodes.
    # (A step whose rows were all the calculator's has no environment score: null, never 0.)
    scores = [r["rewards/environment/mean"] for r in rows if r["rewards/environment/mean"] is not None]
    assert scores and all(0.0 <= v < 1.0 for v in scores)
    assert all("env/turns" in r and r["env/turns"] >= 1 for r in rows)
    assert all(f"eval/{task}/pass@1" in r for task in ("adder", "calculator") for r in rows)
