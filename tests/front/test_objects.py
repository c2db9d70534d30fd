"""Objects become python: references in the config and values in the plan (front/objects.py,
config/python_objects.py); without the objects, such a reference is one line."""

from __future__ import annotations

import functools

import pytest

from maxent_grpo.config.schema import TrainConfig
from maxent_grpo.errors import ConfigError
from maxent_grpo.front.objects import Given
from maxent_grpo.front.train import compile_given
from maxent_grpo.rewards.registry import GivenReward, RewardEntry

ROWS = [{"prompt": f"What is {a} + 1?", "answer": str(a + 1)} for a in range(8)]


def scaled(completions, scale, **kwargs):
    return [scale * len(c) for c in completions]


class Scorer:
    def __call__(self, completions, **kwargs):
        return [0.0] * len(completions)


def _plan(config=None, **given):
    return compile_given(config, Given(**given), None, trl_conventions=False)


def test_rewards_are_carried_as_values_under_trls_names():
    funcs = [lambda completions, **kw: [0.0] * len(completions), lambda completions, **kw: [1.0] * len(completions),
             functools.partial(scaled, scale=2.0), Scorer(), "format"]
    plan = _plan(reward_funcs=funcs, train_dataset=ROWS)
    names = [entry.name for entry in plan.rewards]
    assert names == ["lambda", "lambda_2", "scaled", "Scorer", "format"]
    assert [type(e) for e in plan.rewards] == [GivenReward] * 4 + [RewardEntry]
    assert [e.func for e in plan.rewards[:4]] == funcs[:4]  # the objects themselves, not copies
    assert [r["name"] for r in plan.source["rewards"]] == [
        "python:lambda", "python:lambda_2", "python:scaled", "python:Scorer", "format"]


def test_given_rows_replace_the_default_tasks_example_and_generator_options():
    for config in (None, TrainConfig(), {"training": {"max_steps": 3}}):
        plan = _plan(config, train_dataset=ROWS)
        assert plan.data.given is ROWS and plan.data.source == "python:train_dataset"
        assert plan.batch.few_shot == () and plan.data.task_kwargs == {}


def test_a_dict_config_takes_sections_and_dotted_keys():
    plan = _plan({"loss": {"beta": 0.04}, "training.max_steps": 7, "method": "dr_grpo"}, train_dataset=ROWS)
    assert plan.method.loss.beta == 0.04 and plan.schedule.max_steps == 7 and plan.method.name == "dr_grpo"


@pytest.mark.parametrize("override, line", [
    ("rewards=[python:foo]", r"^rewards\[0\].name: 'python:foo' names a reward function given as a Python object"),
    ("data.source=python:train_dataset", r"^data.source: 'python:train_dataset' names a dataset given as"),
    ("model.name_or_path=python:LlamaForCausalLM", r"^model.name_or_path: 'python:LlamaForCausalLM' names a model"),
])
def test_a_python_reference_without_its_object_is_one_line(override, line):
    from tiny_runs import compiled

    with pytest.raises(ConfigError, match=line):
        compiled(overrides=[override])


def test_a_peft_lora_config_maps_onto_model_lora_or_is_refused():
    from peft import LoraConfig

    from maxent_grpo.front.objects import lora_keys

    keys = lora_keys(LoraConfig(r=8, lora_alpha=16, lora_dropout=0.1, target_modules=["v_proj", "q_proj"],
                                use_rslora=True), "peft_config")
    assert keys == {"model.lora.r": 8, "model.lora.alpha": 16, "model.lora.dropout": 0.1,
                    "model.lora.use_rslora": True, "model.lora.target_modules": ["q_proj", "v_proj"]}
    with pytest.raises(ConfigError, match=r"^peft_config: LoraConfig.use_dora=True has no counterpart here"):
        lora_keys(LoraConfig(use_dora=True), "peft_config")
    with pytest.raises(ConfigError, match=r"^peft_config: LoraConfig.modules_to_save=\['lm_head'\] has no"):
        lora_keys(LoraConfig(modules_to_save=["lm_head"]), "peft_config")
