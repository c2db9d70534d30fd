"""One TRL script, run through TRL and through this library with only the import changed: the same seed,
the same batches (each side's sampler replaced by the same completions, as benchmarks/update_parity.py
does), and the same optimizer steps: the last step's loss, and its clipped gradients to the tolerance of the
update-parity check (tests/test_trl_update_parity.py). Here the whole front door is under test: TRL's
GRPOConfig fields (beta and use_bias_correction_kl among them), a model object, a conversational dataset,
a reward function reading a column."""

from __future__ import annotations

import copy
import sys
import types
from pathlib import Path
from unittest import mock

import pytest

pytest.importorskip("trl")
sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # benchmarks/ is not part of the package

from benchmarks.update_parity import (  # noqa: E402
    GENERATIONS, MAX_NEW_TOKENS, PROMPTS, _flat, _optimizer_probe, make_rollouts,
)

pytestmark = pytest.mark.slow


def trl_script(lib: types.ModuleType, model, tokenizer, rollouts, out_dir: Path, loss_type: str, beta: float,
               bias_correction_kl: bool, steps: int):
    """The script both libraries run: written against TRL's API, ``lib`` is ``trl`` or ``maxent_grpo``."""
    from datasets import Dataset

    reward_of = {tuple(ids): r for ids, r in zip(rollouts.completion_ids, rollouts.rewards)}

    def fixed_reward(completions, completion_ids, **kwargs):
        return [reward_of[tuple(ids)] for ids in completion_ids]

    args = lib.GRPOConfig(
        output_dir=str(out_dir), use_cpu=True, report_to="none", bf16=False, disable_tqdm=True, seed=0,
        per_device_train_batch_size=GENERATIONS, gradient_accumulation_steps=PROMPTS, num_generations=GENERATIONS,
        max_completion_length=MAX_NEW_TOKENS, loss_type=loss_type, beta=beta, use_bias_correction_kl=bias_correction_kl,
        learning_rate=1e-3, lr_scheduler_type="constant", max_grad_norm=0.05, max_steps=steps, gradient_checkpointing=False,
        shuffle_dataset=False, save_strategy="no", logging_steps=1,
    )
    dataset = Dataset.from_list([{"prompt": m} for m in rollouts.messages])
    return lib.GRPOTrainer(model=model, reward_funcs=fixed_reward, args=args, train_dataset=dataset,
                           processing_class=tokenizer)


def _through_trl(model, tokenizer, rollouts, out_dir, *case):
    import trl
    import trl.trainer.grpo_trainer as grpo_module

    by_prompt = {tuple(ids): p for p, ids in enumerate(rollouts.prompt_ids)}

    def fixed_generation(prompt_ids, images, multimodal_fields, num_generations, has_tool_images=False):
        taken, out = [0] * PROMPTS, []
        for ids in prompt_ids:
            p = by_prompt[tuple(ids)]
            out.append(rollouts.completion_ids[p * GENERATIONS + taken[p]])
            taken[p] += 1
        return out, None

    trainer = trl_script(trl, model, tokenizer, rollouts, out_dir, *case)
    trainer._generate_single_turn = fixed_generation
    seen = {}
    # TRL shuffles a generation batch's rows before cutting micro-batches; ours keeps the groups in order.
    with _optimizer_probe(model, seen), mock.patch.object(grpo_module, "shuffle_sequence_dict", lambda batch: batch):
        trainer.train()
    loss = [entry["loss"] for entry in trainer.state.log_history if "loss" in entry][-1]
    return _flat(model, seen["grads"]), loss


def _through_ours(model, tokenizer, rollouts, out_dir, *case):
    import maxent_grpo
    from maxent_grpo.rollout.backend import Completion
    from maxent_grpo.rollout.hf import HFGenerationBackend

    by_prompt = {tuple(ids): p for p, ids in enumerate(rollouts.prompt_ids)}
    taken = [0] * PROMPTS

    def fixed_chunk(self, prompt_ids, params):
        out = []
        for ids in prompt_ids:
            p = by_prompt[tuple(ids)]  # a KeyError: the prompt was formatted differently from TRL's
            completion = rollouts.completion_ids[p * GENERATIONS + taken[p] % GENERATIONS]
            taken[p] += 1
            cut = len(completion) == MAX_NEW_TOKENS and completion[-1] != tokenizer.eos_token_id
            out.append(Completion(completion, tokenizer.decode(completion), "length" if cut else "stop"))
        return out

    trainer = trl_script(maxent_grpo, model, tokenizer, rollouts, out_dir, *case)
    seen = {}
    with _optimizer_probe(model, seen), mock.patch.object(HFGenerationBackend, "_generate_chunk", fixed_chunk):
        trainer.train()
    steps = case[-1]
    assert taken == [GENERATIONS * steps] * PROMPTS  # every completion of the batch, once a step
    loss = [entry["loss"] for entry in trainer.state.log_history if "loss" in entry][-1]
    return _flat(model, seen["grads"]), loss


CASES = [
    ("dapo", 0.0, True, 1), ("grpo", 0.0, True, 1), ("dr_grpo", 0.0, True, 1),
    # beta 0.04: the reference is the start model, so the KL and its gradient are 0 at step 1; at step 2
    # TRL's default importance-weighted term (ALGORITHMS.md §19) and the plain one part.
    ("dapo", 0.04, True, 2), ("dapo", 0.04, False, 2),
]


@pytest.mark.parametrize("case", CASES, ids=[f"{c[0]}-beta{c[1]}-bias_correction_kl={c[2]}-{c[3]}step" for c in CASES])
def test_the_same_script_takes_the_same_steps(tiny_model_dir, tmp_path, case):
    from maxent_grpo.models import load_model_and_tokenizer

    model, tokenizer = load_model_and_tokenizer(tiny_model_dir, dtype="float32")
    twin = copy.deepcopy(model)
    rollouts = make_rollouts(tokenizer)
    grads_trl, loss_trl = _through_trl(model, tokenizer, rollouts, tmp_path / "trl", *case)
    grads_ours, loss_ours = _through_ours(twin, tokenizer, rollouts, tmp_path / "ours", *case)
    assert grads_trl.norm() > 0
    assert float((grads_ours - grads_trl).norm() / grads_trl.norm()) < 2e-6
    assert loss_ours == pytest.approx(loss_trl, rel=1e-5, abs=1e-7)


def test_the_kl_flag_changes_the_second_step(tiny_model_dir, tmp_path):
    # The two KL terms differ at step 2 by more than the parity tolerance: the parity above tells them apart.
    from maxent_grpo.models import load_model_and_tokenizer

    model, tokenizer = load_model_and_tokenizer(tiny_model_dir, dtype="float32")
    rollouts = make_rollouts(tokenizer)
    weighted, _ = _through_ours(copy.deepcopy(model), tokenizer, rollouts, tmp_path / "a", "dapo", 0.04, True, 2)
    plain, _ = _through_ours(copy.deepcopy(model), tokenizer, rollouts, tmp_path / "b", "dapo", 0.04, False, 2)
    assert float((weighted - plain).norm() / plain.norm()) > 1e-4
