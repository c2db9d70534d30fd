"""``maxent_grpo.train`` with objects where the command line takes names: a loaded model (plain and
peft-wrapped) trained in place, lambdas, closures, bound and async reward functions, in-memory datasets
(a list of rows, an IterableDataset, a held-out eval_dataset), and a transformers callback."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

import pytest
import torch

import maxent_grpo
from maxent_grpo.errors import UserError

pytestmark = pytest.mark.slow  # whole tiny runs, in process

ROWS = [{"prompt": f"What is {a} + {b}?", "answer": str(a + b), "a": a} for a in range(6) for b in range(4)]


def _config(out: Path, steps: int = 2, **sections) -> dict:
    config = {
        "model": {"dtype": "float32"},
        "generation": {"num_generations": 4, "max_new_tokens": 8, "dtype": None},
        "training": {"max_steps": steps, "prompts_per_step": 2, "micro_batch_size": 4, "autocast_bf16": False,
                     "learning_rate": 1e-3},
        "logging": {"output_dir": str(out), "progress_bar": False},
    }
    for section, values in sections.items():
        config.setdefault(section, {}).update(values)
    return config


def _load(tiny_model_dir):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    return AutoModelForCausalLM.from_pretrained(tiny_model_dir), AutoTokenizer.from_pretrained(tiny_model_dir)


class Judge:
    """A reward held by an object (a bound method), with state the test reads back."""

    def __init__(self):
        self.calls = 0

    def score(self, completions, a, **kwargs):
        self.calls += 1
        return [float(len(c) % 3 == x % 3) for c, x in zip(completions, a)]


def test_objects_train_a_loaded_model_in_place(tiny_model_dir, tmp_path):
    from transformers import TrainerCallback

    model, tokenizer = _load(tiny_model_dir)
    start = {n: p.detach().clone() for n, p in model.named_parameters()}
    vocab = len(tokenizer)

    def closure_reward(completions, **kwargs):  # closes over the tokenizer, as TRL users write them
        return [len(tokenizer(c)["input_ids"]) / vocab for c in completions]

    async def async_reward(completions, **kwargs):
        await asyncio.sleep(0)
        return [0.5] * len(completions)

    judge, seen = Judge(), []

    class Recorder(TrainerCallback):
        def on_log(self, args, state, control, logs=None, **kwargs):
            seen.append((state.global_step, logs["reward"]))

    out = tmp_path / "run"
    summary = maxent_grpo.train(
        _config(out, eval={"every_steps": 2, "num_prompts": 2, "k": 2}), model=model, processing_class=tokenizer,
        reward_funcs=[lambda completions, **kw: [1.0 if "1" in c else 0.0 for c in completions], closure_reward,
                      judge.score, async_reward, "format"],
        train_dataset=ROWS[:20], eval_dataset=ROWS[20:], callbacks=[Recorder()],
    )
    assert summary.steps == 2 and summary.checkpoint is not None
    assert judge.calls >= 2
    assert [s for s, _ in seen] == [1, 2]
    assert [r for _, r in seen] == pytest.approx([m["reward"] for m in summary.metrics])
    names = {k for k in summary.metrics[0] if k.startswith("rewards/") and k.endswith("/mean")}
    assert names == {f"rewards/{n}/mean" for n in ("lambda", "closure_reward", "score", "async_reward", "format")}
    assert "eval/pass@2" in summary.metrics[1]  # the held-out rows, at eval.every_steps
    # Trained in place: the caller's object holds the new weights (those of the final checkpoint).
    moved = [n for n, p in model.named_parameters() if not torch.equal(p, start[n])]
    assert moved
    from safetensors.torch import load_file

    saved = load_file(summary.checkpoint / "model.safetensors")
    name = next(n for n in moved if n in saved)
    assert torch.equal(saved[name], dict(model.named_parameters())[name].detach())
    config = (out / "config.yaml").read_text()
    assert "name_or_path: python:LlamaForCausalLM" in config and "name: python:closure_reward" in config
    assert "name: format" in config  # a name, as the config takes it


def test_a_peft_model_object_trains_its_adapters_only(tiny_model_dir, tmp_path):
    from peft import LoraConfig, get_peft_model

    base, tokenizer = _load(tiny_model_dir)
    model = get_peft_model(base, LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"],
                                            task_type="CAUSAL_LM"))
    start = {n: p.detach().clone() for n, p in model.named_parameters()}
    summary = maxent_grpo.train(
        _config(tmp_path / "run", loss={"beta": 0.04}), model=model, processing_class=tokenizer,
        reward_funcs=lambda completions, **kw: [float(len(c)) for c in completions], train_dataset=ROWS,
    )
    assert summary.steps == 2
    changed = {n for n, p in model.named_parameters() if not torch.equal(p, start[n])}
    assert changed and all("lora_B" in n or "lora_A" in n for n in changed)
    assert (summary.checkpoint / "adapter_config.json").is_file()
    assert "kl" in summary.metrics[0]  # the reference is the base with its adapters off
    config = (tmp_path / "run" / "config.yaml").read_text()
    assert "enabled: true" in config and "r: 4" in config


def test_a_float32_head_over_a_peft_wrapped_head_is_one_line(tiny_model_dir, tmp_path):
    from peft import LoraConfig, get_peft_model

    base, tokenizer = _load(tiny_model_dir)
    model = get_peft_model(base, LoraConfig(r=4, target_modules=["q_proj", "lm_head"], task_type="CAUSAL_LM"))
    # The adapter's config is read with the model (model.lora.target_modules), so the rule refuses it before training.
    with pytest.raises(UserError, match=r"^model.lm_head_fp32: the float32 head cannot be a LoRA-wrapped head"):
        maxent_grpo.train(_config(tmp_path / "run", model={"lm_head_fp32": True}), model=model,
                          processing_class=tokenizer, reward_funcs=lambda completions, **kw: [0.0] * len(completions),
                          train_dataset=ROWS)


def test_an_iterable_dataset_is_read_as_far_as_the_run_goes(tiny_model_dir, tmp_path):
    from datasets import Dataset

    stream = Dataset.from_list(ROWS).to_iterable_dataset()
    summary = maxent_grpo.train(
        _config(tmp_path / "run", steps=3), model=str(tiny_model_dir),
        reward_funcs=lambda completions, answer, **kw: [float(a in c) for c, a in zip(completions, answer)],
        train_dataset=stream,
    )
    assert summary.steps == 3
    # 3 steps x 2 prompts: the first 6 rows of the stream are the whole training table.
    drawn = {json.loads(line)["prompt"] for f in sorted((tmp_path / "run" / "completions").glob("*.jsonl"))
             for line in f.read_text().splitlines()}
    first = {r["prompt"] for r in ROWS[:6]}
    assert drawn and all(any(f"user\n{q}<" in text for q in first) for text in drawn)


# ------------------------------------------------------------------ bad input, one line each


def _raises(match: str, **kwargs):
    with pytest.raises(UserError, match=match) as info:
        maxent_grpo.train(**kwargs)
    assert "\n" not in str(info.value)
    return info.value


def test_bad_input_is_named_before_the_model_loads(tiny_model_dir, tmp_path):
    ok = dict(reward_funcs=lambda completions, **kw: [0.0] * len(completions))
    # No model folder exists here: each error below must come before the model is read.
    cfg = _config(tmp_path / "a")
    _raises(r"train_dataset: no prompt column 'prompt'; columns: \['question'\]",
            config=cfg, model=str(tmp_path / "no-model"), train_dataset=[{"question": "hi"}], **ok)
    _raises(r"train_dataset: expected a datasets.Dataset", config=cfg, model=str(tmp_path / "no-model"),
            train_dataset="prompts.jsonl", **ok)
    _raises(r"train_dataset: empty prompt in row 1", config=_config(tmp_path / "b"), model=str(tmp_path / "no-model"),
            train_dataset=[{"prompt": "a"}, {"prompt": " "}], **ok)
    _raises(r"reward_funcs\[0\]: expected a function", config=_config(tmp_path / "c"), model=str(tiny_model_dir),
            train_dataset=ROWS, reward_funcs=[3])
    with torch.device("meta"):
        from transformers import AutoConfig, AutoModelForCausalLM

        meta = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(tiny_model_dir))
    _raises(r"model: the LlamaForCausalLM object's weights are on the meta device", config=_config(tmp_path / "d"),
            model=meta, processing_class=_load(tiny_model_dir)[1], train_dataset=ROWS, **ok)
    _raises(r"model: the LlamaForCausalLM object's weights are float16", config=_config(tmp_path / "e"),
            model=_load(tiny_model_dir)[0].half(), processing_class=_load(tiny_model_dir)[1], train_dataset=ROWS, **ok)
    _raises(r"training.strategy: fsdp2 builds the model on the meta device",
            config=_config(tmp_path / "f", training={"strategy": "fsdp2"}), model=_load(tiny_model_dir)[0],
            processing_class=_load(tiny_model_dir)[1], train_dataset=ROWS, **ok)
    _raises(r"data.eval_size: 4 holds rows out .* and an eval_dataset is given",
            config=_config(tmp_path / "g", data={"eval_size": 4}), model=str(tiny_model_dir), train_dataset=ROWS,
            eval_dataset=ROWS[:2], **ok)
    for run in "abcdefg":
        assert not (tmp_path / run / "checkpoints").exists()


@pytest.mark.parametrize("reward, line", [
    (lambda completions, **kw: [1.0] * (len(completions) - 1),
     r"reward function 'lambda': returned 7 values for 8 completions"),
    (lambda completions, **kw: ["good"] * len(completions),
     r"reward function 'lambda': row 0: returned 'good' \(str\), not a number"),
])
def test_a_bad_reward_is_named_at_the_first_batch(tiny_model_dir, tmp_path, reward, line):
    err = _raises(line, config=_config(tmp_path / "run", training={"max_consecutive_skips": 1}),
                  model=str(tiny_model_dir), reward_funcs=reward, train_dataset=ROWS)
    assert "step 0" in str(err)
