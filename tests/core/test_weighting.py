"""Listwise weights, q-distribution and xDr multipliers against float64 per-group references (§4, §5)."""

from __future__ import annotations

import math
import random

import pytest
import torch

from maxent_grpo.core.weighting import (
    listwise_weights,
    mode_adaptive_tau,
    q_distribution,
    restrict_support,
    weight_entropy,
    xdr_multipliers,
    xdr_utilities,
)

# ---------------------------------------------------------------- references (plain Python floats)


def ref_softmax(xs):
    m = max(xs)
    es = [math.exp(x - m) for x in xs]
    s = sum(es)
    return [e / s for e in es]


def ref_q(rewards, temp, eps):
    g = len(rewards)
    e = min(eps, 1.0 / g - 1e-8)
    return [(1 - g * e) * v + e for v in ref_softmax([r / temp for r in rewards])]


def ref_listwise(q, tau, beta, ref=None, counts=None, length_normalize=True):
    logits = []
    for i, qi in enumerate(q):
        z = math.log(qi)
        if ref is not None and beta > 0:
            lref = ref[i] / max(counts[i], 1) if length_normalize else ref[i]
            z += beta * lref
        logits.append(z / (tau + beta))
    return ref_softmax(logits)


def ref_entropy(w):
    return -sum(x * math.log(x) for x in w if x > 0)


def ref_xdr(u, valid, tau, lam=0.0, ref=None):
    idx = [i for i, v in enumerate(valid) if v]
    n = len(idx)
    logits = [(u[i] + (lam * ref[i] if ref is not None and lam > 0 else 0.0)) / (tau + lam) for i in idx]
    w = ref_softmax(logits)
    out = [0.0] * len(u)
    for j, i in enumerate(idx):
        out[i] = n * w[j]
    return out


def rand_grid(p, g, seed, scale=2.0):
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(p, g, generator=gen, dtype=torch.float64) * scale


# ---------------------------------------------------------------- q distribution


@pytest.mark.parametrize("temp,eps", [(1.0, 1e-6), (0.3, 0.01), (2.5, 0.0), (1.0, 0.9)])
def test_q_distribution_matches_reference(temp, eps):
    r = rand_grid(5, 6, 0)
    q = q_distribution(r, temp, eps)
    for p in range(5):
        expect = ref_q(r[p].tolist(), temp, eps)
        assert q[p].tolist() == pytest.approx(expect, abs=1e-9)
    assert torch.allclose(q.sum(-1), torch.ones(5, dtype=torch.float64), atol=1e-12)


def test_q_floor_gives_support_and_caps_epsilon():
    r = torch.tensor([[100.0, 0.0, 0.0, -100.0]], dtype=torch.float64)
    q = q_distribution(r, 1.0, 1e-3)
    assert float(q.min()) >= 1e-3 - 1e-15
    # epsilon above 1/G is capped: the floor alone makes q (almost) uniform.
    q_big = q_distribution(r, 1.0, 5.0)
    assert torch.allclose(q_big, torch.full_like(q_big, 0.25), atol=1e-7)


def test_q_distribution_rejects_bad_arguments():
    r = torch.zeros(2, 3)
    with pytest.raises(ValueError, match="temperature"):
        q_distribution(r, 0.0, 1e-6)
    with pytest.raises(ValueError, match="epsilon"):
        q_distribution(r, 1.0, -1.0)
    with pytest.raises(ValueError, match="rewards"):
        q_distribution(torch.zeros(6), 1.0, 1e-6)
    with pytest.raises(ValueError, match="rewards"):
        q_distribution(torch.tensor([[0.0, float("nan")]]), 1.0, 1e-6)


# ---------------------------------------------------------------- listwise weights


@pytest.mark.parametrize("tau,beta,length_normalize", [
    (0.5, 0.0, True), (0.5, 0.2, True), (0.0, 0.3, True), (2.0, 1.0, False), (0.05, 0.01, True),
])
def test_listwise_weights_match_per_group_reference(tau, beta, length_normalize):
    p, g = 4, 7
    q = q_distribution(rand_grid(p, g, 1), 1.0, 1e-4)
    ref = rand_grid(p, g, 2, scale=20.0) - 40.0
    counts = torch.randint(1, 60, (p, g), generator=torch.Generator().manual_seed(3)).to(torch.float64)
    w = listwise_weights(q, tau, beta, ref_logp=ref, token_counts=counts, length_normalize=length_normalize)
    for i in range(p):
        expect = ref_listwise(q[i].tolist(), tau, beta, ref[i].tolist(), counts[i].tolist(), length_normalize)
        assert w[i].tolist() == pytest.approx(expect, abs=1e-9)
        # the vectorised [P, G] call equals the per-group call
        one = listwise_weights(q[i:i + 1], tau, beta, ref_logp=ref[i:i + 1], token_counts=counts[i:i + 1],
                               length_normalize=length_normalize)
        assert torch.allclose(one[0], w[i], atol=1e-12)
    assert torch.allclose(w.sum(-1), torch.ones(p, dtype=torch.float64), atol=1e-12)


def test_listwise_closed_form_maximises_the_program():
    """``w`` beats random points of the simplex on <w, log q> + tau H(w) - beta KL(w || pi_ref)."""
    g, tau, beta = 5, 0.4, 0.3
    q = q_distribution(rand_grid(1, g, 4), 1.0, 1e-3)[0].tolist()
    lref = (rand_grid(1, g, 5)[0]).tolist()
    pi_ref = ref_softmax(lref)

    def objective(w):
        return (sum(wi * math.log(qi) for wi, qi in zip(w, q)) + tau * ref_entropy(w)
                - beta * sum(wi * math.log(wi / pr) for wi, pr in zip(w, pi_ref) if wi > 0))

    w = listwise_weights(torch.tensor([q], dtype=torch.float64), tau, beta,
                         ref_logp=torch.tensor([lref], dtype=torch.float64), length_normalize=False)[0].tolist()
    best = objective(w)
    rng = random.Random(0)
    for _ in range(300):
        v = [rng.expovariate(1.0) for _ in range(g)]
        s = sum(v)
        assert objective([x / s for x in v]) <= best + 1e-12
        # small perturbations around w as well
        pert = [max(wi + rng.uniform(-1e-3, 1e-3), 1e-12) for wi in w]
        s = sum(pert)
        assert objective([x / s for x in pert]) <= best + 1e-12


def test_weight_entropy_grows_with_tau():
    q = q_distribution(rand_grid(3, 6, 6), 1.0, 1e-4)
    ref = rand_grid(3, 6, 7)
    for beta, r in ((0.0, None), (0.3, ref)):
        prev = None
        for tau in (0.01, 0.1, 0.5, 1.0, 3.0, 20.0):
            h = weight_entropy(listwise_weights(q, tau, beta, ref_logp=r, length_normalize=False))
            if prev is not None:
                assert bool((h > prev).all())
            prev = h


def test_beta_zero_ignores_reference():
    q = q_distribution(rand_grid(3, 5, 8), 1.0, 1e-4)
    wild = torch.full((3, 5), -1e30, dtype=torch.float64)
    wild[0, 0] = 1e30
    base = listwise_weights(q, 0.7, 0.0)
    assert torch.equal(listwise_weights(q, 0.7, 0.0, ref_logp=wild, token_counts=torch.ones(3, 5)), base)


def test_uniform_q_and_beta_zero_give_uniform_weights():
    q = torch.full((2, 8), 1.0 / 8, dtype=torch.float64)
    for tau in (0.0, 0.01, 1.0, 50.0):
        w = listwise_weights(q, tau, 0.0)
        assert torch.allclose(w, torch.full_like(w, 1.0 / 8), atol=1e-15)


def test_small_tau_concentrates_on_argmax_and_zero_is_the_limit():
    q = torch.tensor([[0.1, 0.5, 0.2, 0.2], [0.3, 0.1, 0.3, 0.3]], dtype=torch.float64)
    w = listwise_weights(q, 1e-3, 0.0)
    assert float(w[0, 1]) > 1 - 1e-12
    assert w[1].tolist() == pytest.approx([1 / 3, 0.0, 1 / 3, 1 / 3], abs=1e-12)
    w0 = listwise_weights(q, 0.0, 0.0)
    assert w0.tolist() == [[0.0, 1.0, 0.0, 0.0], [1 / 3, 0.0, 1 / 3, 1 / 3]]


def test_infinite_tau_gives_uniform():
    q = q_distribution(rand_grid(2, 4, 9), 1.0, 1e-4)
    w = listwise_weights(q, math.inf, 0.5, ref_logp=rand_grid(2, 4, 10), token_counts=torch.ones(2, 4))
    assert torch.equal(w, torch.full_like(w, 0.25))


def test_denominator_is_tau_plus_beta():
    # With a uniform reference the reference term cancels and only the
    # denominator remains: q^(1/(tau+beta)), not q^(1/tau).
    q = torch.tensor([[0.2, 0.8]], dtype=torch.float64)
    w = listwise_weights(q, 0.5, 0.5)
    expect = [0.2 ** 1.0 / (0.2 + 0.8), 0.8 / (0.2 + 0.8)]
    assert w[0].tolist() == pytest.approx(expect, abs=1e-12)


def test_length_normalisation_is_scale_invariant():
    q = q_distribution(rand_grid(2, 5, 11), 1.0, 1e-4)
    ref = rand_grid(2, 5, 12, scale=10.0)
    counts = torch.randint(1, 30, (2, 5), generator=torch.Generator().manual_seed(1)).to(torch.float64)
    w1 = listwise_weights(q, 0.3, 0.4, ref_logp=ref, token_counts=counts)
    w2 = listwise_weights(q, 0.3, 0.4, ref_logp=3 * ref, token_counts=3 * counts)
    assert torch.allclose(w1, w2, atol=1e-12)
    raw = listwise_weights(q, 0.3, 0.4, ref_logp=ref, token_counts=counts, length_normalize=False)
    assert not torch.allclose(w1, raw, atol=1e-3)


def test_listwise_rejects_bad_arguments():
    q = torch.full((2, 3), 1 / 3)
    with pytest.raises(ValueError, match="tau"):
        listwise_weights(q, -0.1, 0.0)
    with pytest.raises(ValueError, match="beta"):
        listwise_weights(q, 0.1, -0.1)
    with pytest.raises(ValueError, match="beta"):
        listwise_weights(q, 0.1, math.inf)
    with pytest.raises(ValueError, match="tau"):
        listwise_weights(q, math.nan, 0.0)
    with pytest.raises(ValueError, match="token_counts"):
        listwise_weights(q, 0.1, 0.1, ref_logp=torch.zeros(2, 3))
    with pytest.raises(ValueError, match="ref_logp"):
        listwise_weights(q, 0.1, 0.1, ref_logp=torch.zeros(2, 4), length_normalize=False)
    with pytest.raises(ValueError, match="q"):
        listwise_weights(torch.full((3,), 1 / 3), 0.1, 0.0)


def test_weight_entropy_matches_reference_with_zeros():
    w = torch.tensor([[0.5, 0.5, 0.0], [0.2, 0.3, 0.5], [1.0, 0.0, 0.0]], dtype=torch.float64)
    h = weight_entropy(w)
    assert h.tolist() == pytest.approx([ref_entropy(row) for row in w.tolist()], abs=1e-12)


# ---------------------------------------------------------------- xDr


def test_xdr_utilities():
    a = torch.tensor([[1.0, -2.0], [0.5, 0.0]], dtype=torch.float64)
    t = torch.tensor([[10, 20], [5, 0]])
    u = xdr_utilities(a, t, 40)
    assert u.flatten().tolist() == pytest.approx([0.25, -1.0, 0.0625, 0.0])
    with pytest.raises(ValueError, match="max_completion_length"):
        xdr_utilities(a, t, 0)
    with pytest.raises(ValueError, match="lengths"):
        xdr_utilities(a, t[:, :1], 10)


@pytest.mark.parametrize("tau,lam", [(0.5, 0.0), (0.1, 0.0), (1.0, 0.5), (0.0, 0.3)])
def test_xdr_multipliers_match_reference(tau, lam):
    p, g = 4, 6
    u = rand_grid(p, g, 20)
    ref = rand_grid(p, g, 21)
    valid = torch.rand(p, g, generator=torch.Generator().manual_seed(22)) > 0.3
    valid[:, 0] = True
    m = xdr_multipliers(u, valid, tau, lam=lam, ref_logp=ref)
    for i in range(p):
        expect = ref_xdr(u[i].tolist(), valid[i].tolist(), tau, lam, ref[i].tolist())
        assert m[i].tolist() == pytest.approx(expect, abs=1e-9)
        n = int(valid[i].sum())
        assert float(m[i].sum()) == pytest.approx(n, abs=1e-9)  # mean multiplier over valid rows is 1


def test_xdr_infinite_tau_is_bit_identical_to_base_loss():
    u = rand_grid(3, 5, 23).float()
    valid = torch.tensor([[True] * 5, [True, False, True, True, False], [False] * 5])
    m = xdr_multipliers(u, valid, math.inf)
    assert torch.equal(m, torch.ones_like(u))
    per_row_loss = torch.randn(3, 5)
    assert torch.equal(per_row_loss * m, per_row_loss)


def test_xdr_zero_tau_is_uniform_over_argmax_set():
    u = torch.tensor([[1.0, 3.0, 3.0, 0.0], [1.0, 3.0, 5.0, 0.0]])
    valid = torch.tensor([[True] * 4, [True, True, False, True]])
    m = xdr_multipliers(u, valid, 0.0)
    assert m.tolist() == [[0.0, 2.0, 2.0, 0.0], [0.0, 3.0, 0.0, 0.0]]


def test_xdr_masked_rows_zero_and_equal_utilities_exactly_one():
    g = 49  # 49 * (1/49) != 1 in floating point
    u = torch.full((2, g), 0.7, dtype=torch.float64)
    valid = torch.ones(2, g, dtype=torch.bool)
    valid[1, :3] = False
    m = xdr_multipliers(u, valid, 0.3)
    assert torch.equal(m[0], torch.ones(g, dtype=torch.float64))
    assert torch.equal(m[1, 3:], torch.ones(g - 3, dtype=torch.float64))
    assert torch.equal(m[1, :3], torch.zeros(3, dtype=torch.float64))
    empty = xdr_multipliers(torch.randn(1, 4), torch.zeros(1, 4, dtype=torch.bool), 0.5)
    assert torch.equal(empty, torch.zeros(1, 4))


def test_xdr_per_group_tau_equals_scalar_calls_and_is_detached():
    u = rand_grid(3, 4, 24).requires_grad_(True)
    valid = torch.ones(3, 4, dtype=torch.bool)
    taus = torch.tensor([0.2, math.inf, 0.0], dtype=torch.float64)
    m = xdr_multipliers(u, valid, taus)
    assert not m.requires_grad
    for i, t in enumerate(taus.tolist()):
        assert torch.equal(m[i:i + 1], xdr_multipliers(u[i:i + 1], valid[i:i + 1], t))
    with pytest.raises(ValueError, match="tau"):
        xdr_multipliers(u, valid, -1.0)
    with pytest.raises(ValueError, match="tau"):
        xdr_multipliers(u, valid, torch.ones(2))
    with pytest.raises(ValueError, match="valid"):
        xdr_multipliers(u, valid.float(), 1.0)
    with pytest.raises(ValueError, match="lam"):
        xdr_multipliers(u, valid, 1.0, lam=-1.0)


def test_mode_adaptive_tau():
    tau = mode_adaptive_tau(0.5, torch.tensor([0, 1, 2, 5]))
    assert tau[0] == math.inf
    assert tau[1:].tolist() == pytest.approx([0.5 / math.log(2), 0.5 / math.log(3), 0.5 / math.log(6)], rel=1e-6)
    assert mode_adaptive_tau(0.0, torch.tensor([0, 3])).tolist() == [math.inf, 0.0]
    # kappa = 0 groups are left exactly as the base loss
    u = rand_grid(4, 3, 25)
    m = xdr_multipliers(u, torch.ones(4, 3, dtype=torch.bool), tau)
    assert torch.equal(m[0], torch.ones(3, dtype=torch.float64))
    with pytest.raises(ValueError, match="tau0"):
        mode_adaptive_tau(-1.0, torch.tensor([1]))
    with pytest.raises(ValueError, match="num_distinct_correct"):
        mode_adaptive_tau(1.0, torch.tensor([-1]))


# ---------------------------------------------------------------- restricted support


@pytest.mark.parametrize("tau,beta", [(0.5, 0.0), (0.3, 0.2)])
def test_restricted_support_is_the_closed_form_over_the_kept_completions(tau, beta):
    """Zeroing the weights outside S and renormalising equals the closed form computed with q
    restricted to S; a group with no kept completion gets no weight at all."""
    rewards = [[0.0, 1.5, 0.5, 0.0], [1.5, 1.5, 0.5, 1.0], [0.0, 0.0, 0.0, -1.0]]
    ref = rand_grid(3, 4, seed=3, scale=5.0)
    counts = torch.tensor([[3, 12, 7, 2], [5, 6, 7, 8], [1, 2, 3, 4]], dtype=torch.float64)
    q = torch.tensor([ref_q(r, 1.0, 1e-6) for r in rewards], dtype=torch.float64)
    support = torch.tensor([[r > 0 for r in row] for row in rewards])
    w = restrict_support(listwise_weights(q, tau, beta, ref_logp=ref, token_counts=counts), support)
    for i, row in enumerate(rewards):
        kept = [j for j, r in enumerate(row) if r > 0]
        want = [0.0] * 4
        if kept:
            sub = ref_listwise([q[i, j].item() for j in kept], tau, beta,
                               [ref[i, j].item() for j in kept], [counts[i, j].item() for j in kept])
            for j, v in zip(kept, sub):
                want[j] = v
        assert w[i].tolist() == pytest.approx(want, rel=1e-12, abs=1e-15)
    with pytest.raises(ValueError, match="bool"):
        restrict_support(w, support.double())

