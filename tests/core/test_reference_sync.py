"""The moving reference (core/reference_sync.py): TR-DPO's soft and hard update on a real tiny
model, in float64, against the formula."""

from __future__ import annotations

import copy

import pytest
import torch
from transformers import AutoModelForCausalLM

from maxent_grpo.core.reference_sync import due, mix_into_reference


def test_soft_and_hard_updates(tiny_model_dir):
    policy = AutoModelForCausalLM.from_pretrained(tiny_model_dir).to(torch.float64)
    reference = copy.deepcopy(policy)
    with torch.no_grad():
        for p in policy.parameters():
            p.add_(torch.randn_like(p))
    before = {n: p.detach().clone() for n, p in reference.named_parameters()}
    mix_into_reference(reference, policy, 0.6)
    for name, p in reference.named_parameters():
        expected = 0.6 * dict(policy.named_parameters())[name] + 0.4 * before[name]
        assert torch.allclose(p, expected, rtol=0, atol=1e-14)
        assert not p.requires_grad or p.grad is None
    mix_into_reference(reference, policy, 1.0)
    assert all(torch.equal(p, dict(policy.named_parameters())[n]) for n, p in reference.named_parameters())
    with pytest.raises(ValueError):
        mix_into_reference(reference, policy, 0.0)


def test_due():
    assert [s for s in range(0, 10) if due(s, 3)] == [3, 6, 9]
    with pytest.raises(ValueError):
        due(3, 0)
