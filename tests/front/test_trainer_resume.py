"""``GRPOTrainer.train(resume_from_checkpoint=...)`` is the CLI's exact resume: a run continued from its
step-1 checkpoint logs the same step 2 as the run that went on; a folder holding a run is refused
without it (nothing overwritten unasked), and a run that failed to start can be started again."""

from __future__ import annotations

import json

import pytest

from maxent_grpo import GRPOConfig, GRPOTrainer
from maxent_grpo.errors import UserError

pytestmark = pytest.mark.slow

ROWS = [{"prompt": f"What is {a} + {b}?", "answer": str(a + b)} for a in range(4) for b in range(4)]


def correct(completions, answer, **kwargs):
    return [float(a in c) + 0.1 * len(c) for c, a in zip(completions, answer)]


def _trainer(model, out):
    from datasets import Dataset

    args = GRPOConfig(output_dir=str(out), max_steps=2, save_steps=1, per_device_train_batch_size=8,
                      num_generations=4, max_completion_length=8, learning_rate=1e-3, report_to="none",
                      bf16=False, disable_tqdm=True, seed=5)
    return GRPOTrainer(model=str(model), reward_funcs=correct, args=args, train_dataset=Dataset.from_list(ROWS))


def _steps(out) -> list[dict]:
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]


def test_resume_from_a_checkpoint_continues_exactly(tiny_model_dir, tmp_path):
    out = tmp_path / "run"
    _trainer(tiny_model_dir, out).train()
    straight = _steps(out)
    with pytest.raises(UserError, match="--resume|resume"):
        _trainer(tiny_model_dir, out).train()  # the folder holds a run: refused, not overwritten
    assert _steps(out) == straight
    trainer = _trainer(tiny_model_dir, out)
    result = trainer.train(resume_from_checkpoint=str(out / "checkpoints" / "step-1"))
    assert result.global_step == 2
    resumed = _steps(out)
    assert [r["step"] for r in resumed] == [1, 2]
    for key in ("reward", "loss", "grad_norm", "prompt_ids_hash"):
        assert resumed[1][key] == pytest.approx(straight[1][key], rel=1e-6, abs=1e-9), key
    assert [h["step"] for h in trainer.state.log_history] == [2, 2]  # the resumed step, then the totals
