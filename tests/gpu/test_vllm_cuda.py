"""The vLLM part of the GPU tier: a colocated engine on CUDA, with and without sleep mode.

Needs a CUDA device and vLLM's CUDA wheel (``pip install 'maxent-grpo[vllm]'``); skipped
elsewhere. This project's GPU machine has no vLLM, so these tests are for users' GPU
machines: ``pytest -m gpu tests/gpu/test_vllm_cuda.py``. On the CPU,
tests/rollout/test_vllm_sleep.py checks the same wake / sleep sequence against a stand-in
(vLLM's sleep mode does not run on its CPU build) and tests/rollout/test_vllm.py the pushes.
"""

from __future__ import annotations

import importlib.util

import pytest
import torch

from maxent_grpo.rollout.backend import SamplingParams
from maxent_grpo.rollout.settings import VllmConfig
from maxent_grpo.rollout.vllm_colocate import VLLMColocateBackend  # imports vllm only when an engine is built

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device here: the GPU tier runs on a GPU machine"),
    pytest.mark.skipif(importlib.util.find_spec("vllm") is None, reason="vLLM's CUDA wheel is not installed here"),
]

GREEDY = SamplingParams(max_new_tokens=24, do_sample=False)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    from benchmarks.tiny_model import build_tiny_model

    return build_tiny_model(tmp_path_factory.mktemp("tiny-vllm-cuda"), hidden_size=128, num_heads=2)


def _policy(model_dir):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).cuda()


def _engine(model_dir, sleep_mode: bool):
    """(the fp32 policy on the GPU, an fp32 engine on the same weights, three chat prompts)."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    engine = VLLMColocateBackend(model_dir, tokenizer, model_dtype=torch.float32, options=VllmConfig(
        enable_sleep_mode=sleep_mode, gpu_memory_utilization=0.2, max_model_len=512))
    return _policy(model_dir), engine, _prompts(tokenizer)


def _prompts(tokenizer):
    return [
        tokenizer.apply_chat_template([{"role": "user", "content": q}], tokenize=False, add_generation_prompt=True)
        for q in ("What is 3 + 4?", "What is 10 + 2?", "Name a prime number.")
    ]


def _greedy(engine, prompts):
    groups = engine.generate(prompts, 1, GREEDY)
    return [(g.completions[0].token_ids, g.completions[0].logps) for g in groups]


@pytest.mark.parametrize("sleep_mode", [False, True])
def test_a_no_op_push_changes_nothing(model_dir, sleep_mode):
    """Greedy outputs and their log-probs are identical before and after pushing the unchanged weights
    (through the wake / push / sleep sequence with sleep mode); a phase after a level-2 sleep with no
    push since pushes the policy itself and samples the same."""
    policy, engine, prompts = _engine(model_dir, sleep_mode)
    with engine.rollout_phase(policy):
        before = _greedy(engine, prompts)
    engine.sync_weights(policy)
    with engine.rollout_phase(policy):
        after = _greedy(engine, prompts)
        again = _greedy(engine, prompts)  # a second generate call inside the same phase
    with engine.rollout_phase(policy):  # no push since the last phase: with sleep mode, pushed here
        third = _greedy(engine, prompts)
    for out in (after, again, third):
        assert [ids for ids, _ in out] == [ids for ids, _ in before]
        assert all(lp_a == pytest.approx(lp_b, abs=1e-6) for (_, lp_a), (_, lp_b) in zip(out, before))


def test_sleep_frees_the_engine_memory_and_the_phase_gets_it_back(model_dir):
    """After a rollout phase the engine's weights and KV cache are released (level 2): free device memory
    rises by at least the KV cache the engine reserved; the next phase samples as before."""
    policy, engine, prompts = _engine(model_dir, True)
    with engine.rollout_phase(policy):
        first = _greedy(engine, prompts)
        free_awake = torch.cuda.mem_get_info()[0]
    free_asleep = torch.cuda.mem_get_info()[0]
    total = torch.cuda.mem_get_info()[1]
    # The engine reserves about gpu_memory_utilization of the device, nearly all of it KV cache.
    assert free_asleep - free_awake > 0.1 * total
    engine.sync_weights(policy)
    with engine.rollout_phase(policy):
        assert [ids for ids, _ in _greedy(engine, prompts)] == [ids for ids, _ in first]
