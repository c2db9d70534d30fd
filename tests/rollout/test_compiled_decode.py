"""Compiled decoding (static KV cache, compiled one-token step) on the CPU, where the step is inductor's
code: the eager loop's draws, and the weights of every optimizer step and every refresh of a generation
copy (tests/compiled_decode_checks.py; the GPU tier runs the same checks on CUDA graphs)."""

from __future__ import annotations

import logging
import re

import pytest
import torch

from compiled_decode_checks import compiled_draws_what_the_eager_loop_draws, compiled_sampler_follows_the_weights
from maxent_grpo.cli import main
from maxent_grpo.models import load_model_and_tokenizer
from maxent_grpo.rollout.compiled_decode import batch_bucket, cache_bucket
from maxent_grpo.training.metrics import read_metrics
from tiny_runs import tiny_overrides


@pytest.fixture(scope="module")
def tiny(tiny_model_dir):
    model, tokenizer = load_model_and_tokenizer(tiny_model_dir)
    return model.requires_grad_(False), tokenizer


def test_buckets():
    assert [batch_bucket(n) for n in (1, 2, 3, 8, 9, 64, 65)] == [1, 2, 4, 8, 16, 64, 128]
    assert [cache_bucket(n) for n in (1, 64, 65, 424)] == [64, 64, 128, 512]


@pytest.mark.parametrize("shrink", [False, True], ids=["fixed-batch", "shrink"])
def test_compiled_draws_what_the_eager_loop_draws(tiny, shrink):
    keys = compiled_draws_what_the_eager_loop_draws(*tiny, shrink)
    # shrink: the rows still going moved to smaller batches; else one graph per call shape
    assert (len(keys) > 4) is shrink


@pytest.mark.parametrize("copy", [None, torch.float64], ids=["policy-itself", "float64-copy"])
def test_compiled_sampler_follows_the_weights_through_optimizer_steps(tiny_model_dir, copy):
    """float32 rounding: the policy samples itself, or a float64 copy refreshed after each step."""
    compiled_sampler_follows_the_weights(tiny_model_dir, copy, "cpu", bound=1e-4)


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
