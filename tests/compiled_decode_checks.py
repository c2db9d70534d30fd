"""The checks of compiled decoding, on any device: the CPU suite runs them on the CPU
(tests/rollout/test_compiled_decode.py), the GPU tier on CUDA, where each step replays a CUDA graph
(tests/gpu/test_cuda.py)."""

from __future__ import annotations

from collections import Counter

import pytest
import torch

from maxent_grpo.core.logprobs import get_per_token_logps
from maxent_grpo.models import load_model_and_tokenizer
from maxent_grpo.rollout.backend import SamplingParams, build_rollout_batch, pack_rollout
from maxent_grpo.rollout.hf import HFGenerationBackend

QUESTIONS = ["What is 3 + 4?", "Hi", "What is 12 + 9? Answer with a number."]


def chat(tok, questions):
    return [tok.apply_chat_template([{"role": "user", "content": q}], tokenize=False, add_generation_prompt=True)
            for q in questions]


def completions(groups):
    return [c for g in groups for c in g.completions]


def compiled_draws_what_the_eager_loop_draws(model, tok, shrink: bool) -> set[tuple[int, int]]:
    """Same seed, so the same uniforms: the same tokens, finish reasons and log-probs (to float rounding)
    as the eager loop, over calls of three batch sizes and two cache lengths, rows ending at different
    steps (more eos ids, ones the model samples often), and every warper. Returns the (batch, cache
    length) of every graph the calls used."""
    prompts = chat(tok, QUESTIONS)
    free = HFGenerationBackend(model, tok, seed=0).generate(prompts, 2, SamplingParams(max_new_tokens=20))
    markers = [t for t, _ in Counter(t for c in completions(free) for t in set(c.token_ids)).most_common(3)]
    calls = [  # 3 rows (batch 4, cache 64), 6 rows (batch 8, cache 64), 9 rows (batch 16, cache 128)
        (prompts, 1, SamplingParams(max_new_tokens=8)),
        (prompts, 2, SamplingParams(max_new_tokens=20)),
        (chat(tok, QUESTIONS[::-1]), 3, SamplingParams(max_new_tokens=60, temperature=0.8, top_k=40, top_p=0.9)),
    ]
    original = model.generation_config.eos_token_id
    model.generation_config.eos_token_id = [tok.eos_token_id, *markers]
    try:
        eager = HFGenerationBackend(model, tok, seed=0)
        graphs = HFGenerationBackend(model, tok, seed=0, compile=True, shrink=shrink)
        ended = []
        for call in calls:
            a, b = completions(eager.generate(*call)), completions(graphs.generate(*call))
            ended += [(len(c.token_ids), c.finish_reason) for c in a]
            assert [c.token_ids for c in b] == [c.token_ids for c in a]
            assert [c.finish_reason for c in b] == [c.finish_reason for c in a]
            for x, y in zip(a, b):
                assert y.logps == pytest.approx(x.logps, abs=1e-5)
        assert len({n for n, _ in ended}) > 4 and "stop" in {reason for _, reason in ended}  # rows end apart
    finally:
        model.generation_config.eos_token_id = original
    # 3 rows to 60 tokens: batch 4 with a cache of 128 (a graph of batch 4 and cache 64 exists)
    call = (prompts, 1, SamplingParams(max_new_tokens=60))
    a, b = completions(eager.generate(*call)), completions(graphs.generate(*call))
    assert [c.token_ids for c in b] == [c.token_ids for c in a] and max(len(c.token_ids) for c in a) == 60
    keys = {(k.batch, k.cache_len) for k in graphs.graphs.graphs}
    assert {(4, 64), (8, 64), (16, 128), (4, 128)} <= keys
    assert all(k.dtype == model.dtype and k.device == model.device for k in graphs.graphs.graphs)
    return keys


def compiled_sampler_follows_the_weights(model_dir, copy: torch.dtype | None, device: str, bound: float) -> list[float]:
    """Five AdamW steps that move the policy far: after each, the compiled sampler's log-probs equal the
    trainer's recomputation within ``bound`` (a graph over stale weights, or a copy not refreshed, differs
    by far more). With ``copy``, ``sync_weights`` refreshes the sampling copy after each step. Returns
    the largest gap of each step."""
    model, tok = load_model_and_tokenizer(model_dir)
    model = model.to(device)
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-2)
    backend = HFGenerationBackend(model, tok, seed=3, dtype=copy, compile=True)
    prompts = chat(tok, QUESTIONS)
    params = SamplingParams(max_new_tokens=12)
    generator = torch.Generator().manual_seed(0)
    first, gaps = None, []
    for _ in range(5):
        batch = pack_rollout(build_rollout_batch(backend.generate(prompts, 2, params), 2), tok.pad_token_id)
        ids, mask = batch.input_ids.to(device), batch.attention_mask.to(device)
        logps = get_per_token_logps(model, ids, mask, batch.prompt_length)
        completion = batch.completion_mask.to(device)
        gaps.append(float(((batch.behaviour_logps.to(device) - logps.detach()) * completion).abs().max()))
        if first is None:
            first = (ids, mask, batch.prompt_length, completion, logps.detach())
        advantages = torch.randn(completion.shape[0], 1, generator=generator).to(device)
        loss = -(advantages * logps * completion).sum() / completion.sum()
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        backend.sync_weights(model)
    assert max(gaps) < bound, gaps
    ids, mask, prompt_length, completion, before = first
    with torch.no_grad():
        after = get_per_token_logps(model, ids, mask, prompt_length)
    assert float(((after - before) * completion).abs().max()) > 0.5  # the weights moved far
    return gaps
