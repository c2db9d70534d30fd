"""The same TRL-style reward functions give the same rewards under TRL's GRPOTrainer and ours, on the
same prompts and completions: dataset columns repeated per completion, conversational completions,
``completion_ids``, ``trainer_state`` (reward shaping by training progress), ``log_extra`` and
``log_metric``, and ``None`` for a row a function does not apply to.

TRL's side is its own ``GRPOTrainer._calculate_rewards`` on a trainer built over the tiny model
(nothing is generated or trained); ours is ``grouped_reward_inputs`` then ``evaluate_rewards``,
which is what the pipeline calls for every batch.
"""

from __future__ import annotations

import pytest
import torch

from maxent_grpo.rewards.context import RewardContext, TrainerState
from maxent_grpo.rewards.registry import RewardSpec, evaluate_rewards, grouped_reward_inputs

trl = pytest.importorskip("trl")
datasets = pytest.importorskip("datasets")

G = 3
STEP, MAX_STEPS = 4, 10


def answer_in_completion(prompts, completions, answer, **kwargs):
    return [1.0 if a in c[0]["content"] else 0.0 for c, a in zip(completions, answer)]


def shaped_by_progress(completions, completion_ids, trainer_state, **kwargs):
    """Longer completions pay more as training goes on; reads the step TRL's state carries."""
    progress = trainer_state.global_step / trainer_state.max_steps
    return [progress * len(ids) / 10 for ids in completion_ids]


def only_for_tagged(prompts, completions, tag, log_extra, log_metric, **kwargs):
    """None where the row has no tag; logs a column and a metric as TRL documents."""
    log_extra("tag_seen", [t or "" for t in tag])
    log_metric("tagged_fraction", sum(t is not None for t in tag) / len(tag))
    return [None if t is None else float(len(c[0]["content"]) % 5) for c, t in zip(completions, tag)]


FUNCS = (answer_in_completion, shaped_by_progress, only_for_tagged)

ROWS = [
    {"prompt": [{"role": "user", "content": "What is 2 + 3?"}], "answer": "5", "tag": "easy"},
    {"prompt": [{"role": "user", "content": "What is 7 - 4?"}], "answer": "3", "tag": None},
]
TEXTS = ["The answer is 5.", "It is 6", "5", "3", "Seven minus four is 3, I think.", "4"]


def _ours(tokenizer):
    ids = [tokenizer(t, add_special_tokens=False).input_ids for t in TEXTS]
    prompts, completions, columns = grouped_reward_inputs(ROWS, TEXTS, ids, G)
    context = RewardContext(len(TEXTS), TrainerState(global_step=STEP, max_steps=MAX_STEPS, epoch=0.5))
    spec = RewardSpec(tuple(f.__name__ for f in FUNCS), FUNCS, (1.0,) * len(FUNCS), (None,) * len(FUNCS))
    return evaluate_rewards(spec, prompts, completions, columns, context), context


def _trls(tiny_model_dir, tmp_path, tokenizer):
    from transformers import AutoModelForCausalLM

    args = trl.GRPOConfig(output_dir=str(tmp_path / "trl"), use_cpu=True, report_to=[], bf16=False,
                          per_device_train_batch_size=G, num_generations=G, max_steps=MAX_STEPS, logging_steps=1,
                          save_strategy="no", disable_tqdm=True)
    trainer = trl.GRPOTrainer(model=AutoModelForCausalLM.from_pretrained(tiny_model_dir), reward_funcs=list(FUNCS),
                              args=args, processing_class=tokenizer,
                              train_dataset=datasets.Dataset.from_list(ROWS))
    trainer.state.global_step, trainer.state.max_steps = STEP, MAX_STEPS
    inputs = [dict(row) for row in ROWS for _ in range(G)]
    prompts = [row["prompt"] for row in inputs]
    completions = [[{"role": "assistant", "content": t}] for t in TEXTS]
    ids = [tokenizer(t, add_special_tokens=False).input_ids for t in TEXTS]
    return trainer._calculate_rewards(inputs, prompts, completions, ids).double().cpu(), trainer


def test_trl_reward_functions_score_the_same_under_trl_and_here(tiny_model_dir, tmp_path):
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)
    ours, context = _ours(tokenizer)
    theirs, trainer = _trls(tiny_model_dir, tmp_path, tokenizer)
    assert ours.shape == theirs.shape == (len(TEXTS), len(FUNCS))
    # TRL computes in float32 and writes NaN where a function returned None, as ours does.
    assert torch.equal(torch.isnan(ours), torch.isnan(theirs))
    assert torch.isnan(ours[G:, 2]).all() and not torch.isnan(ours[:G, 2]).any()
    torch.testing.assert_close(torch.nan_to_num(ours), torch.nan_to_num(theirs), rtol=0, atol=1e-6)
    assert ours[:, 1].abs().sum() > 0 and ours[:, 0].sum() == 4  # the checks above compared real values
    # What the functions logged reaches both sides the same way.
    assert context.extra_columns["tag_seen"] == list(trainer._pending_extra_logs["tag_seen"]) == ["easy"] * G + [""] * G
    assert context.metric_means() == {"tagged_fraction": 0.5}
    assert list(trainer._pending_metrics["tagged_fraction"]) == [0.5]
