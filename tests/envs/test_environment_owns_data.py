"""User code the config names resolves beside the config file first, errors say what it is, and a
TRL environment may own its data: rows with no prompt, the prompt from ``reset()`` (issue 36 item 2)."""

from __future__ import annotations

import json
import textwrap

import pytest

from maxent_grpo.cli import main
from maxent_grpo.envs.settings import EnvironmentConfig, row_environments
from maxent_grpo.envs.trl_compat import TRLEnvironment
from maxent_grpo.errors import ConfigError
from maxent_grpo.rewards.user_code import resolve_reference
from maxent_grpo.config.load import load_config
from maxent_grpo.training.metrics import read_metrics
from tiny_runs import read_jsonl, tiny_overrides

# TRL's environment_factory convention; the rows hold only `environment` and `target`.
COUNTER = textwrap.dedent('''
    class Counter:
        def __init__(self):
            self.ticks = 0

        def reset(self, **row):
            self.target = row["target"]
            return f"Call the tick tool {row['target']} times."

        def tick(self) -> str:
            """Add one to the counter."""
            self.ticks += 1
            return str(self.ticks)

        def get_reward(self) -> float:
            return -abs(self.ticks - self.target)
''')


def test_a_file_beside_the_config_wins_over_one_in_the_current_folder(tmp_path, monkeypatch):
    config_dir, cwd = tmp_path / "recipe", tmp_path / "cwd"
    for folder in (config_dir, cwd):
        folder.mkdir()
        (folder / "helpers.py").write_text("def f(prompts, completions, **kw):\n    return [0.0] * len(prompts)\n")
    monkeypatch.chdir(cwd)
    for name in ("helpers.py:f", "helpers:f"):
        assert resolve_reference(name, config_dir) == f"{(config_dir / 'helpers.py').resolve()}:f"
    assert resolve_reference("helpers.py:f", None) == f"{(cwd / 'helpers.py').resolve()}:f"
    assert resolve_reference("os.path:join", config_dir) == "os.path:join"  # not beside it: a module name


@pytest.mark.parametrize("env, message", [
    (EnvironmentConfig(classes={"counter": "nowhere.py:Counter"}),
     "environment.classes.counter: environment class 'nowhere.py:Counter': file "),
    (EnvironmentConfig(tools=["nowhere.py:lookup"]), "environment.tools[0]: tool 'nowhere.py:lookup': file "),
    (EnvironmentConfig(classes={"counter": "no_such_module_here:Counter"}),
     "environment.classes.counter: environment class 'no_such_module_here:Counter': no module"),
])
def test_errors_name_the_key_and_say_what_the_code_is(tmp_path, monkeypatch, env, message):
    monkeypatch.chdir(tmp_path)
    with pytest.raises(ConfigError) as err:
        row_environments(env, None)
    assert str(err.value).startswith(message)
    assert "reward function" not in str(err.value)


def test_a_row_without_a_prompt_opens_with_resets_text(tmp_path):
    namespace: dict = {}
    exec(COUNTER, namespace)
    env = TRLEnvironment(namespace["Counter"](), call_timeout_s=5.0)
    assert env.reset({"prompt": "", "target": 2, "environment": "counter"}) == [
        {"role": "user", "content": "Call the tick tool 2 times."}]
    assert env.reset({"prompt": "Hi.", "target": 1}) == [{"role": "user", "content": "Hi.Call the tick tool 1 times."}]

    class Silent:
        def reset(self, **row):
            return None

    with pytest.raises(ValueError, match="the row has no prompt and Silent.reset gave none"):
        TRLEnvironment(Silent(), call_timeout_s=5.0).reset({"prompt": "", "target": 1})


def test_rows_with_only_an_environment_column_train_from_another_folder(tmp_path, tiny_model_dir, monkeypatch):
    recipe = tmp_path / "recipe"
    recipe.mkdir()
    (recipe / "counter_env.py").write_text(COUNTER)
    (recipe / "rows.jsonl").write_text("".join(json.dumps({"environment": "counter", "target": i % 3}) + "\n"
                                               for i in range(8)))
    (recipe / "run.yaml").write_text("environment: {classes: {counter: counter_env:Counter}, max_turns: 2}\n")
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    monkeypatch.chdir(elsewhere)
    out = tmp_path / "out"
    args = tiny_overrides(tiny_model_dir, out, rewards="[{name: environment}]", source="rows.jsonl",
                          extra=["data.few_shot=[]", "data.instruction=null"])
    cfg = load_config(recipe / "run.yaml", [a for a in args if "=" in a])
    assert cfg.environment.classes == {"counter": f"{(recipe / 'counter_env.py').resolve()}:Counter"}
    assert main(["train", "--config", str(recipe / "run.yaml"), *args]) == 0
    rows = read_metrics(out / "metrics.jsonl")
    assert [r["step"] for r in rows] == [1, 2]
    assert all(r["rewards/environment/mean"] is not None and r["rewards/environment/mean"] <= 0 for r in rows)
    table = read_jsonl(out / "completions" / "step-1.jsonl")
    assert all("Call the tick tool" in json.dumps(row) for row in table)
