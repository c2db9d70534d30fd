"""Fixtures of the vLLM backend tests."""

from __future__ import annotations

import pytest


@pytest.fixture(scope="module")
def vllm_model_dir(tmp_path_factory):
    """A tiny model whose head size vLLM's CPU attention supports."""
    from benchmarks.tiny_model import build_tiny_model

    return build_tiny_model(tmp_path_factory.mktemp("tiny-vllm"), hidden_size=128, num_heads=2)
