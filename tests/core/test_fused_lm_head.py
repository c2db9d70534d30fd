"""The fused LM head (log-probs and entropies from hidden states and the head weight)
against a float64 reference built from the full logits ``h W^T + b`` with
``log_softmax``; gradients w.r.t. the hidden states, the weight and the bias from
float64 autograd through that reference."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from maxent_grpo.core.completion_logits import supports_fused_head
from maxent_grpo.core.fused_lm_head import lm_head_logps
from maxent_grpo.core.logprobs import get_per_token_logps_and_entropies

from test_logprobs import _grouped_batch, _tiny_model, values_and_grads  # noqa: E402


def reference(hidden, weight, bias, targets, temperature):
    logits = torch.nn.functional.linear(hidden.double(), weight.double(), None if bias is None else bias.double())
    logsm = torch.log_softmax(logits / temperature, dim=-1)
    logps = logsm.gather(-1, targets.unsqueeze(-1)).squeeze(-1)
    return logps, -(logsm.exp() * logsm).sum(-1)


def case(shape, hidden_size, vocab, *, bias=True, seed=0, dtype=torch.float64):
    g = torch.Generator().manual_seed(seed)
    hidden = torch.randn(*shape, hidden_size, generator=g, dtype=torch.float64).to(dtype).requires_grad_()
    weight = (torch.randn(vocab, hidden_size, generator=g, dtype=torch.float64) / 2).to(dtype).requires_grad_()
    b = (torch.randn(vocab, generator=g, dtype=torch.float64)).to(dtype).requires_grad_() if bias else None
    targets = torch.randint(0, vocab, shape, generator=g)
    return hidden, weight, b, targets


def _grads(outputs, coefs, inputs):
    loss = sum((c * o).sum() for c, o in zip(coefs, outputs))
    return torch.autograd.grad(loss, [x for x in inputs if x is not None])


@pytest.mark.parametrize("temperature", [1.0, 0.7, 1.6])
@pytest.mark.parametrize("bias", [True, False])
@pytest.mark.parametrize("chunk_rows", [1, 4, 1000])
def test_values_and_gradients_match_float64_reference(temperature, bias, chunk_rows):
    hidden, weight, b, targets = case((3, 5), 16, 301, bias=bias, seed=chunk_rows)
    lp, h = lm_head_logps(hidden, weight, b, targets, temperature=temperature, with_entropy=True, chunk_rows=chunk_rows)
    ref_lp, ref_h = reference(hidden, weight, b, targets, temperature)
    assert lp.dtype == h.dtype == torch.float64 and lp.shape == h.shape == targets.shape
    torch.testing.assert_close(lp, ref_lp, atol=1e-10, rtol=0)
    torch.testing.assert_close(h, ref_h, atol=1e-10, rtol=0)
    g = torch.Generator().manual_seed(1)
    coefs = [torch.randn(targets.shape, generator=g, dtype=torch.float64) for _ in range(2)]
    ours = _grads((lp, h), coefs, (hidden, weight, b))
    theirs = _grads((ref_lp, ref_h), coefs, (hidden, weight, b))
    assert all(float(t.abs().max()) > 0 for t in theirs)
    for o, t in zip(ours, theirs):
        torch.testing.assert_close(o, t, atol=1e-10, rtol=1e-9)


@pytest.mark.parametrize("use", ["logps", "entropies"])
def test_gradient_of_one_output_alone(use):
    hidden, weight, b, targets = case((7,), 8, 50, seed=3)
    lp, h = lm_head_logps(hidden, weight, b, targets, temperature=0.9, with_entropy=True, chunk_rows=3)
    ref = reference(hidden, weight, b, targets, 0.9)
    k = 0 if use == "logps" else 1
    ours = torch.autograd.grad((lp, h)[k].sum(), [hidden, weight, b])
    theirs = torch.autograd.grad(ref[k].sum(), [hidden, weight, b])
    for o, t in zip(ours, theirs):
        torch.testing.assert_close(o, t, atol=1e-10, rtol=1e-9)


def test_without_entropy_returns_none_and_the_same_logps_and_gradient():
    hidden, weight, b, targets = case((2, 4), 8, 40, seed=4)
    lp, h = lm_head_logps(hidden, weight, b, targets, chunk_rows=3)
    assert h is None
    ref_lp, _ = reference(hidden, weight, b, targets, 1.0)
    torch.testing.assert_close(lp, ref_lp, atol=1e-10, rtol=0)
    for o, t in zip(torch.autograd.grad(lp.sum(), [hidden, weight, b]), torch.autograd.grad(ref_lp.sum(), [hidden, weight, b])):
        torch.testing.assert_close(o, t, atol=1e-10, rtol=1e-9)


def test_gradcheck():
    hidden, weight, b, targets = case((5,), 4, 11, seed=5)
    torch.autograd.gradcheck(
        lambda x, w, bb: lm_head_logps(x, w, bb, targets, temperature=0.8, with_entropy=True, chunk_rows=2),
        (hidden, weight, b),
    )


def test_tied_weight_gets_embedding_and_head_gradients():
    """A weight shared by the input embedding and the head (SmolLM2, Qwen2.5-1.5B) gets the sum."""
    g = torch.Generator().manual_seed(6)
    shared = torch.randn(30, 8, generator=g, dtype=torch.float64).requires_grad_()
    ids = torch.randint(0, 30, (2, 5), generator=g)
    targets = torch.randint(0, 30, (2, 5), generator=g)

    def loss(head_fn):
        hidden = torch.tanh(torch.nn.functional.embedding(ids, shared))
        lp, h = head_fn(hidden)
        return (lp + 0.5 * h).sum()

    ours = torch.autograd.grad(loss(lambda x: lm_head_logps(x, shared, None, targets, with_entropy=True, chunk_rows=3)), shared)[0]
    theirs = torch.autograd.grad(loss(lambda x: reference(x, shared, None, targets, 1.0)), shared)[0]
    torch.testing.assert_close(ours, theirs, atol=1e-10, rtol=1e-9)


def test_bf16_autocast_recomputes_the_same_logits_in_backward():
    """Under autocast the head runs in bf16 in both passes: the result is the float64 answer
    for the bf16-rounded inputs to bf16 accuracy, and the gradient is close to float64's."""
    hidden, weight, b, targets = case((4, 6), 32, 500, bias=False, seed=7, dtype=torch.float32)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        lp, h = lm_head_logps(hidden, weight, None, targets, with_entropy=True, chunk_rows=5)
    assert lp.dtype == torch.float32
    ref_lp, ref_h = reference(hidden.bfloat16(), weight.bfloat16(), None, targets, 1.0)
    torch.testing.assert_close(lp.double(), ref_lp, atol=0.1, rtol=0)
    torch.testing.assert_close(h.double(), ref_h, atol=0.1, rtol=0)
    ours = torch.autograd.grad((lp + h).sum(), [hidden, weight])
    theirs = torch.autograd.grad((ref_lp + ref_h).sum(), [hidden, weight])
    for o, t in zip(ours, theirs):
        assert o.dtype == torch.float32
        assert float((o.double() - t).norm()) <= 0.05 * float(t.norm())


def test_bad_arguments_raise():
    hidden, weight, b, targets = case((2, 3), 8, 20)
    with pytest.raises(ValueError, match="weight must be"):
        lm_head_logps(hidden, weight[:, :4], b, targets)
    with pytest.raises(ValueError, match="bias must be"):
        lm_head_logps(hidden, weight, b[:5], targets)
    with pytest.raises(ValueError, match="targets shape"):
        lm_head_logps(hidden, weight, b, targets[:, :2])
    with pytest.raises(ValueError, match="outside the model vocabulary"):
        lm_head_logps(hidden, weight, b, targets + 20)


# ---------------------------------------------------------------- with a model


@pytest.mark.parametrize("share_prompts", [False, True])
def test_model_fused_head_equals_the_models_own_logits(tiny_model_dir, share_prompts):
    """Same values and the same gradient for every parameter (the tied embedding included)
    as the path through the model's logits, in float64."""
    model = _tiny_model(tiny_model_dir)
    assert supports_fused_head(model) and model.config.tie_word_embeddings
    ids, mask, p_len = _grouped_batch(model.config.vocab_size, model.config.pad_token_id)
    g = torch.Generator().manual_seed(22)
    a, b = (torch.randn(ids.shape[0], ids.shape[1] - p_len, generator=g, dtype=torch.float64) for _ in range(2))
    fused, plain = (
        values_and_grads(model, ids, mask, p_len, a, b, chunk_rows=4, share_prompts=share_prompts, fused_head=on)
        for on in (True, False)
    )
    torch.testing.assert_close(fused[0], plain[0], atol=1e-10, rtol=0)
    torch.testing.assert_close(fused[1], plain[1], atol=1e-10, rtol=0)
    assert all(float(t.abs().max()) > 0 for t in plain[2])
    for f, p in zip(fused[2], plain[2]):
        torch.testing.assert_close(f, p, atol=1e-10, rtol=1e-8)


def test_models_with_a_transform_after_the_head_use_their_own_logits():
    """Gemma2 soft-caps its logits after the head: the fused path would be another function."""
    from transformers import Gemma2Config, Gemma2ForCausalLM

    cfg = Gemma2Config(vocab_size=64, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                       num_attention_heads=2, num_key_value_heads=1, head_dim=8, final_logit_softcapping=2.0)
    model = Gemma2ForCausalLM(cfg).double()
    assert not supports_fused_head(model)
    ids = torch.randint(0, 64, (2, 6))
    lp, _ = get_per_token_logps_and_entropies(model, ids, torch.ones_like(ids), 3, share_prompts=False)
    logits = model(input_ids=ids).logits[:, 2:-1]
    torch.testing.assert_close(lp, torch.log_softmax(logits, -1).gather(-1, ids[:, 3:, None])[..., 0])
