"""The peers' policy losses, ALGORITHMS.md §11-§14: SAPO, GMPO, DPPO, OPSM.

Every closed form is re-derived here with plain ``math`` (or float64 torch where a
tensor is needed), never by calling the function under test.
"""

import math

import pytest
import torch

from maxent_grpo.core.bounds import SpecError
from maxent_grpo.core.losses import (
    POLICY_LOSSES,
    ClipSettings,
    PolicyInputs,
    StepNormalizer,
    aggregate,
    clipped_surrogate,
)
from maxent_grpo.core.peer_losses import (
    DppoParams,
    GmpoParams,
    OpsmParams,
    SapoParams,
    dppo_trust_region_mask,
    gmpo_surrogate,
    opsm_sequence_mask,
)

F64 = torch.float64
LOSS_TYPES = ("grpo", "bnpo", "dapo", "dr_grpo")
CLIP_KEYS = {"clip_ratio/low_mean", "clip_ratio/high_mean", "clip_ratio/region_mean"}


def t(values, requires_grad=False):
    return torch.tensor(values, dtype=F64, requires_grad=requires_grad)


def inputs(logp, old, adv, mask=None, *, params=None, behaviour=None, policy_mask=None, row_weights=None,
           clip=None, correction=None, correction_level="token"):
    mask = torch.ones_like(logp.detach()) if mask is None else mask
    extra = {} if correction is None else dict(correction_weights=correction, correction_level=correction_level)
    return PolicyInputs(
        logp=logp, old_logp=old, mask=mask, policy_mask=mask if policy_mask is None else policy_mask,
        advantages=adv, num_generations=1, clip=ClipSettings() if clip is None else clip,
        row_weights=row_weights, behaviour_logp=behaviour, params=params, **extra,
    )


def norm_for(mask, max_len=None):
    b, tt = mask.shape
    return StepNormalizer(num_sequences=b, num_tokens=int(mask.sum().item()), num_micro_batches=1,
                          max_completion_length=max_len or tt)


def run(name, inp, norm=None):
    return POLICY_LOSSES[name](inp, norm or norm_for(inp.mask))


def totals(term):
    return {k: (m.total.item(), m.per) for k, m in term.metrics.items()}


def sigmoid(x):
    return 1.0 / (1.0 + math.exp(-x))


def reference_aggregate(rows, masks, loss_type, b_rows, max_len):
    """Independent §3 aggregation of per-token values ``rows[i][t]`` (plain python, one micro-batch)."""
    sums = [sum(v * m for v, m in zip(r, mk)) for r, mk in zip(rows, masks)]
    lengths = [sum(mk) for mk in masks]
    if loss_type == "grpo":
        return sum(s / max(n, 1) for s, n in zip(sums, lengths)) / b_rows
    if loss_type in ("bnpo", "dapo"):
        return sum(sums) / max(sum(lengths), 1)
    return sum(sums) / (b_rows * max_len)


def reference_normalizer(loss_type, length, b_rows, n_tok, max_len):
    """d loss / d (per-token value) under the §3 aggregation."""
    return {"grpo": b_rows * length, "bnpo": n_tok, "dapo": n_tok, "dr_grpo": b_rows * max_len}[loss_type]


# --------------------------------------------------------------- the registry


def test_registry_names_params_and_loss_types():
    want = {"sapo": (SapoParams, None), "gmpo": (GmpoParams, ("grpo",)), "dppo": (DppoParams, None),
            "opsm": (OpsmParams, None)}
    for name, (params, loss_types) in want.items():
        assert name in POLICY_LOSSES
        assert POLICY_LOSSES[name].params is params
        assert POLICY_LOSSES[name].loss_types == loss_types


def test_params_defaults():
    assert (SapoParams().tau_pos, SapoParams().tau_neg) == (1.0, 1.05)
    assert (GmpoParams().eps_low, GmpoParams().eps_high) == (0.4, 0.4)
    d = DppoParams()
    assert (d.divergence, d.delta_low, d.delta_high, d.anchor, d.ratio_cap) == ("tv", 0.15, 0.15, "old", None)
    assert OpsmParams().delta == 1e-4


@pytest.mark.parametrize("make, setting", [
    (lambda: SapoParams(tau_pos=0.0), "tau_pos"),
    (lambda: SapoParams(tau_pos=-1.0), "tau_pos"),
    (lambda: SapoParams(tau_pos=math.nan), "tau_pos"),
    (lambda: SapoParams(tau_pos=math.inf), "tau_pos"),
    (lambda: SapoParams(tau_neg=0.0), "tau_neg"),
    (lambda: SapoParams(tau_neg=-0.5), "tau_neg"),
    (lambda: GmpoParams(eps_low=0.0), "eps_low"),
    (lambda: GmpoParams(eps_low=-0.1), "eps_low"),
    (lambda: GmpoParams(eps_low=math.nan), "eps_low"),
    (lambda: GmpoParams(eps_high=0.0), "eps_high"),
    (lambda: GmpoParams(eps_high=-0.4), "eps_high"),
    (lambda: DppoParams(divergence="kl"), "divergence"),
    (lambda: DppoParams(delta_low=0.0), "delta_low"),
    (lambda: DppoParams(delta_low=-0.1), "delta_low"),
    (lambda: DppoParams(delta_high=0.0), "delta_high"),
    (lambda: DppoParams(delta_high=math.nan), "delta_high"),
    (lambda: DppoParams(anchor="sampler"), "anchor"),
    (lambda: DppoParams(ratio_cap=0.0), "ratio_cap"),
    (lambda: DppoParams(ratio_cap=-3.0), "ratio_cap"),
    (lambda: OpsmParams(delta=math.nan), "delta"),
    (lambda: OpsmParams(delta=math.inf), "delta"),
    (lambda: OpsmParams(delta=-math.inf), "delta"),
])
def test_params_reject_their_bounds(make, setting):
    with pytest.raises(SpecError) as err:
        make()
    assert err.value.setting == setting


def test_params_accept_edges():
    SapoParams(tau_pos=1e-6, tau_neg=1e-6)
    GmpoParams(eps_low=1e-6, eps_high=5.0)
    DppoParams(divergence="binary_kl", delta_low=0.05, delta_high=0.05, anchor="behaviour", ratio_cap=1e-3)
    DppoParams(delta_low=math.inf, delta_high=math.inf, ratio_cap=math.inf)
    OpsmParams(delta=0.0)
    OpsmParams(delta=-0.5)


def test_wrong_params_type_is_an_error():
    logp = t([[-1.0]], True)
    with pytest.raises(TypeError, match="SapoParams"):
        run("sapo", inputs(logp, logp.detach(), t([1.0]), params=GmpoParams()))


# ------------------------------------------------------------------- SAPO §11


def _sapo_batch():
    # Three rows, A > 0, A < 0, A = 0, with padding; on-policy.
    logp = t([[-0.5, -1.25, -2.0, -0.75], [-1.0, -0.25, 0.0, 0.0], [-3.0, -0.5, -1.5, 0.0]], True)
    mask = t([[1, 1, 1, 1], [1, 1, 0, 0], [1, 1, 1, 0]])
    return logp, mask, [1.5, -0.7, 0.0]


@pytest.mark.parametrize("loss_type", LOSS_TYPES)
def test_sapo_on_policy_value_and_vanilla_gradient(loss_type):
    logp, mask, adv = _sapo_batch()
    p = SapoParams(tau_pos=1.0, tau_neg=1.05)
    term = run("sapo", inputs(logp, logp.detach().clone(), t(adv), mask, params=p))
    loss = aggregate(term.per_token_loss, mask, loss_type, norm_for(mask, max_len=6)) + term.sequence_loss
    masks = mask.tolist()
    taus = [p.tau_pos if a > 0 else p.tau_neg for a in adv]
    rows = [[-2 * a / tau] * 4 for a, tau in zip(adv, taus)]
    assert loss.item() == pytest.approx(reference_aggregate(rows, masks, loss_type, 3, 6), rel=1e-12, abs=1e-15)
    loss.backward()
    n_tok = sum(map(sum, masks))
    for i, a in enumerate(adv):
        for j in range(4):
            want = -a / reference_normalizer(loss_type, sum(masks[i]), 3, n_tok, 6) * masks[i][j]
            assert logp.grad[i, j].item() == pytest.approx(want, rel=1e-12, abs=1e-15)


@pytest.mark.parametrize("tau_pos, tau_neg", [(1.0, 1.05), (0.7, 0.7), (2.0, 0.5)])
def test_sapo_asymmetry_at_ratio_one_and_a_half(tau_pos, tau_neg):
    old = t([[-1.0], [-1.0]])
    logp = (old + math.log(1.5)).requires_grad_(True)
    term = run("sapo", inputs(logp, old, t([1.0, -1.0]), params=SapoParams(tau_pos, tau_neg)))
    term.per_token_loss.sum().backward()
    r = math.exp(logp[0, 0].item() - old[0, 0].item())
    assert r == pytest.approx(1.5, rel=1e-15)
    for row, tau, sign in ((0, tau_pos, 1.0), (1, tau_neg, -1.0)):
        s = sigmoid(tau * (r - 1))
        assert logp.grad[row, 0].item() == pytest.approx(-sign * 4 * s * (1 - s) * r, rel=1e-12)
        assert term.per_token_loss[row, 0].item() == pytest.approx(-sign * 4 / tau * s, rel=1e-12)
    if tau_pos == tau_neg:
        assert abs(logp.grad[0, 0].item()) == pytest.approx(abs(logp.grad[1, 0].item()), rel=1e-15)


@pytest.mark.parametrize("adv", [2.0, -2.0])
def test_sapo_extremes_are_finite_and_clamped(adv):
    old = t([[-1.0, -1.0, -1.0]])
    logp = (old + t([[50.0, -50.0, 0.5]])).requires_grad_(True)
    p = SapoParams()
    term = run("sapo", inputs(logp, old, t([adv]), params=p))
    loss = aggregate(term.per_token_loss, torch.ones_like(old), "dapo", norm_for(torch.ones_like(old)))
    loss.backward()
    assert torch.isfinite(term.per_token_loss).all() and torch.isfinite(logp.grad).all()
    assert logp.grad[0, 0].item() == 0.0 and logp.grad[0, 1].item() == 0.0
    assert logp.grad[0, 2].item() != 0.0
    tau = p.tau_pos if adv > 0 else p.tau_neg
    assert term.per_token_loss[0, 0].item() == pytest.approx(-adv * 4 / tau * sigmoid(tau * (math.exp(20) - 1)),
                                                             rel=1e-12)
    assert term.per_token_loss[0, 1].item() == pytest.approx(-adv * 4 / tau * sigmoid(tau * (math.exp(-20) - 1)),
                                                             rel=1e-12)


def test_sapo_fully_masked_row_counts_in_grpo_mean():
    logp = t([[-1.0, -2.0], [7.0, -80.0]], True)  # row 1 is padding with junk values
    old = t([[-1.0, -2.0], [-90.0, 3.0]])
    mask = t([[1, 1], [0, 0]])
    term = run("sapo", inputs(logp, old, t([1.0, -1.0]), mask))
    loss = aggregate(term.per_token_loss, mask, "grpo", norm_for(mask))
    assert loss.item() == pytest.approx((-2 * 1.0 / 1.0) / 2, rel=1e-12)
    loss.backward()
    assert torch.isfinite(logp.grad).all() and (logp.grad[1] == 0).all()


def test_sapo_gradcheck():
    old = t([[-1.0, -0.5, -2.0], [-0.3, -1.7, -0.9]])
    logp = (old + t([[0.3, -0.4, 0.05], [1.2, -2.0, 0.0]])).requires_grad_(True)
    adv = t([0.8, -1.3])
    p = SapoParams(tau_pos=0.9, tau_neg=1.3)
    torch.autograd.gradcheck(lambda lp: run("sapo", inputs(lp, old, adv, params=p)).per_token_loss, (logp,))


def test_sapo_metrics_hand_computed():
    old = t([[-1.0, -1.0], [-1.0, -1.0]])
    logp = (old + t([[0.0, math.log(2.0)], [0.0, 0.0]])).requires_grad_(True)
    mask = t([[1, 1], [1, 0]])
    p = SapoParams(tau_pos=1.0, tau_neg=1.05)
    term = run("sapo", inputs(logp, old, t([1.0, -1.0]), mask, params=p))
    got = totals(term)
    assert set(got) == {"sapo/gate_mean", "sapo/grad_weight_mean", "ppo_kl"} | CLIP_KEYS
    s2 = sigmoid(1.0 * (2.0 - 1.0))
    s_neg = sigmoid(0.0)
    assert got["sapo/gate_mean"][0] == pytest.approx(4 * 0.5 + 4 * s2 + 4 / 1.05 * s_neg, rel=1e-12)
    assert got["sapo/grad_weight_mean"][0] == pytest.approx(1.0 + 4 * s2 * (1 - s2) * 2.0 + 1.0, rel=1e-12)
    assert got["ppo_kl"][0] == pytest.approx(-math.log(2.0), rel=1e-12)
    assert all(got[k] == (0.0, "token") for k in CLIP_KEYS)
    assert all(per == "token" for _, per in got.values())


def test_sapo_policy_mask_and_row_weights():
    logp = t([[-1.0, -2.0], [-0.5, -0.25]], True)
    pm = t([[1, 0], [1, 1]])
    term = run("sapo", inputs(logp, logp.detach(), t([1.0, 1.0]), policy_mask=pm, row_weights=t([1.0, 3.0])))
    assert term.per_token_loss.tolist() == [[-2.0, 0.0], [-6.0, -6.0]]


# ------------------------------------------------------------------- GMPO §12


def _gmpo(s_values, adv, eps=(0.4, 0.4), mask=None, policy_mask=None, row_weights=None, correction=None,
          correction_level="token"):
    old = torch.zeros(len(s_values), len(s_values[0]), dtype=F64)
    logp = t(s_values, True)  # old = 0, so s = logp exactly
    inp = inputs(logp, old, t(adv), mask, params=GmpoParams(*eps), policy_mask=policy_mask, row_weights=row_weights,
                 correction=correction, correction_level=correction_level)
    term = run("gmpo", inp)
    return logp, inp, term


def _gmpo_reference(s, a, m, eps_low, eps_high):
    """verl geo_mean for one row, with per-token advantages ``a`` (plain python)."""
    def clip_one(st, at):
        if at > 0:
            return min(st, eps_high)
        if at < 0:
            return max(st, -eps_low)
        return 0.0

    length = sum(m) + 1e-8
    rho = math.exp(sum(clip_one(st, at) * mt for st, at, mt in zip(s, a, m)) / length)
    abar = sum(at * mt for at, mt in zip(a, m)) / length
    return -abar * rho, rho, abar


def test_gmpo_positive_advantage_clips_only_the_upper_side():
    logp, inp, term = _gmpo([[0.6, -0.9, 0.1]], [1.0])
    loss = aggregate(term.per_token_loss, inp.mask, "grpo", norm_for(inp.mask))
    rho = math.exp((0.4 - 0.9 + 0.1) / (3 + 1e-8))
    assert rho == pytest.approx(math.exp((0.4 - 0.9 + 0.1) / 3), rel=1e-8)  # the spec's closed form
    want_loss, want_rho, abar = _gmpo_reference([0.6, -0.9, 0.1], [1.0] * 3, [1] * 3, 0.4, 0.4)
    assert want_rho == pytest.approx(rho, rel=1e-15)
    assert loss.item() == pytest.approx(want_loss, rel=1e-12)
    loss.backward()
    g = logp.grad[0].tolist()
    assert g[0] == 0.0
    for j in (1, 2):
        assert g[j] == pytest.approx(-abar * rho / (3 + 1e-8), rel=1e-12)


def test_gmpo_negative_advantage_clips_only_the_lower_side():
    logp, inp, term = _gmpo([[-0.6, 0.9, -0.1]], [-1.0])
    loss = aggregate(term.per_token_loss, inp.mask, "grpo", norm_for(inp.mask))
    rho = math.exp((-0.4 + 0.9 - 0.1) / (3 + 1e-8))
    abar = -3 / (3 + 1e-8)
    assert loss.item() == pytest.approx(-abar * rho, rel=1e-12)
    loss.backward()
    g = logp.grad[0].tolist()
    assert g[0] == 0.0
    assert g[1] == pytest.approx(-abar * rho / (3 + 1e-8), rel=1e-12) and g[1] > 0
    assert g[2] == pytest.approx(g[1], rel=1e-15)


def test_gmpo_token_on_the_bound_is_not_clipped():
    # s = 0.5 = eps_high (dyadic): s~ == s, full gradient, not counted as clipped.
    logp, inp, term = _gmpo([[0.5, 0.25]], [1.0], eps=(0.5, 0.5))
    term.per_token_loss.sum().backward()
    assert (logp.grad != 0).all()
    assert totals(term)["clip_ratio/high_mean"][0] == 0.0


def test_gmpo_zero_advantage_and_empty_row():
    logp, inp, term = _gmpo([[0.6, -0.9, 0.1], [30.0, -40.0, 2.0], [0.0, 0.0, 0.0]], [0.0, -2.0, 1.0],
                            mask=t([[1, 1, 1], [0, 0, 0], [1, 1, 0]]))
    loss = aggregate(term.per_token_loss, inp.mask, "grpo", norm_for(inp.mask))
    loss.backward()
    assert torch.isfinite(logp.grad).all() and torch.isfinite(term.per_token_loss).all()
    assert (logp.grad[:2] == 0).all() and (term.per_token_loss[:2] == 0).all()
    # Row 2 (L=2, on-policy): l = -A*2/(2+1e-8); the mean is over all 3 rows (empty ones included).
    assert loss.item() == pytest.approx(-1.0 * 2 / (2 + 1e-8) / 3, rel=1e-12)


def test_gmpo_mixed_sign_per_token_advantages():
    s = [0.6, -0.6, -0.6, 0.3]
    a = [1.0, -1.0, 1.0, 0.0]
    logp = t([s], True)
    terms = gmpo_surrogate(logp, torch.zeros_like(logp), t([a]), mask=torch.ones_like(logp), eps_low=0.4, eps_high=0.4)
    want, rho, abar = _gmpo_reference(s, a, [1] * 4, 0.4, 0.4)
    assert terms.sequence_loss.item() == pytest.approx(want, rel=1e-12)
    assert terms.high_clipped.tolist() == [[True, False, False, False]]
    assert terms.low_clipped.tolist() == [[False, True, False, False]]
    terms.sequence_loss.sum().backward()
    g = logp.grad[0].tolist()
    assert g[0] == 0.0 and g[1] == 0.0 and g[3] == 0.0  # clipped, clipped, A = 0
    assert g[2] == pytest.approx(-abar * rho / (4 + 1e-8), rel=1e-12)


def test_gmpo_extremes_finite():
    logp, inp, term = _gmpo([[50.0, -50.0], [50.0, -50.0]], [1.0, -1.0])
    loss = aggregate(term.per_token_loss, inp.mask, "grpo", norm_for(inp.mask))
    loss.backward()
    assert torch.isfinite(loss) and torch.isfinite(logp.grad).all()
    # A > 0: +50 clipped at 0.4, -50 unclipped; A < 0: -50 clipped at -0.4, +50 unclipped.
    rho0, rho1 = math.exp((0.4 - 50) / (2 + 1e-8)), math.exp((50 - 0.4) / (2 + 1e-8))
    abar = 2 / (2 + 1e-8)
    assert loss.item() == pytest.approx((-abar * rho0 + abar * rho1) / 2, rel=1e-12)


def test_gmpo_gradcheck():
    old = t([[-1.0, -0.5, -2.0], [-0.3, -1.7, -0.9]])
    logp = (old + t([[0.7, -0.9, 0.05], [0.9, -0.6, 0.1]])).requires_grad_(True)
    adv = t([0.8, -1.3])
    mask = t([[1, 1, 1], [1, 1, 0]])

    def f(lp):
        term = run("gmpo", inputs(lp, old, adv, mask, params=GmpoParams()))
        return aggregate(term.per_token_loss, mask, "grpo", norm_for(mask))

    torch.autograd.gradcheck(f, (logp,))


def test_gmpo_micro_batch_invariance():
    s = [[0.6, -0.9, 0.1, 0.0], [0.2, 0.5, -0.5, 0.0], [0.0, 0.0, 0.0, 0.0], [-0.1, 0.3, 0.0, 0.0]]
    mask = t([[1, 1, 1, 0], [1, 1, 1, 1], [0, 0, 0, 0], [1, 1, 0, 0]])
    adv = [1.0, -0.5, 2.0, -1.5]
    logp, inp, term = _gmpo(s, adv, mask=mask)
    step = norm_for(mask)
    whole = aggregate(term.per_token_loss, mask, "grpo", step)
    parts = 0.0
    for rows in (slice(0, 1), slice(1, 4)):
        sub = inputs(t(s)[rows], torch.zeros(4, 4, dtype=F64)[rows], t(adv)[rows], mask[rows], params=GmpoParams())
        parts = parts + aggregate(run("gmpo", sub, step).per_token_loss, mask[rows], "grpo", step)
    ref = sum(_gmpo_reference(si, [a] * 4, mi, 0.4, 0.4)[0] for si, a, mi in zip(s, adv, mask.tolist())) / 4
    assert whole.item() == pytest.approx(ref, rel=1e-12)
    assert parts.item() == pytest.approx(ref, rel=1e-12)


def test_gmpo_policy_mask_row_weights_and_sequence_weight():
    # A non-policy token keeps its value in rho but gets no gradient; row weights scale l_i.
    full_logp, full_inp, full = _gmpo([[0.1, -0.2, 0.3]], [1.0])
    logp, inp, term = _gmpo([[0.1, -0.2, 0.3]], [1.0], policy_mask=t([[1, 0, 1]]), row_weights=t([2.0]))
    assert torch.allclose(term.per_token_loss, 2 * full.per_token_loss, rtol=1e-15, atol=0)
    term.per_token_loss.sum().backward()
    assert logp.grad[0, 1].item() == 0.0 and logp.grad[0, 0].item() != 0.0
    # A sequence-level correction weight w_i (constant over the row) multiplies l_i exactly.
    _, seq_inp, seq = _gmpo([[0.1, -0.2, 0.3]], [1.0], correction=t([[0.75] * 3]), correction_level="sequence")
    assert torch.equal(seq.per_token_loss, full.per_token_loss * 0.75)


def _geometric_weight(w, m):
    """§12's fold of token weights (verl ``geo_mean``): ``exp(sum_t m log(w_t + 1e-10) / (L + 1e-8))``."""
    return math.exp(sum(math.log(wt + 1e-10) * mt for wt, mt in zip(w, m)) / (sum(m) + 1e-8))


@pytest.mark.parametrize("level", ["token", "sequence"])
def test_gmpo_correction_is_the_geometric_mean_of_the_row(level):
    """§12: a token-level correction weights GMPO's ``l_i`` by the geometric mean of the row's token
    weights, a sequence-level one by the row's own weight; ``loss = (1/B) sum_i W_i l_i``. Row 0
    (A > 0): w = (2, 0.5, 4), geometric mean 4^(1/3) = 1.587 where the arithmetic one is 2.167;
    row 1 (A < 0) has a token_mask drop, w = 0; row 2 (A > 0), row 3 empty."""
    s = [[0.6, -0.9, 0.1, 0.0], [-0.6, 0.3, 0.2, 0.1], [0.25, -0.5, 0.0, 0.0], [0.5, 0.5, 0.5, 0.5]]
    adv = [1.0, -0.5, 2.0, 1.0]
    masks = [[1, 1, 1, 0], [1, 1, 1, 1], [1, 1, 0, 0], [0, 0, 0, 0]]
    if level == "token":
        w = [[2.0, 0.5, 4.0, 1.0], [0.0, 1.5, 1.0, 2.0], [0.75, 1.25, 1.0, 1.0], [3.0, 3.0, 3.0, 3.0]]
    else:  # one weight per row on its active tokens (padding carries 1, as rollout_correction_weights)
        w = [[1.875, 1.875, 1.875, 1.0], [0.0] * 4, [0.75, 0.75, 1.0, 1.0], [1.0] * 4]
    logp, inp, term = _gmpo(s, adv, mask=t(masks), correction=t(w), correction_level=level)
    loss = aggregate(term.per_token_loss, inp.mask, "grpo", norm_for(inp.mask))
    loss.backward()
    want_loss = 0.0
    for i, (si, a, m, wi) in enumerate(zip(s, adv, masks, w)):
        l_i, rho, abar = _gmpo_reference(si, [a] * 4, m, 0.4, 0.4)
        weight = _geometric_weight(wi, m) if level == "token" else wi[0]
        want_loss += weight * l_i / 4
        for j in range(4):
            clipped = (a > 0 and si[j] > 0.4) or (a < 0 and si[j] < -0.4)
            want = 0.0 if clipped or not m[j] else -abar * rho * weight / ((sum(m) + 1e-8) * 4)
            assert logp.grad[i, j].item() == pytest.approx(want, rel=1e-9, abs=1e-300), (i, j)
    if level == "token":
        assert _geometric_weight(w[0], masks[0]) == pytest.approx(4 ** (1 / 3), rel=1e-8)  # not (2+0.5+4)/3 = 2.167
        assert _geometric_weight(w[1], masks[1]) < 1e-2  # a dropped token pulls the row towards 0
    # The spec's log(w + 1e-10) against the code's log(max(w, 1e-10)), bit-exact at w = 1: a relative 1e-10 / w.
    assert loss.item() == pytest.approx(want_loss, rel=1e-9)


def test_gmpo_metrics_count_only_clipped_tokens():
    _, _, term = _gmpo([[0.6, -0.9, 0.1], [-0.6, 0.9, -0.45]], [1.0, -1.0], mask=t([[1, 1, 1], [1, 1, 0]]))
    got = totals(term)
    assert set(got) == CLIP_KEYS | {"ppo_kl"}
    # verl would count the A>0 token at s=-0.9 and the A<0 token at s=0.9; we do not.
    assert got["clip_ratio/high_mean"] == (1.0, "token")
    assert got["clip_ratio/low_mean"] == (1.0, "token")  # the masked -0.45 token does not count
    assert got["clip_ratio/region_mean"] == (2.0, "token")
    assert got["ppo_kl"][0] == pytest.approx(-(0.6 - 0.9 + 0.1 - 0.6 + 0.9), rel=1e-12)


# ------------------------------------------------------------------- DPPO §13


def _probs(p, pa):
    lp, la = [[math.log(x) for x in row] for row in p], [[math.log(x) for x in row] for row in pa]
    return t(lp, True), t(la)


def test_dppo_tv_boundary_with_dyadic_values():
    for x in (0.5, 0.75, 0.25):
        assert math.exp(math.log(x)) == x
        assert torch.exp(torch.log(t(x))).item() == x
    assert 0.65 - 0.5 > 0.15  # why non-dyadic thresholds are unsafe
    logp, anchor = _probs([[0.75, 0.75 + 1e-9, 0.05], [0.25, 0.25 - 1e-9, 0.95]], [[0.5, 0.5, 0.95], [0.5, 0.5, 0.05]])
    valid = dppo_trust_region_mask(logp, anchor, t([1.0, -1.0]), delta_low=0.25, delta_high=0.25)
    # A > 0: on the threshold kept, just over masked, a 0.9 drop kept; A < 0 mirrored.
    assert valid.tolist() == [[True, False, True], [True, False, True]]


def test_dppo_masked_tokens_zero_gradient_denominator_kept():
    logp, anchor = _probs([[0.75, 0.75 + 1e-9, 0.05]], [[0.5, 0.5, 0.95]])
    p = DppoParams(delta_low=0.25, delta_high=0.25)
    term = run("dppo", inputs(logp, anchor, t([2.0]), params=p))
    loss = aggregate(term.per_token_loss, torch.ones_like(anchor), "dapo", norm_for(torch.ones_like(anchor)))
    loss.backward()
    r0, r2 = 0.75 / 0.5, 0.05 / 0.95
    assert loss.item() == pytest.approx(-2.0 * (r0 + r2) / 3, rel=1e-12)
    assert logp.grad[0, 1].item() == 0.0
    assert logp.grad[0, 0].item() == pytest.approx(-2.0 * r0 / 3, rel=1e-12)
    assert logp.grad[0, 2].item() == pytest.approx(-2.0 * r2 / 3, rel=1e-12)
    got = totals(term)
    assert got["dppo/masked_frac"] == (1.0, "token") and got["dppo/masked_high_frac"] == (1.0, "token")
    assert got["dppo/masked_low_frac"] == (0.0, "token") and got["dppo/is_truncated_frac"] == (0.0, "token")


def test_dppo_low_probability_token_kept_and_truncated():
    logp, anchor = _probs([[1e-3]], [[1e-5]])
    adv = t([1.5])
    # PPO clip would clip r = 100 (zero gradient); TV keeps it.
    ppo = clipped_surrogate(logp, anchor, adv, mask=torch.ones_like(anchor))
    assert ppo.high_clipped.all()
    assert dppo_trust_region_mask(logp, anchor, adv).all()
    for p, clip in ((DppoParams(ratio_cap=10.0), None), (DppoParams(), ClipSettings(delta=10.0))):
        lp = logp.detach().clone().requires_grad_(True)
        term = run("dppo", inputs(lp, anchor, adv, params=p, clip=clip))
        term.per_token_loss.sum().backward()
        assert lp.grad.item() == pytest.approx(-1.5 * 10.0, rel=1e-12)
        assert term.per_token_loss.item() == pytest.approx(-1.5 * 10.0, rel=1e-12)
        assert totals(term)["dppo/is_truncated_frac"] == (1.0, "token")
    lp = logp.detach().clone().requires_grad_(True)
    term = run("dppo", inputs(lp, anchor, adv, params=DppoParams()))  # no cap: prime-rl, -A * r
    term.per_token_loss.sum().backward()
    assert lp.grad.item() == pytest.approx(-1.5 * 100.0, rel=1e-9)


def _binary_kl(p, pa):
    return pa * (math.log(pa) - math.log(p)) + (1 - pa) * math.log((1 - pa + 1e-8) / (1 - p + 1e-8))


def test_dppo_binary_kl_finite_at_certain_anchor_and_direction_override():
    # p_a = 1.0 exactly (logp_a = 0) and p = 0.999: finite thanks to the 1e-8 guards.
    logp = t([[math.log(0.999)] * 2], True)
    anchor = t([[0.0, 0.0]])
    d = _binary_kl(0.999, 1.0)
    assert math.isfinite(d) and d > 1e-4
    for adv, d_low, want in ((-1.0, 0.05, True), (-1.0, 1e-4, False), (1.0, 1e-4, True)):
        valid = dppo_trust_region_mask(logp, anchor, t([adv]), divergence="binary_kl", delta_low=d_low, delta_high=1e-4)
        assert valid.tolist() == [[want, want]]
    # Direction: A > 0 with p < p_a, and A < 0 with p > p_a, are always valid whatever D is.
    lp, la = _probs([[0.01, 0.99, 0.9], [0.99, 0.01, 0.1]], [[0.9, 0.1, 0.5], [0.1, 0.9, 0.5]])
    valid = dppo_trust_region_mask(lp, la, t([1.0, -1.0]), divergence="binary_kl", delta_low=0.05, delta_high=0.05)
    assert _binary_kl(0.01, 0.9) > 0.05 and _binary_kl(0.99, 0.1) > 0.05 and _binary_kl(0.9, 0.5) > 0.05
    assert valid.tolist() == [[True, False, False], [True, False, False]]


def test_dppo_binary_kl_masked_gradient_and_denominator():
    lp, la = _probs([[0.9, 0.55, 0.01]], [[0.5, 0.5, 0.9]])
    p = DppoParams(divergence="binary_kl", delta_low=0.05, delta_high=0.05)
    term = run("dppo", inputs(lp, la, t([1.0]), params=p))
    assert _binary_kl(0.9, 0.5) > 0.05 and _binary_kl(0.55, 0.5) <= 0.05
    mask = torch.ones_like(la)
    for loss_type in ("grpo", "dapo"):
        lp.grad = None
        loss = aggregate(term.per_token_loss, mask, loss_type, norm_for(mask))
        loss.backward(retain_graph=True)
        assert loss.item() == pytest.approx(-(0.55 / 0.5 + 0.01 / 0.9) / 3, rel=1e-12)
        assert lp.grad[0, 0].item() == 0.0 and lp.grad[0, 1].item() != 0.0


@pytest.mark.parametrize("cap", [10.0, None])
def test_dppo_gradient_beyond_the_log_ratio_clamp(cap):
    """§13: ``l = -A * valid * r * sg(min(r, C) / r)`` has gradient ``-A * min(r, C) * grad logp`` on
    every kept token. The +/-20 clamp of the log-ratio only keeps ``exp`` finite (verl's
    ``trunc_ratio``): past it the value is ``-A * min(exp(+/-20), C)`` and the gradient is verl's
    ``-A * sg(min(exp(+/-20), C)) * grad logp``, not 0. Row 0 (A > 0): log-ratios (25, 0.25, -0.5);
    row 1 (A < 0): (-25, 22, 0.125, 0); every token inside the TV region."""
    log_ratio = [[25.0, 0.25, -0.5, 0.0], [-25.0, 22.0, 0.125, 0.0]]
    logp = t([[math.log(0.1), math.log(0.5), math.log(0.25), 0.0],
              [math.log(0.1) - 25.0, math.log(0.1), math.log(0.25), math.log(0.5)]], True)
    anchor = logp.detach() - t(log_ratio)
    mask = t([[1, 1, 1, 0], [1, 1, 1, 1]])
    adv = [1.5, -0.75]
    p = DppoParams(ratio_cap=cap)
    assert dppo_trust_region_mask(logp, anchor, t(adv)).all()
    term = run("dppo", inputs(logp, anchor, t(adv), mask, params=p))
    loss = aggregate(term.per_token_loss, mask, "dapo", norm_for(mask))
    loss.backward()
    n_tok = 7
    c = math.inf if cap is None else cap
    for i, a in enumerate(adv):
        for j, x in enumerate(log_ratio[i]):
            weight = min(math.exp(min(max(x, -20.0), 20.0)), c) * mask[i, j].item()
            assert term.per_token_loss[i, j].item() == pytest.approx(-a * weight, rel=1e-12), (i, j)
            assert logp.grad[i, j].item() == pytest.approx(-a * weight / n_tok, rel=1e-12), (i, j)
    assert logp.grad[0, 0].item() != 0.0 and logp.grad[1, 0].item() != 0.0 and logp.grad[1, 1].item() != 0.0


def test_dppo_extremes_finite():
    old = t([[-1.0, -1.0], [-1.0, -60.0]])
    logp = (old + t([[50.0, -50.0], [-50.0, 50.0]])).clamp(max=0.0).detach().requires_grad_(True)
    for div in ("tv", "binary_kl"):
        term = run("dppo", inputs(logp, old, t([1.0, -1.0]), params=DppoParams(divergence=div)))
        loss = aggregate(term.per_token_loss, torch.ones_like(old), "dapo", norm_for(torch.ones_like(old)))
        (g,) = torch.autograd.grad(loss, logp)
        assert torch.isfinite(loss) and torch.isfinite(g).all()


def test_dppo_behaviour_anchor():
    logp = t([[-1.0, -0.5]], True)
    old = t([[-1.2, -0.4]])
    beh = t([[-0.9, -0.6]])
    p = DppoParams(anchor="behaviour")
    with pytest.raises(ValueError, match="behaviour_logp"):
        run("dppo", inputs(logp, old, t([1.0]), params=p))
    a = run("dppo", inputs(logp, old, t([1.0]), params=p, behaviour=beh)).per_token_loss
    b = run("dppo", inputs(logp, old + 0.3, t([1.0]), params=p, behaviour=beh)).per_token_loss
    assert torch.equal(a, b)
    want = [-math.exp(-1.0 + 0.9), -math.exp(-0.5 + 0.6)]
    assert a[0].tolist() == pytest.approx(want, rel=1e-12)


def test_dppo_gradcheck():
    old = t([[-1.0, -0.5, -2.0], [-0.3, -1.7, -0.9]])
    logp = (old + t([[0.1, -0.2, 0.05], [0.2, -0.3, 0.0]])).requires_grad_(True)
    adv = t([0.8, -1.3])
    for p in (DppoParams(), DppoParams(divergence="binary_kl", delta_low=0.05, delta_high=0.05),
              DppoParams(ratio_cap=5.0)):
        torch.autograd.gradcheck(lambda lp: run("dppo", inputs(lp, old, adv, params=p)).per_token_loss, (logp,))


def test_dppo_metrics_hand_computed():
    # Row 0 (A>0): p 0.5->0.875 masked, 0.5->0.625 kept; row 1 (A<0): 0.5->0.125 masked, 0.5->0.375 kept;
    # row 2 (A=0, negative branch): 0.5->0.125 masked; the last token of row 1 is padding (masked, not counted).
    lp, la = _probs([[0.875, 0.625], [0.125, 0.375], [0.125, 0.5]], [[0.5, 0.5], [0.5, 0.5], [0.5, 0.5]])
    lp2, la2 = lp.detach().clone(), la.clone()
    mask = t([[1, 1], [1, 1], [1, 1]])
    term = run("dppo", inputs(lp2, la2, t([1.0, -1.0, 0.0]), mask, params=DppoParams(delta_low=0.25, delta_high=0.25,
                                                                                          ratio_cap=1.125)))
    got = totals(term)
    assert set(got) == {"dppo/masked_frac", "dppo/masked_high_frac", "dppo/masked_low_frac", "dppo/is_truncated_frac",
                        "clip_ratio/low_mean", "clip_ratio/high_mean", "clip_ratio/region_mean"}
    # The clip keys carry the mask by the sign of A (the masked A = 0 token is in neither).
    assert got["clip_ratio/low_mean"] == got["dppo/masked_low_frac"]
    assert got["clip_ratio/high_mean"] == got["dppo/masked_high_frac"]
    assert got["clip_ratio/region_mean"] == (2.0, "token")
    assert got["dppo/masked_frac"] == (3.0, "token")
    assert got["dppo/masked_high_frac"] == (1.0, "token")
    assert got["dppo/masked_low_frac"] == (1.0, "token")
    assert got["dppo/is_truncated_frac"] == (1.0, "token")  # r = 1.25 > 1.125, kept
    assert set(totals(run("dppo", inputs(lp2, la2, t([1.0, -1.0, 0.0]), mask)))) == set(got)


# ------------------------------------------------------------------- OPSM §14


def test_opsm_kl_boundary_dyadic():
    anchor = t([[-1.0] * 4] * 4)
    logp = t([[-1.5] * 4, [-1.5, -1.5, -1.5, -1.5 - 2.0 ** -20], [-9.0] * 4, [-9.0] * 4], True)
    keep, kl = opsm_sequence_mask(logp, anchor, t([-1.0, -1.0, 0.0, 2.0]), torch.ones_like(anchor), 0.5)
    assert kl[0].item() == 0.5
    assert kl[1].item() == 0.5 + 2.0 ** -22
    assert keep.tolist() == [True, False, True, True]  # KL == delta kept; A >= 0 kept whatever the KL


def test_opsm_negative_kl_and_empty_row():
    anchor = t([[-2.0, -2.0], [-1.0, -1.0]])
    logp = t([[-1.0, -0.5], [5.0, -70.0]], True)
    mask = t([[1, 1], [0, 0]])
    keep, kl = opsm_sequence_mask(logp, anchor, t([-3.0, -3.0]), mask, 0.0)
    assert kl.tolist() == [-1.25, 0.0]
    assert keep.tolist() == [True, True]
    term = run("opsm", inputs(logp, anchor, t([-3.0, -3.0]), mask, params=OpsmParams(delta=0.0)))
    assert torch.isfinite(term.per_token_loss).all()


def _opsm_batch():
    anchor = t([[-1.0, -1.0, -1.0], [-1.0, -1.0, -1.0], [-1.0, -1.0, -1.0]])
    logp = t([[-1.0625, -1.125, -1.0], [-1.5, -2.0, -1.25], [-1.5, -2.0, -1.25]], True)
    mask = t([[1, 1, 1], [1, 1, 0], [1, 1, 1]])
    return logp, anchor, mask, [-1.0, -1.0, 1.0]


@pytest.mark.parametrize("loss_type", ("grpo", "bnpo"))
def test_opsm_masked_rows_zero_gradient_denominators_unchanged(loss_type):
    logp, beh, mask, adv = _opsm_batch()
    old = logp.detach().clone()  # on-policy against the trainer: ratio 1
    term = run("opsm", inputs(logp, old, t(adv), mask, behaviour=beh, params=OpsmParams(delta=0.25)))
    # KL: row 0 = 0.0625 (kept), row 1 = 0.75 with A<0 (dropped), row 2 has A>0 (kept).
    loss = aggregate(term.per_token_loss, mask, loss_type, norm_for(mask))
    loss.backward()
    per = [[-a * mk for mk in m] for a, m in zip(adv, mask.tolist())]
    per[1] = [0.0] * 3
    assert loss.item() == pytest.approx(reference_aggregate(per, mask.tolist(), loss_type, 3, 3), rel=1e-12)
    assert (logp.grad[1] == 0).all() and (logp.grad[0] != 0).all()
    plain = clipped_surrogate(logp, old, t(adv), mask=mask).per_token_loss
    assert torch.equal(term.per_token_loss[[0, 2]], (plain * mask)[[0, 2]])


def test_opsm_anchor_selection():
    logp, beh, mask, adv = _opsm_batch()
    p = OpsmParams(delta=0.25)
    with_beh = [totals(run("opsm", inputs(logp, old, t(adv), mask, behaviour=beh, params=p)))["opsm/masked_seq_frac"]
                for old in (logp.detach() - 0.5, logp.detach() + 0.5, beh)]
    assert with_beh == [(1.0, "sequence")] * 3
    # Without the sampler's log-probs the anchor is old_logp: on-policy, nothing is dropped.
    got = totals(run("opsm", inputs(logp, logp.detach(), t(adv), mask, params=p)))
    assert got["opsm/masked_seq_frac"] == (0.0, "sequence") and got["opsm/seq_kl_mean"] == (0.0, "sequence")


def test_opsm_metrics_hand_computed():
    logp, beh, mask, adv = _opsm_batch()
    mask = torch.cat([mask, t([[0, 0, 0]])])
    logp = torch.cat([logp.detach(), t([[-1.0, -1.0, -1.0]])]).requires_grad_(True)
    beh = torch.cat([beh, t([[-1.0, -1.0, -1.0]])])
    old = torch.cat([beh[:3] + t([[0.0, 0.0, 0.0], [0.0, 0.0, 0.0], [1.0, 0.0, 0.0]]), beh[3:]])
    adv = adv + [-1.0]
    term = run("opsm", inputs(logp, old, t(adv), mask, behaviour=beh, params=OpsmParams(delta=0.25)))
    got = totals(term)
    assert set(got) == {"opsm/masked_seq_frac", "opsm/masked_token_frac", "opsm/seq_kl_mean"} | CLIP_KEYS
    assert got["opsm/masked_seq_frac"] == (1.0, "sequence")
    assert got["opsm/masked_token_frac"] == (2.0, "token")
    assert got["opsm/seq_kl_mean"][0] == pytest.approx((0.0625 + 0.125 + 0.0) / 3 + 0.75 + (0.5 + 1 + 0.25) / 3,
                                                       rel=1e-12)
    assert got["opsm/seq_kl_mean"][1] == "sequence"
    # The clip fractions are the surrogate's, dropped rows included: row 1 (A<0) has ratios exp(-0.5),
    # exp(-1) < 0.8 (2 low-clipped tokens); row 0 (A<0) exp(-0.0625), exp(-0.125) >= 0.8; row 2 (A>0)
    # ratios exp(-1.5), exp(-1), exp(-0.25) <= 1.2.
    assert got["clip_ratio/low_mean"] == (2.0, "token") and got["clip_ratio/high_mean"] == (0.0, "token")
    assert got["clip_ratio/region_mean"] == (2.0, "token")


def test_opsm_gradcheck():
    logp, beh, mask, adv = _opsm_batch()
    old = logp.detach() + t([[0.05, -0.1, 0.0], [0.1, 0.05, 0.0], [-0.05, 0.1, 0.02]])
    torch.autograd.gradcheck(
        lambda lp: run("opsm", inputs(lp, old, t(adv), mask, behaviour=beh, params=OpsmParams(0.25))).per_token_loss,
        (logp.detach().clone().requires_grad_(True),))


# ------------------------------------------------------------- shared checks


@pytest.mark.parametrize("name", ["sapo", "gmpo", "dppo", "opsm"])
def test_same_metric_keys_every_call_and_zero_sequence_loss(name):
    logp, beh, mask, adv = _opsm_batch()
    keys = set()
    for behaviour in (None, beh):
        for a in (adv, [0.0, 0.0, 0.0]):
            p = DppoParams(ratio_cap=2.0) if name == "dppo" and behaviour is not None else None
            term = run(name, inputs(logp, logp.detach(), t(a), mask, behaviour=behaviour, params=p))
            keys.add(tuple(term.metrics))
            assert term.sequence_loss.item() == 0.0 and term.per_token_loss.shape == logp.shape
    assert len(keys) == 1


@pytest.mark.parametrize("name", ["sapo", "gmpo", "dppo", "opsm"])
def test_on_policy_first_step_gradient_is_vanilla_policy_gradient(name):
    # logp == old (and the sampler == trainer): every surrogate reduces to -A * grad logp per token
    # (GMPO up to its 1e-8 length guard).
    logp, _, mask, adv = _opsm_batch()
    old = logp.detach().clone()
    term = run(name, inputs(logp, old, t(adv), mask, behaviour=old))
    loss = aggregate(term.per_token_loss, mask, "grpo", norm_for(mask))
    loss.backward()
    m = mask.tolist()
    for i, a in enumerate(adv):
        for j in range(3):
            want = -a * m[i][j] / (3 * sum(m[i]))
            assert logp.grad[i, j].item() == pytest.approx(want, rel=1e-7 if name == "gmpo" else 1e-12, abs=1e-15)
