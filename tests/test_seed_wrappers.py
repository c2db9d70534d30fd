"""The seed page's batch-level names in maxent_grpo.rewards.maxent, on real parts."""

import math

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from maxent_grpo.rewards.maxent import compute_reward_totals, prepare_generation_batch
from maxent_grpo.rewards.registry import build_reward_spec
from maxent_grpo.rollout.backend import SamplingParams
from maxent_grpo.rollout.hf import HFGenerationBackend


def half_or_none(prompts, completions, **kwargs):
    return [None if i % 2 else 0.5 for i in range(len(completions))]


def test_compute_reward_totals_weights_and_skips_none():
    spec = build_reward_spec([
        {"name": "boxed_accuracy", "weight": 2.0},
        {"name": f"{__name__}:half_or_none", "weight": 3.0},
    ])
    completions = ["so \\boxed{4}", "\\boxed{5}", "no answer", "\\boxed{4}"]
    totals, per_fn = compute_reward_totals(spec, ["p"] * 4, completions, {"answer": ["4"] * 4})
    assert per_fn.shape == (4, 2) and math.isnan(float(per_fn[1, 1]))
    assert torch.allclose(totals, torch.tensor([2 * 1 + 3 * 0.5, 0.0, 3 * 0.5, 2.0], dtype=totals.dtype))


def test_prepare_generation_batch_counts_nothing_dropped(tiny_model_dir):
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir)
    tok = AutoTokenizer.from_pretrained(tiny_model_dir)
    stats: dict[str, int] = {}
    torch.manual_seed(0)
    batch = prepare_generation_batch(["a", "b"], HFGenerationBackend(model, tok), stats, 3, SamplingParams(max_new_tokens=4))
    assert batch is not None and batch.num_completions == 6 and stats["dropped_prompts"] == 0
