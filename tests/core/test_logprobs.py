"""Per-token log-probs and entropies (ALGORITHMS.md §1) against a float64 reference.

The reference is the textbook formula on the full tensor: ``log_softmax`` in
float64, gather, ``H = -sum p log p``; gradients come from float64 autograd
through it. The library computes the same quantities in chunks, from
``u = z - max z``, with a hand-written backward.
"""

from __future__ import annotations

import runpy
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from maxent_grpo.core.logprobs import (
    compute_per_token_logps,
    compute_per_token_logps_and_entropies,
    get_per_token_logps,
    get_per_token_logps_and_entropies,
    selective_logps,
)

REPO = Path(__file__).resolve().parents[2]
EPS32 = torch.finfo(torch.float32).eps


def reference(logits: torch.Tensor, targets: torch.Tensor, temperature: float = 1.0):
    """float64 log-probs of ``targets`` and entropies, from the whole log-softmax."""
    logsm = torch.log_softmax(logits.double() / temperature, dim=-1)
    logps = logsm.gather(-1, targets.unsqueeze(-1)).squeeze(-1)
    ents = -(logsm.exp() * logsm).sum(-1)
    return logps, ents


def random_case(shape, vocab, *, scale=3.0, dtype=torch.float64, seed=0):
    g = torch.Generator().manual_seed(seed)
    logits = (torch.randn(*shape, vocab, generator=g, dtype=torch.float64) * scale).to(dtype)
    targets = torch.randint(0, vocab, shape, generator=g)
    return logits, targets


def f32_atol(logits: torch.Tensor, temperature: float = 1.0) -> float:
    # A few ulps of the largest |z|: what rounding the logits themselves costs.
    return 16 * EPS32 * (1.0 + float(logits.double().abs().max()) / temperature)


# ---------------------------------------------------------------- values


@pytest.mark.parametrize("temperature", [1.0, 0.7, 1.6])
@pytest.mark.parametrize("shape", [(3, 5), (17,), (2, 3, 4)])
def test_float64_matches_reference(shape, temperature):
    logits, targets = random_case(shape, 301, seed=len(shape))
    logps, ents = selective_logps(logits, targets, temperature=temperature, with_entropy=True, chunk_rows=4)
    ref_lp, ref_h = reference(logits, targets, temperature)
    assert logps.dtype == ents.dtype == torch.float64
    assert logps.shape == ents.shape == targets.shape
    torch.testing.assert_close(logps, ref_lp, atol=1e-10, rtol=0)
    torch.testing.assert_close(ents, ref_h, atol=1e-10, rtol=0)


@pytest.mark.parametrize("temperature", [1.0, 0.6])
def test_float32_within_rounding(temperature):
    logits, targets = random_case((4, 9), 1000, scale=4.0, dtype=torch.float32, seed=1)
    logps, ents = selective_logps(logits, targets, temperature=temperature, with_entropy=True, chunk_rows=5)
    assert logps.dtype == ents.dtype == torch.float32
    ref_lp, ref_h = reference(logits, targets, temperature)
    atol = f32_atol(logits, temperature)
    torch.testing.assert_close(logps.double(), ref_lp, atol=atol, rtol=0)
    torch.testing.assert_close(ents.double(), ref_h, atol=atol, rtol=0)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_half_logits_are_upcast_not_computed_in_half(dtype):
    # The answer must be the float64 answer for the (exactly representable)
    # half-precision logits to float32 accuracy; computing in bf16 would be ~1e-2 off.
    logits, targets = random_case((3, 8), 4000, scale=3.0, dtype=dtype, seed=2)
    logps, ents = selective_logps(logits, targets, temperature=0.9, with_entropy=True, chunk_rows=7)
    assert logps.dtype == ents.dtype == torch.float32
    ref_lp, ref_h = reference(logits, targets, 0.9)
    atol = f32_atol(logits, 0.9)
    torch.testing.assert_close(logps.double(), ref_lp, atol=atol, rtol=0)
    torch.testing.assert_close(ents.double(), ref_h, atol=atol, rtol=0)


def test_temperature_is_division_of_logits():
    logits, targets = random_case((2, 6), 50, seed=3)
    tau = 0.37
    lp_t, h_t = selective_logps(logits, targets, temperature=tau, with_entropy=True)
    lp_d, h_d = selective_logps(logits / tau, targets, with_entropy=True)
    torch.testing.assert_close(lp_t, lp_d, atol=1e-12, rtol=0)
    torch.testing.assert_close(h_t, h_d, atol=1e-12, rtol=0)
    # and it matters: a lower temperature sharpens every distribution
    _, h_1 = selective_logps(logits, targets, with_entropy=True)
    assert bool((h_t < h_1).all())


def test_boundary_distributions():
    vocab = 64
    targets = torch.tensor([[0, 5, 63]])
    uniform = torch.full((1, 3, vocab), 2.5, dtype=torch.float64)
    lp, h = selective_logps(uniform, targets, with_entropy=True)
    torch.testing.assert_close(lp, torch.full_like(lp, -torch.log(torch.tensor(float(vocab))).item()))
    torch.testing.assert_close(h, torch.full_like(h, torch.log(torch.tensor(float(vocab))).item()))
    peaked = torch.zeros(1, 3, vocab, dtype=torch.float64)
    peaked[0, torch.arange(3), targets[0]] = 200.0
    lp, h = selective_logps(peaked, targets, with_entropy=True)
    assert float(lp.abs().max()) < 1e-80 and float(h.abs().max()) < 1e-80


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
def test_large_logits_are_shift_invariant(dtype):
    # Without subtracting the max, exp(1000 + z) overflows; with the naive
    # lse - sum p z entropy, float32 loses the answer to cancellation at 1e4.
    logits, targets = random_case((3, 4), 500, dtype=torch.float64, seed=4)
    shift = 1000.0 if dtype == torch.float64 else 1e4
    base_lp, base_h = reference(logits, targets)
    lp, h = selective_logps((logits + shift).to(dtype), targets, with_entropy=True)
    ref_lp, ref_h = reference((logits + shift).to(dtype), targets)
    atol = 1e-9 if dtype == torch.float64 else f32_atol(logits + shift)
    assert bool(torch.isfinite(lp).all() and torch.isfinite(h).all())
    torch.testing.assert_close(lp.double(), ref_lp, atol=atol, rtol=0)
    torch.testing.assert_close(h.double(), ref_h, atol=atol, rtol=0)
    if dtype == torch.float64:
        torch.testing.assert_close(lp, base_lp, atol=1e-9, rtol=0)
        torch.testing.assert_close(h, base_h, atol=1e-9, rtol=0)


@pytest.mark.parametrize("shape", [(3, 10), (4, 2), (23,)])
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
def test_chunk_size_does_not_change_values_or_grads(shape, dtype):
    logits, targets = random_case(shape, 97, dtype=dtype, seed=5)
    g = torch.Generator().manual_seed(6)
    a, b = torch.randn(shape, generator=g, dtype=dtype), torch.randn(shape, generator=g, dtype=dtype)
    results = []
    for rows in (1, 7, 10**9):
        x = logits.clone().requires_grad_()
        lp, h = selective_logps(x, targets, temperature=0.8, with_entropy=True, chunk_rows=rows)
        (a * lp + b * h).sum().backward()
        results.append((lp.detach(), h.detach(), x.grad))
    tol = 1e-12 if dtype == torch.float64 else 4 * EPS32 * 10
    for other in results[1:]:
        for got, want in zip(other, results[0]):
            torch.testing.assert_close(got, want, atol=tol, rtol=tol)


def test_empty_inputs():
    logits = torch.randn(2, 0, 11)
    lp, h = selective_logps(logits, torch.zeros(2, 0, dtype=torch.long), with_entropy=True)
    assert lp.shape == h.shape == (2, 0)


def test_without_entropy_returns_none_and_same_logps():
    logits, targets = random_case((2, 5), 40, seed=7)
    lp, h = selective_logps(logits, targets)
    assert h is None
    torch.testing.assert_close(lp, reference(logits, targets)[0], atol=1e-12, rtol=0)


# ---------------------------------------------------------------- gradients


def reference_grad(logits, targets, a, b, temperature):
    x = logits.detach().double().requires_grad_()
    lp, h = reference(x, targets, temperature)
    terms = (0 if a is None else (a.double() * lp).sum()) + (0 if b is None else (b.double() * h).sum())
    terms.backward()
    return x.grad


@pytest.mark.parametrize("use", ["both", "logps", "entropy"])
@pytest.mark.parametrize("temperature", [1.0, 0.55])
def test_gradient_matches_float64_autograd(use, temperature):
    logits, targets = random_case((3, 6), 83, seed=8)
    g = torch.Generator().manual_seed(9)
    a = None if use == "entropy" else torch.randn(3, 6, generator=g, dtype=torch.float64)
    b = None if use == "logps" else torch.randn(3, 6, generator=g, dtype=torch.float64)
    x = logits.clone().requires_grad_()
    lp, h = selective_logps(x, targets, temperature=temperature, with_entropy=True, chunk_rows=4)
    loss = (0 if a is None else (a * lp).sum()) + (0 if b is None else (b * h).sum())
    loss.backward()
    torch.testing.assert_close(x.grad, reference_grad(logits, targets, a, b, temperature), atol=1e-12, rtol=0)


def test_gradient_without_entropy_output():
    logits, targets = random_case((2, 7), 30, seed=10)
    a = torch.randn(2, 7, dtype=torch.float64)
    x = logits.clone().requires_grad_()
    lp, _ = selective_logps(x, targets, temperature=1.3, chunk_rows=3)
    (a * lp).sum().backward()
    torch.testing.assert_close(x.grad, reference_grad(logits, targets, a, None, 1.3), atol=1e-12, rtol=0)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_gradient_low_precision(dtype):
    logits, targets = random_case((4, 5), 700, dtype=dtype, seed=11)
    a, b = torch.randn(4, 5), torch.randn(4, 5)
    x = logits.clone().requires_grad_()
    lp, h = selective_logps(x, targets, temperature=0.8, with_entropy=True, chunk_rows=6)
    (a * lp + b * h).sum().backward()
    assert x.grad.dtype == dtype
    ref = reference_grad(logits, targets, a, b, 0.8)
    # float32: rounding of z and p; bf16: the final rounding of the gradient itself
    tol = 1e-5 if dtype == torch.float32 else 2**-8
    torch.testing.assert_close(x.grad.double(), ref, atol=tol * float(ref.abs().max()), rtol=tol)


@pytest.mark.parametrize("chunk_rows", [1, 3, 100])
def test_gradcheck(chunk_rows):
    logits, targets = random_case((2, 4), 9, scale=1.5, seed=12)
    x = logits.clone().requires_grad_()

    def fn(z):
        return selective_logps(z, targets, temperature=0.75, with_entropy=True, chunk_rows=chunk_rows)

    assert torch.autograd.gradcheck(fn, (x,), eps=1e-6, atol=1e-8)


def test_double_backward_is_refused():
    logits, targets = random_case((2, 3), 5, seed=13)
    x = logits.clone().requires_grad_()
    lp, _ = selective_logps(x, targets)
    (grad,) = torch.autograd.grad(lp.sum(), x, create_graph=True)
    with pytest.raises(RuntimeError):
        grad.sum().backward()


# ---------------------------------------------------------------- shift-by-one convention


def loop_reference(logits, input_ids, prompt_length):
    """Element by element: the logits at position t score token t + 1."""
    b, seq = input_ids.shape
    out = torch.empty(b, seq - prompt_length, dtype=torch.float64)
    for i in range(b):
        for j, pos in enumerate(range(prompt_length, seq)):
            row = logits[i, pos - 1].double()
            out[i, j] = row[input_ids[i, pos]] - torch.logsumexp(row, 0)
    return out


@pytest.mark.parametrize("prompt_length", [1, 4, 9])
def test_compute_per_token_logps_shifts_by_one(prompt_length):
    logits, _ = random_case((3, 10), 37, seed=14)
    input_ids = torch.randint(0, 37, (3, 10), generator=torch.Generator().manual_seed(15))
    lp = compute_per_token_logps(logits, input_ids, prompt_length, chunk_rows=4)
    assert lp.shape == (3, 10 - prompt_length)
    torch.testing.assert_close(lp, loop_reference(logits, input_ids, prompt_length), atol=1e-12, rtol=0)
    # already-trimmed logits (positions prompt_length-1 .. L-2) give the same answer
    trimmed = logits[:, prompt_length - 1 : -1].clone()
    torch.testing.assert_close(compute_per_token_logps(trimmed, input_ids, prompt_length), lp, atol=0, rtol=0)
    lp2, h = compute_per_token_logps_and_entropies(logits, input_ids, prompt_length, temperature=0.5)
    ref_lp, ref_h = reference(logits[:, prompt_length - 1 : -1], input_ids[:, prompt_length:], 0.5)
    torch.testing.assert_close(lp2, ref_lp, atol=1e-12, rtol=0)
    torch.testing.assert_close(h, ref_h, atol=1e-12, rtol=0)


def test_prompt_length_equal_to_sequence_gives_empty_completion():
    logits, _ = random_case((2, 5), 11, seed=16)
    ids = torch.zeros(2, 5, dtype=torch.long)
    assert compute_per_token_logps(logits, ids, 5).shape == (2, 0)


# ---------------------------------------------------------------- with a model


def _tiny_model(tiny_model_dir):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir).double().eval()
    return model


def _left_padded_batch(vocab, pad_id):
    """Three rows: prompts of 2, 5, 3 tokens left-padded to 5; completions of 4, 2, 1 tokens right-padded to 4."""
    g = torch.Generator().manual_seed(17)
    prompts = [torch.randint(3, vocab, (n,), generator=g) for n in (2, 5, 3)]
    completions = [torch.randint(3, vocab, (n,), generator=g) for n in (4, 2, 1)]
    p_len, c_len = 5, 4
    ids = torch.full((3, p_len + c_len), pad_id, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for i, (p, c) in enumerate(zip(prompts, completions)):
        ids[i, p_len - len(p) : p_len] = p
        ids[i, p_len : p_len + len(c)] = c
        mask[i, p_len - len(p) : p_len + len(c)] = 1
    return ids, mask, prompts, completions, p_len


def test_model_logps_and_entropies_match_unpadded_forward(tiny_model_dir):
    model = _tiny_model(tiny_model_dir)
    vocab = model.config.vocab_size
    ids, mask, prompts, completions, p_len = _left_padded_batch(vocab, model.config.pad_token_id)
    temperature = 0.8
    lp, h = get_per_token_logps_and_entropies(model, ids, mask, p_len, temperature=temperature, chunk_rows=3)
    assert lp.shape == h.shape == (3, ids.shape[1] - p_len)
    assert lp.dtype == torch.float64
    with torch.no_grad():
        for i, (p, c) in enumerate(zip(prompts, completions)):
            # each row alone, no padding at all, plain full forward
            seq = torch.cat([p, c])[None]
            logits = model(input_ids=seq).logits[0]
            ref_lp, ref_h = reference(logits[len(p) - 1 : -1], seq[0, len(p) :], temperature)
            torch.testing.assert_close(lp[i, : len(c)].detach(), ref_lp, atol=1e-9, rtol=0)
            torch.testing.assert_close(h[i, : len(c)].detach(), ref_h, atol=1e-9, rtol=0)
    only_lp = get_per_token_logps(model, ids, mask, p_len, temperature=temperature)
    torch.testing.assert_close(only_lp, lp, atol=1e-12, rtol=0)


def test_model_parameter_gradients_match_reference(tiny_model_dir):
    model = _tiny_model(tiny_model_dir)
    ids, mask, _, _, p_len = _left_padded_batch(model.config.vocab_size, model.config.pad_token_id)
    comp_mask = mask[:, p_len:].double()
    g = torch.Generator().manual_seed(18)
    a, b = torch.randn(comp_mask.shape, generator=g, dtype=torch.float64), torch.randn(comp_mask.shape, generator=g, dtype=torch.float64)

    def grads(loss):
        model.zero_grad()
        loss.backward()
        return [p.grad.clone() for p in model.parameters()]

    lp, h = get_per_token_logps_and_entropies(model, ids, mask, p_len, temperature=0.9, chunk_rows=2)
    ours = grads((comp_mask * (a * lp + b * h)).sum())
    # Same positions as ours (HF computes RoPE angles in float32, so shifted
    # positions would differ at 1e-7); the test is about the backward chain.
    positions = (mask.cumsum(-1) - 1).clamp(min=0)
    logits = model(input_ids=ids, attention_mask=mask, position_ids=positions).logits
    ref_lp, ref_h = reference(logits[:, p_len - 1 : -1], ids[:, p_len:], 0.9)
    theirs = grads((comp_mask * (a * ref_lp + b * ref_h)).sum())
    assert any(float(t.abs().max()) > 0 for t in theirs)
    for o, t in zip(ours, theirs):
        torch.testing.assert_close(o, t, atol=1e-10, rtol=1e-8)


def _grouped_batch(vocab, pad_id):
    """Six rows: two prompts (2 and 5 tokens) taking turns, each with 3 completions of 1..4 tokens."""
    g = torch.Generator().manual_seed(21)
    prompts = [torch.randint(3, vocab, (n,), generator=g) for n in (2, 5)]
    p_len, c_len = 5, 4
    ids = torch.full((6, p_len + c_len), pad_id, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for i, n in enumerate((4, 1, 3, 4, 2, 3)):
        p, c = prompts[i % 2], torch.randint(3, vocab, (n,), generator=g)
        ids[i, p_len - len(p) : p_len] = p
        ids[i, p_len : p_len + n] = c
        mask[i, p_len - len(p) : p_len + n] = 1
    return ids, mask, p_len


def values_and_grads(model, ids, mask, p_len, a, b, **kwargs):
    """Masked completion log-probs and entropies at temperature 0.7, and every parameter's
    gradient of ``sum(mask * (a * logp + b * H))``."""
    comp_mask = mask[:, p_len:].double()
    model.zero_grad()
    lp, h = get_per_token_logps_and_entropies(model, ids, mask, p_len, temperature=0.7, **kwargs)
    (comp_mask * (a * lp + b * h)).sum().backward()
    return lp.detach() * comp_mask, h.detach() * comp_mask, [p.grad.clone() for p in model.parameters()]


def test_shared_prompt_forward_matches_plain_forward_values_and_gradients(tiny_model_dir):
    model = _tiny_model(tiny_model_dir)
    ids, mask, p_len = _grouped_batch(model.config.vocab_size, model.config.pad_token_id)
    comp_mask = mask[:, p_len:].double()
    g = torch.Generator().manual_seed(22)
    a, b = (torch.randn(comp_mask.shape, generator=g, dtype=torch.float64) for _ in range(2))

    shared, plain = (values_and_grads(model, ids, mask, p_len, a, b, share_prompts=share) for share in (True, False))
    torch.testing.assert_close(shared[0], plain[0], atol=1e-10, rtol=0)
    torch.testing.assert_close(shared[1], plain[1], atol=1e-10, rtol=0)
    # HF's RMSNorm computes in float32 even in a float64 model, so gradients summed
    # in another order (once per prompt instead of once per row) agree to ~1e-7
    # of their scale; a lost or double-counted prompt gradient is off by O(1).
    assert all(float(t.abs().max()) > 0 for t in plain[2])
    for s_grad, p_grad in zip(shared[2], plain[2]):
        assert float((s_grad - p_grad).abs().max()) <= 1e-5 * float(p_grad.abs().max())


def test_shared_prompt_rows_are_found_by_ids_and_mask():
    from maxent_grpo.core.completion_logits import distinct_prompt_rows

    ids = torch.tensor([[0, 5, 6], [5, 5, 6], [0, 5, 6], [5, 5, 6]])
    mask = torch.tensor([[0, 1, 1], [1, 1, 1], [0, 1, 1], [1, 1, 1]])
    first, inverse = distinct_prompt_rows(ids, mask)
    assert sorted(first.tolist()) == [0, 1]
    assert inverse[0] == inverse[2] != inverse[1] == inverse[3]
    # Same ids but a different mask (a real 0 token vs padding) are different prompts.
    _, inverse = distinct_prompt_rows(torch.tensor([[0, 5], [0, 5]]), torch.tensor([[0, 1], [1, 1]]))
    assert inverse[0] != inverse[1]


# ---------------------------------------------------------------- errors


def test_out_of_vocabulary_ids_raise(tiny_model_dir):
    model = _tiny_model(tiny_model_dir)
    vocab = model.config.vocab_size
    ids = torch.randint(0, vocab, (2, 6))
    mask = torch.ones_like(ids)
    for bad in (vocab, -1):
        broken = ids.clone()
        broken[1, 4] = bad
        with pytest.raises(ValueError, match="input_ids"):
            get_per_token_logps_and_entropies(model, broken, mask, 3)
        with pytest.raises(ValueError, match="input_ids"):
            compute_per_token_logps(torch.randn(2, 6, vocab), broken, 3)
    with pytest.raises(ValueError, match="targets"):
        selective_logps(torch.randn(2, 5), torch.tensor([1, 5]))


@pytest.mark.parametrize("temperature", [0.0, -1.0, float("nan"), float("inf")])
def test_bad_temperature_raises(temperature, tiny_model_dir):
    logits, targets = random_case((2, 3), 7, seed=19)
    with pytest.raises(ValueError, match="temperature"):
        selective_logps(logits, targets, temperature=temperature)
    with pytest.raises(ValueError, match="temperature"):
        compute_per_token_logps(logits, targets, 1, temperature=temperature)
    ids = torch.randint(0, 10, (1, 4))
    with pytest.raises(ValueError, match="temperature"):
        get_per_token_logps(_tiny_model(tiny_model_dir), ids, torch.ones_like(ids), 2, temperature=temperature)


@pytest.mark.parametrize("prompt_length", [0, -2, 7])
def test_bad_prompt_length_raises(prompt_length):
    logits, _ = random_case((2, 6), 7, seed=20)
    ids = torch.randint(0, 7, (2, 6))
    with pytest.raises(ValueError, match="prompt_length"):
        compute_per_token_logps(logits, ids, prompt_length)


def test_other_bad_arguments_raise():
    logits, targets = random_case((2, 3), 7, seed=21)
    with pytest.raises(ValueError, match="chunk_rows"):
        selective_logps(logits, targets, chunk_rows=0)
    with pytest.raises(ValueError, match="targets"):
        selective_logps(logits, targets.double())
    with pytest.raises(ValueError, match="logits"):
        selective_logps(logits, targets[:, :2])
    with pytest.raises(ValueError, match="logits"):
        compute_per_token_logps(logits[:, :2], targets, 2)  # neither L nor L - prompt_length positions


# ---------------------------------------------------------------- benchmark script


def _bench_main():
    return runpy.run_path(str(REPO / "benchmarks" / "logprobs_bench.py"), run_name="logprobs_bench")["main"]


def _check_table(text: str) -> None:
    for variant in ("chunked-fwd", "naive-fwd", "chunked-fwd+bwd", "naive-fwd+bwd"):
        assert f"fp32  {variant} " in text and f"bf16  {variant} " in text
    assert "chunked/naive memory" in text


def test_benchmark_small_in_process(capsys):
    _bench_main()(["--small"])
    _check_table(capsys.readouterr().out)


@pytest.mark.slow
def test_benchmark_script_smoke_run():
    # A fresh interpreter (torch import dominates the time), as users run it.
    out = subprocess.run(
        [sys.executable, str(REPO / "benchmarks" / "logprobs_bench.py"), "--small"],
        capture_output=True, text=True, timeout=300, check=True,
    )
    _check_table(out.stdout)


def test_per_token_logp_is_the_mean_per_token_and_keeps_empty_completions_at_zero():
    from maxent_grpo.core.logprobs import per_token_logp

    sums = torch.tensor([[-6.0, -9.0], [0.0, -2.5]], dtype=torch.float64)
    counts = torch.tensor([[3, 2], [0, 5]])
    assert per_token_logp(sums, counts).tolist() == [[-2.0, -4.5], [0.0, -0.5]]
    assert per_token_logp(sums, counts).dtype == torch.float64
    with pytest.raises(ValueError, match="shape"):
        per_token_logp(sums, counts[0])
