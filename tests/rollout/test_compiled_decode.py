"""Compiled decoding (static KV cache, compiled one-token step): the eager loop's draws, and the weights of
every optimizer step and every refresh of a generation copy. On the CPU the step is inductor's code (the
GPU tier runs the same on CUDA, where it is replayed as a CUDA graph)."""

from __future__ import annotations

import logging
import re
from collections import Counter

import pytest
import torch

from maxent_grpo.cli import main
from maxent_grpo.core.logprobs import get_per_token_logps
from maxent_grpo.models import load_model_and_tokenizer
from maxent_grpo.rollout.backend import SamplingParams, build_rollout_batch, pack_rollout
from maxent_grpo.rollout.compiled_decode import batch_bucket, cache_bucket
from maxent_grpo.rollout.hf import HFGenerationBackend
from maxent_grpo.training.metrics import read_metrics
from tiny_runs import tiny_overrides

QUESTIONS = ["What is 3 + 4?", "Hi", "What is 12 + 9? Answer with a number."]


@pytest.fixture(scope="module")
def tiny(tiny_model_dir):
    model, tokenizer = load_model_and_tokenizer(tiny_model_dir)
    return model.requires_grad_(False), tokenizer


def _chat(tok, questions):
    return [tok.apply_chat_template([{"role": "user", "content": q}], tokenize=False, add_generation_prompt=True)
            for q in questions]


def _completions(groups):
    return [c for g in groups for c in g.completions]


def test_buckets():
    assert [batch_bucket(n) for n in (1, 2, 3, 8, 9, 64, 65)] == [1, 2, 4, 8, 16, 64, 128]
    assert [cache_bucket(n) for n in (1, 64, 65, 424)] == [64, 64, 128, 512]


@pytest.mark.parametrize("shrink", [False, True], ids=["fixed-batch", "shrink"])
def test_compiled_draws_what_the_eager_loop_draws(tiny, shrink):
    """Same seed, so the same uniforms: the same tokens, finish reasons and log-probs (to float rounding)
    as the eager loop, over calls of three batch sizes and two cache lengths, rows ending at different steps
    (more eos ids, ones the model samples often), and every warper."""
    model, tok = tiny
    prompts = _chat(tok, QUESTIONS)
    free = HFGenerationBackend(model, tok, seed=0).generate(prompts, 2, SamplingParams(max_new_tokens=20))
    markers = [t for t, _ in Counter(t for c in _completions(free) for t in set(c.token_ids)).most_common(3)]
    calls = [  # (prompts, G, params): 3 rows (batch 4, cache 64), 6 rows (batch 8, cache 64), 9 rows (batch 16, cache 128)
        (prompts, 1, SamplingParams(max_new_tokens=8)),
        (prompts, 2, SamplingParams(max_new_tokens=20)),
        (_chat(tok, QUESTIONS[::-1]), 3, SamplingParams(max_new_tokens=60, temperature=0.8, top_k=40, top_p=0.9)),
    ]
    original = model.generation_config.eos_token_id
    model.generation_config.eos_token_id = [tok.eos_token_id, *markers]
    try:
        eager = HFGenerationBackend(model, tok, seed=0)
        graphs = HFGenerationBackend(model, tok, seed=0, compile=True, shrink=shrink)
        ended = []
        for call in calls:
            a, b = _completions(eager.generate(*call)), _completions(graphs.generate(*call))
            ended += [(len(c.token_ids), c.finish_reason) for c in a]
            assert [c.token_ids for c in b] == [c.token_ids for c in a]
            assert [c.finish_reason for c in b] == [c.finish_reason for c in a]
            for x, y in zip(a, b):
                assert y.logps == pytest.approx(x.logps, abs=1e-5)
        # rows end at different steps
        assert len({n for n, _ in ended}) > 4 and "stop" in {reason for _, reason in ended}
    finally:
        model.generation_config.eos_token_id = original
    # 3 rows to 60 tokens: batch 4 with a cache of 128 (a graph of batch 4 and cache 64 exists)
    call = (prompts, 1, SamplingParams(max_new_tokens=60))
    a, b = _completions(eager.generate(*call)), _completions(graphs.generate(*call))
    assert [c.token_ids for c in b] == [c.token_ids for c in a] and max(len(c.token_ids) for c in a) == 60
    keys = {(k.batch, k.cache_len) for k in graphs.graphs.graphs}
    assert {(4, 64), (8, 64), (16, 128), (4, 128)} <= keys
    # shrink: rows still going moved to smaller batches; else one graph per call shape
    assert (len(keys) > 4) is shrink
    assert all(k.dtype == torch.float32 and k.device.type == "cpu" for k in graphs.graphs.graphs)


@pytest.mark.parametrize("copy", [None, torch.float64], ids=["policy-itself", "float64-copy"])
def test_compiled_sampler_follows_the_weights_through_optimizer_steps(tiny_model_dir, copy):
    """Five AdamW steps that move the policy far: after each, the compiled sampler's log-probs equal the
    trainer's recomputation to float32 rounding (a graph over stale weights, or a copy not refreshed,
    differs by far more). With a float64 copy, ``sync_weights`` refreshes it after each step."""
    model, tok = load_model_and_tokenizer(tiny_model_dir)
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-2)
    backend = HFGenerationBackend(model, tok, seed=3, dtype=copy, compile=True)
    prompts = _chat(tok, QUESTIONS)
    params = SamplingParams(max_new_tokens=12)
    generator = torch.Generator().manual_seed(0)
    first, gaps = None, []
    for _ in range(5):
        batch = pack_rollout(build_rollout_batch(backend.generate(prompts, 2, params), 2), tok.pad_token_id)
        logps = get_per_token_logps(model, batch.input_ids, batch.attention_mask, batch.prompt_length)
        mask = batch.completion_mask
        gaps.append(float(((batch.behaviour_logps - logps.detach()) * mask).abs().max()))
        if first is None:
            first = (batch, logps.detach())
        advantages = torch.randn(mask.shape[0], 1, generator=generator)
        loss = -(advantages * logps * mask).sum() / mask.sum()
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        backend.sync_weights(model)
    assert max(gaps) < 1e-4, gaps
    batch, before = first
    with torch.no_grad():
        after = get_per_token_logps(model, batch.input_ids, batch.attention_mask, batch.prompt_length)
    assert float(((after - before) * batch.completion_mask).abs().max()) > 0.5  # the weights moved far


def test_training_run_with_compiled_decoding(tiny_model_dir, tmp_path, caplog):
    """``generation.compile: true`` on the CPU: the run logs each shape's first step, and the sampler/trainer
    log-prob gap stays at float32 rounding over every step of a run with a high learning rate."""
    out = tmp_path / "run"
    rewards = "[{name: boxed_accuracy}, {name: length, kwargs: {max_length: 100}}]"
    with caplog.at_level(logging.INFO, logger="maxent_grpo"):
        assert main(["train", *tiny_overrides(tiny_model_dir, out, rewards=rewards, steps=4, extra=[
            "generation.compile=true", "loss.rollout_correction=token_truncate", "training.learning_rate=1e-2"])]) == 0
    assert "sampling: hf (compiled decoding)" in caplog.text
    assert re.search(r"compiled decoding: batch 8 x cache \d+ \(float32, cpu\): first step, compiling included, "
                     r"[\d.]+ s", caplog.text)
    rows = read_metrics(out / "metrics.jsonl")
    assert len(rows) == 4 and all(r["sampling/sampling_logp_difference/max"] < 1e-4 for r in rows)
