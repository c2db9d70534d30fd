"""``maxent_grpo.GRPOConfig`` is TRL's: its fields' names and defaults are the installed TRL's, and its values
compile to the plan ``--from-trl`` makes of a YAML file naming the same fields (one table, no drift)."""

from __future__ import annotations

import dataclasses

import pytest

from maxent_grpo import GRPOConfig, GRPOTrainer
from maxent_grpo.errors import ConfigError

ROWS = [{"prompt": f"What is {a} + 1?", "answer": str(a + 1)} for a in range(16)]


def reward(completions, **kwargs):
    return [0.0] * len(completions)


def _trl_defaults() -> dict:
    trl = pytest.importorskip("trl")
    out = {}
    for f in dataclasses.fields(trl.GRPOConfig):
        if f.default is not dataclasses.MISSING:
            out[f.name] = f.default
        elif f.default_factory is not dataclasses.MISSING:
            out[f.name] = f.default_factory()
    return out


def test_every_field_defaults_to_the_installed_trls():
    import transformers

    theirs = _trl_defaults()
    ours = GRPOConfig()
    shared = [f.name for f in dataclasses.fields(ours) if f.name in theirs]
    assert len(shared) > 120
    for name in shared:
        assert getattr(ours, name) == theirs[name] and type(getattr(ours, name)) is type(theirs[name]), name
    # Every field GRPOConfig adds to TrainingArguments is here: mapped, refused or ignored.
    base = {f.name for f in dataclasses.fields(transformers.TrainingArguments)}
    assert sorted(set(theirs) - base - {f.name for f in dataclasses.fields(ours)}) == []
    assert GRPOConfig("out").output_dir == "out"  # positional, as TRL's


def test_a_field_with_no_counterpart_is_one_line():
    with pytest.raises(ConfigError, match=r"^GRPOConfig.label_names: not a field of TRL's GRPOConfig that has a "):
        GRPOConfig(label_names=["x"])


def _plan_from_yaml(tmp_path, fields):
    import yaml

    from maxent_grpo.config.compile import compile_run
    from maxent_grpo.config.trl import load_trl_config
    from maxent_grpo.training.precision import Machine

    data = tmp_path / "rows.jsonl"
    data.write_text("".join(f'{{"prompt": "{r["prompt"]}", "answer": "{r["answer"]}"}}\n' for r in ROWS))
    path = tmp_path / "trl.yaml"
    path.write_text(yaml.safe_dump({**fields, "model_name_or_path": "m", "dataset_name": str(data),
                                    "reward_funcs": ["my_rewards.reward"]}))
    cfg, _ = load_trl_config(path)
    return compile_run(cfg, Machine.here())


FIELDS = dict(
    output_dir="out", loss_type="grpo", beta=0.04, use_bias_correction_kl=False, epsilon=0.25, epsilon_high=0.3,
    num_iterations=2, per_device_train_batch_size=8, gradient_accumulation_steps=2, num_generations=4,
    max_completion_length=64, temperature=0.7, top_p=0.9, learning_rate=3e-6, lr_scheduler_type="cosine",
    warmup_steps=2, weight_decay=0.01, max_grad_norm=0.5, max_steps=20, save_steps=10, seed=3,
    mask_truncated_completions=True, scale_rewards="batch", report_to="none",
)


def test_a_grpo_config_compiles_to_the_plan_of_the_same_yaml(tmp_path):
    trainer = GRPOTrainer(model="m", reward_funcs=reward, args=GRPOConfig(**FIELDS), train_dataset=ROWS)
    ours, yaml_plan = trainer.plan, _plan_from_yaml(tmp_path, FIELDS)
    for record in ("method", "batch", "optimizer", "schedule", "scoring", "sampler"):
        mine, theirs = getattr(ours, record), getattr(yaml_plan, record)
        if record == "method":
            mine, theirs = mine.loss, theirs.loss
        assert mine == theirs, record
    assert ours.num_iterations == 2 and ours.batch.prompts_per_step == 4 and ours.micro_batch_size == 8
    assert ours.seed == 3 and ours.max_grad_norm == 0.5
    assert ours.method.loss.beta == 0.04 and ours.method.loss.loss_type == "grpo"


def test_a_field_set_after_construction_counts():
    args = GRPOConfig(output_dir="out", max_steps=4, report_to="none")
    args.learning_rate = 2e-5
    args.num_generations = 4
    plan = GRPOTrainer(model="m", reward_funcs=reward, args=args, train_dataset=ROWS).plan
    assert plan.optimizer.learning_rate == 2e-5 and plan.batch.num_generations == 4
    assert plan.batch.prompts_per_step == 2  # per_device_train_batch_size 8 / num_generations 4


@pytest.mark.parametrize("fields, line", [
    (dict(loss_type="gfpo"), r"^loss_type: 'gfpo' has no counterpart here"),
    (dict(fp16=True), r"^fp16: True is refused: float16 training is not supported here"),
    (dict(learning_rate=-1.0), r"^learning_rate: -1.0 \(as training.learning_rate: must be >= 0\)"),
    (dict(per_device_train_batch_size=6), r"^per_device_train_batch_size: 6 x gradient_accumulation_steps 1"),
])
def test_a_refused_or_bad_field_is_named_when_the_trainer_is_made(fields, line):
    with pytest.raises(ConfigError, match=line):
        GRPOTrainer(model="m", reward_funcs=reward, args=GRPOConfig(output_dir="out", **fields), train_dataset=ROWS)


@pytest.mark.parametrize("kwargs, line", [
    (dict(optimizers=(object(), None)), r"^optimizers: a custom optimizer"),
    (dict(rollout_func=lambda prompts, trainer: {}), r"^rollout_func: a custom rollout is not taken here"),
    (dict(train_dataset=None), r"^train_dataset: required"),
    (dict(eval_dataset={"a": ROWS}), r"^eval_dataset: a dict of datasets is not supported here"),
    (dict(reward_funcs=None), r"^reward_funcs: no reward function"),
])
def test_trl_arguments_that_have_no_counterpart(kwargs, line):
    base = dict(model="m", reward_funcs=reward, args=GRPOConfig(output_dir="out"), train_dataset=ROWS)
    with pytest.raises(ConfigError, match=line):
        GRPOTrainer(**{**base, **kwargs})


def test_ignored_fields_say_why():
    trainer = GRPOTrainer(model="m", reward_funcs=reward, train_dataset=ROWS,
                          args=GRPOConfig(output_dir="out", logging_steps=5, torch_compile=True))
    assert [n.split(":")[0] for n in trainer.notes] == ["logging_steps", "torch_compile"]


def test_without_args_the_output_dir_is_trls(tmp_path):
    trainer = GRPOTrainer(model="org/Some-Model", reward_funcs=reward, train_dataset=ROWS)
    assert str(trainer.output_dir) == "Some-Model-GRPO"
    trainer = GRPOTrainer(model=tmp_path / "my-model", reward_funcs=reward, train_dataset=ROWS)  # a Path
    assert str(trainer.output_dir) == "my-model-GRPO"
    assert trainer.plan.model.name_or_path == str(tmp_path / "my-model")

