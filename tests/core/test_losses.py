import math

import pytest
import torch

from maxent_grpo.core.losses import (
    KL_ESTIMATORS,
    LOSS_AGGREGATIONS,
    POLICY_LOSSES,
    ClipSettings,
    PolicyInputs,
    StepNormalizer,
    aggregate,
    clipped_surrogate,
    kl_penalty,
)
from maxent_grpo.core.listwise import (
    ListwiseParams,
    listwise_centered_mle,
    listwise_cross_entropy,
    listwise_weighted_mle,
    sequence_scores,
)
from maxent_grpo.core.entropy_terms import entropy_bonus, top_entropy_mask

F64 = torch.float64


def _ratios_and_logps(ratios, dtype=F64):
    old = torch.full((1, len(ratios)), -1.0, dtype=dtype)
    logp = (old + torch.log(torch.tensor([ratios], dtype=dtype))).requires_grad_(True)
    return logp, old


# ------------------------------------------------------------------------- KL


def test_kl_estimators_match_formulas():
    logp = torch.tensor([-1.0, -2.0, -0.1, -5.0], dtype=F64)
    ref = torch.tensor([-1.5, -1.0, -0.1, -2.0], dtype=F64)
    for i in range(4):
        ratio = math.exp(ref[i].item()) / math.exp(logp[i].item())  # pi_ref / pi
        want = {"k1": -math.log(ratio), "k2": 0.5 * math.log(ratio) ** 2, "k3": ratio - math.log(ratio) - 1}
        for name, value in want.items():
            assert kl_penalty(logp, ref, name)[i].item() == pytest.approx(value, rel=1e-12, abs=1e-15)
    assert (kl_penalty(logp, ref, "k3") >= 0).all()
    assert sorted(KL_ESTIMATORS) == ["k1", "k2", "k3"]
    with pytest.raises(ValueError, match="estimator"):
        kl_penalty(logp, ref, "k4")


def test_k3_precise_near_zero():
    d = 1e-9
    got = kl_penalty(torch.tensor([0.0], dtype=torch.float32), torch.tensor([d], dtype=torch.float32), "k3")
    assert got.item() == pytest.approx(d * d / 2, rel=1e-3)


# ---------------------------------------------------------- clipped surrogate

RATIOS = [0.5, 0.79, 0.9, 1.0, 1.1, 1.25, 2.0, 5.0]


@pytest.mark.parametrize("adv", [1.5, -0.7])
def test_surrogate_values_match_reference(adv):
    logp, old = _ratios_and_logps(RATIOS)
    terms = clipped_surrogate(logp, old, torch.tensor([adv], dtype=F64), mask=torch.ones(1, 8, dtype=F64),
                              epsilon_low=0.2, epsilon_high=0.28)
    for t, c in enumerate(RATIOS):
        clipped = min(max(c, 0.8), 1.28)
        assert terms.per_token_loss[0, t].item() == pytest.approx(-min(c * adv, clipped * adv), rel=1e-12)


def _token_grads(surrogate_fn, adv):
    logp, old = _ratios_and_logps(RATIOS)
    loss = surrogate_fn(logp, old, torch.tensor([adv], dtype=F64))
    loss.sum().backward()
    return logp.grad[0]


def _ours(logp, old, adv):
    return clipped_surrogate(logp, old, adv, mask=torch.ones_like(logp)).per_token_loss


def _published_max_bug(logp, old, adv):
    # Some published code takes max for A<0: the test below must reject it.
    c = torch.exp(logp - old)
    a = adv[:, None]
    lo, hi = c * a, torch.clamp(c, 0.8, 1.2) * a
    return -torch.where(a < 0, torch.maximum(lo, hi), torch.minimum(lo, hi))


def _clip_gradient_pattern_holds(surrogate_fn) -> bool:
    r = torch.tensor(RATIOS, dtype=F64)
    g_neg = _token_grads(surrogate_fn, -1.0)
    g_pos = _token_grads(surrogate_fn, 1.0)
    return bool(
        (g_neg[r < 0.8] == 0).all() and (g_neg[r > 1.2] != 0).all()
        and (g_pos[r > 1.2] == 0).all() and (g_pos[r < 0.8] != 0).all()
        and (g_neg[(r > 0.8) & (r < 1.2)] != 0).all()
    )


def test_clip_gradient_zero_only_on_the_pessimistic_side():
    assert _clip_gradient_pattern_holds(_ours)
    assert not _clip_gradient_pattern_holds(_published_max_bug)


def test_on_policy_ratio_gives_plain_policy_gradient():
    # old = logp.detach(): ratio 1 and d loss / d logp = -A exactly.
    logp = torch.randn(2, 5, dtype=F64, requires_grad=True)
    adv = torch.tensor([0.3, -2.0], dtype=F64)
    terms = clipped_surrogate(logp, logp.detach(), adv, mask=torch.ones(2, 5, dtype=F64))
    terms.per_token_loss.sum().backward()
    torch.testing.assert_close(logp.grad, -adv[:, None].expand(2, 5))
    assert torch.equal(terms.ratio, torch.ones(2, 5, dtype=F64))


def test_delta_caps_unclipped_branch():
    logp, old = _ratios_and_logps([1.5, 4.0])
    terms = clipped_surrogate(logp, old, torch.tensor([-1.0], dtype=F64), mask=torch.ones(1, 2, dtype=F64), delta=2.0)
    assert terms.per_token_loss[0].tolist() == pytest.approx([1.5, 2.0])
    terms.per_token_loss.sum().backward()
    assert logp.grad[0, 1] == 0 and logp.grad[0, 0] != 0
    with pytest.raises(ValueError, match="delta"):
        clipped_surrogate(logp, old, torch.tensor([1.0], dtype=F64), mask=torch.ones(1, 2), delta=1.1)


def test_dual_clip_bounds_negative_advantage_loss():
    logp, old = _ratios_and_logps([2.0, 5.0])
    adv = torch.tensor([-1.0], dtype=F64)
    terms = clipped_surrogate(logp, old, adv, mask=torch.ones(1, 2, dtype=F64), dual_clip=3.0)
    assert terms.per_token_loss[0].tolist() == pytest.approx([2.0, 3.0])
    terms.per_token_loss.sum().backward()
    assert logp.grad[0, 1] == 0 and logp.grad[0, 0] != 0
    # A > 0 is untouched by the dual clip.
    logp2, old2 = _ratios_and_logps([5.0])
    pos = clipped_surrogate(logp2, old2, torch.tensor([1.0], dtype=F64), mask=torch.ones(1, 1), dual_clip=3.0)
    assert pos.per_token_loss.item() == pytest.approx(-1.2)


def test_clip_fraction_masks_follow_trl():
    logp, old = _ratios_and_logps([0.5, 0.5, 1.5, 1.5])
    logp = logp.detach().expand(2, 4)
    old = old.expand(2, 4)
    adv = torch.tensor([-1.0, 1.0], dtype=F64)
    mask = torch.tensor([[1, 1, 1, 0], [1, 1, 1, 1]], dtype=F64)
    t = clipped_surrogate(logp, old, adv, mask=mask)
    assert t.low_clipped.tolist() == [[True, True, False, False], [False] * 4]
    assert t.high_clipped.tolist() == [[False] * 4, [False, False, True, True]]
    assert torch.equal(t.region_clipped, t.low_clipped | t.high_clipped)


def _gspo_reference_dapo(logp, old, adv, mask, eps):
    """TRL's sequence form in float64: s_i = exp(mean_t) differentiated through the mean, dapo sum."""
    s = torch.exp(((logp - old) * mask).sum(-1) / mask.sum(-1))
    per_seq = -torch.min(s * adv, torch.clamp(s, 1 - eps, 1 + eps) * adv)
    return (per_seq * mask.sum(-1)).sum() / mask.sum()


def test_gspo_value_and_gradient_match_float64_reference():
    gen = torch.Generator().manual_seed(3)
    logp = -torch.rand(4, 6, generator=gen, dtype=F64) * 3
    old = logp + 0.25 * torch.randn(4, 6, generator=gen, dtype=F64)
    mask = torch.tensor([[1] * 6, [1] * 3 + [0] * 3, [1] * 5 + [0], [1, 0, 0, 0, 0, 0]], dtype=F64)
    adv = torch.tensor([1.0, -0.5, 2.0, -1.5], dtype=F64)
    norm = StepNormalizer(num_sequences=4, num_tokens=int(mask.sum()), num_micro_batches=1)

    a = logp.clone().requires_grad_(True)
    terms = clipped_surrogate(a, old, adv, mask=mask, importance_sampling_level="sequence")
    loss = aggregate(terms.per_token_loss, mask, "dapo", norm)
    loss.backward()
    b = logp.clone().requires_grad_(True)
    ref = _gspo_reference_dapo(b, old, adv, mask, 0.2)
    ref.backward()
    assert loss.item() == pytest.approx(ref.item(), rel=1e-12)
    torch.testing.assert_close(a.grad * mask, b.grad, rtol=1e-10, atol=1e-14)
    # One ratio per sequence, on every token; masked tokens do not enter it.
    s = torch.exp(((logp - old) * mask).sum(-1) / mask.sum(-1))
    torch.testing.assert_close(terms.ratio, s[:, None].expand(4, 6))
    # At least one sequence clipped (zero grad) and one not, so the test is not vacuous.
    clipped_rows = terms.region_clipped.any(-1)
    assert clipped_rows.any() and not clipped_rows.all()


# ------------------------------------------------------------------ aggregation


def _agg_reference(loss_type, per_token, mask, num_micro_batches=1, l_max=None):
    rows = [(sum(l * m for l, m in zip(lr, mr)), sum(mr)) for lr, mr in zip(per_token.tolist(), mask.tolist())]
    if loss_type == "grpo":
        return sum(s / t for s, t in rows if t > 0) / len(rows)
    if loss_type == "bnpo":
        return sum(s for s, _ in rows) / max(sum(t for _, t in rows), 1) / num_micro_batches
    if loss_type == "dr_grpo":
        return sum(s for s, _ in rows) / (len(rows) * l_max)
    if loss_type == "luspo":  # per-sequence sums, the mean over all the step's sequences
        return sum(s for s, _ in rows) / len(rows)
    return sum(s for s, _ in rows) / max(sum(t for _, t in rows), 1)


LENGTH_MASK = torch.tensor(
    [[1, 1, 1, 1, 1, 1], [1, 1, 0, 0, 0, 0], [0, 0, 0, 0, 0, 0], [1, 1, 1, 1, 0, 0],
     [1, 0, 0, 0, 0, 0], [1, 1, 1, 1, 1, 0], [1, 1, 1, 0, 0, 0], [1, 1, 1, 1, 1, 1]], dtype=F64)


@pytest.mark.parametrize("loss_type", sorted(LOSS_AGGREGATIONS))
def test_aggregation_matches_reference_and_handles_empty_rows(loss_type):
    per_token = torch.randn(8, 6, dtype=F64)
    norm = StepNormalizer(num_sequences=8, num_tokens=int(LENGTH_MASK.sum()), num_micro_batches=1,
                          max_completion_length=8)
    got = aggregate(per_token, LENGTH_MASK, loss_type, norm)
    assert got.item() == pytest.approx(_agg_reference(loss_type, per_token, LENGTH_MASK, l_max=8), rel=1e-12)
    empty = aggregate(per_token, torch.zeros(8, 6, dtype=F64), loss_type,
                      StepNormalizer(8, 0, 1, max_completion_length=8))
    assert empty.item() == 0.0


@pytest.mark.parametrize("loss_type", ["grpo", "dr_grpo", "dapo", "luspo"])
def test_step_invariant_aggregations_sum_over_micro_batches(loss_type):
    per_token = torch.randn(8, 6, dtype=F64)
    norm = StepNormalizer(8, int(LENGTH_MASK.sum()), 4, max_completion_length=6)
    whole = aggregate(per_token, LENGTH_MASK, loss_type, StepNormalizer(8, int(LENGTH_MASK.sum()), 1, 6))
    parts = sum(aggregate(per_token[i : i + 2], LENGTH_MASK[i : i + 2], loss_type, norm) for i in range(0, 8, 2))
    assert parts.item() == pytest.approx(whole.item(), rel=1e-12)


def test_bnpo_depends_on_micro_batching():
    per_token = torch.randn(8, 6, dtype=F64, generator=torch.Generator().manual_seed(1))
    tokens = int(LENGTH_MASK.sum())
    whole = aggregate(per_token, LENGTH_MASK, "bnpo", StepNormalizer(8, tokens, 1))
    norm = StepNormalizer(8, tokens, 4)
    parts = sum(aggregate(per_token[i : i + 2], LENGTH_MASK[i : i + 2], "bnpo", norm) for i in range(0, 8, 2))
    want = sum(_agg_reference("bnpo", per_token[i : i + 2], LENGTH_MASK[i : i + 2], 4) for i in range(0, 8, 2))
    assert parts.item() == pytest.approx(want, rel=1e-12)
    assert abs(parts.item() - whole.item()) > 1e-3


def test_aggregation_errors():
    with pytest.raises(ValueError, match="loss_type"):
        aggregate(torch.zeros(1, 1), torch.ones(1, 1), "mean", StepNormalizer(1, 1, 1))
    with pytest.raises(ValueError, match="max_completion_length"):
        aggregate(torch.zeros(1, 1), torch.ones(1, 1), "dr_grpo", StepNormalizer(1, 1, 1))
    with pytest.raises(ValueError, match="num_tokens"):
        StepNormalizer(1, -1, 1)


# ------------------------------------------------------------ entropy terms


def test_top_entropy_mask_keeps_top_fraction_of_active_tokens():
    ent = torch.tensor([[0.1, 0.9, 0.5, 9.0], [0.3, 0.7, 0.2, 0.8]])
    mask = torch.tensor([[1, 1, 1, 0], [1, 1, 1, 1]], dtype=torch.float32)  # 9.0 is padding
    assert torch.equal(top_entropy_mask(ent, mask, 1.0), mask)
    kept = top_entropy_mask(ent, mask, 0.5)  # 7 active -> ceil(3.5) = 4 highest
    active = sorted(ent[mask > 0].tolist(), reverse=True)
    expected = (ent >= active[3]) & (mask > 0)
    assert torch.equal(kept, expected.float())
    assert kept.sum() == 4 and kept[0, 3] == 0
    assert top_entropy_mask(ent, mask, 0.01).sum() == 1
    with pytest.raises(ValueError, match="quantile"):
        top_entropy_mask(ent, mask, 0.0)


def test_entropy_bonus_aggregates_like_the_loss():
    ent = torch.tensor([[2.0, 2.0, 2.0, 2.0], [6.0, 0.0, 0.0, 0.0]], dtype=F64)
    mask = torch.tensor([[1, 1, 1, 1], [1, 0, 0, 0]], dtype=F64)
    norm = StepNormalizer(2, 5, 1, max_completion_length=4)
    log_v = math.log(100)
    seq_means = (2.0 + 6.0) / 2 / log_v
    token_mean = (8.0 + 6.0) / 5 / log_v
    assert entropy_bonus(ent, mask, 100, "grpo", norm).item() == pytest.approx(seq_means)
    assert entropy_bonus(ent, mask, 100, "dr_grpo", norm).item() == pytest.approx(seq_means)
    assert entropy_bonus(ent, mask, 100, "dapo", norm).item() == pytest.approx(token_mean)
    assert entropy_bonus(ent, mask, 100, "bnpo", norm).item() == pytest.approx(token_mean)
    # A uniform distribution over V gives B = 1.
    uniform = torch.full((1, 3), math.log(100), dtype=F64)
    assert entropy_bonus(uniform, torch.ones(1, 3), 100, "dapo", StepNormalizer(1, 3, 1)).item() == pytest.approx(1)


# ---------------------------------------------------------------- listwise


def _listwise_setup():
    gen = torch.Generator().manual_seed(5)
    s = torch.randn(3, 4, generator=gen, dtype=F64, requires_grad=True)
    w = torch.softmax(torch.randn(3, 4, generator=gen, dtype=F64), -1).requires_grad_(True)
    active = torch.tensor([True, False, True])
    return s, w, active


def test_listwise_cross_entropy_value_and_gradient():
    s, w, active = _listwise_setup()
    num_groups = 5  # the step's active groups, more than this micro-batch holds
    loss = listwise_cross_entropy(s, w, active, num_groups)
    want = 0.0
    for g in (0, 2):
        z = s[g].tolist()
        lse = math.log(sum(math.exp(v) for v in z))
        want += -sum(wi * (zi - lse) for wi, zi in zip(w[g].tolist(), z))
    assert loss.item() == pytest.approx(want / num_groups, rel=1e-12)
    loss.backward()
    p = torch.softmax(s.detach(), -1)
    expected = (p - w.detach()) / num_groups * active[:, None]
    torch.testing.assert_close(s.grad, expected)
    assert w.grad is None or torch.equal(w.grad, torch.zeros_like(w))


def test_listwise_weighted_mle_value_and_gradient():
    s, w, active = _listwise_setup()
    loss = listwise_weighted_mle(s, w, active, 2)
    assert loss.item() == pytest.approx(-(w[0] @ s[0] + w[2] @ s[2]).item() / 2)
    loss.backward()
    torch.testing.assert_close(s.grad, -w.detach() / 2 * active[:, None])
    with pytest.raises(ValueError, match="active"):
        listwise_weighted_mle(s, w, active.float(), 2)


def test_listwise_centered_mle_value_and_gradient():
    """-sum_i (w_i - 1/G) s_i per active group: its gradient sums to 0 over each group, and a
    completion weighted below 1/G is pushed down (d loss / d s_i > 0), unlike the weighted MLE."""
    s, w, active = _listwise_setup()
    loss = listwise_centered_mle(s, w, active, 2)
    want = sum(-sum((wi - 0.25) * si for wi, si in zip(w[g].tolist(), s[g].tolist())) for g in (0, 2)) / 2
    assert loss.item() == pytest.approx(want, rel=1e-12)
    loss.backward()
    expected = -(w.detach() - 0.25) / 2 * active[:, None]
    torch.testing.assert_close(s.grad, expected)
    torch.testing.assert_close(s.grad.sum(-1), torch.zeros(3, dtype=F64))
    below = (w.detach() < 0.25) & active[:, None]
    assert bool(below.any()) and bool((s.grad[below] > 0).all())
    # Uniform weights train nothing.
    s2 = s.detach().clone().requires_grad_(True)
    listwise_centered_mle(s2, torch.full((3, 4), 0.25, dtype=F64), active, 2).backward()
    assert torch.equal(s2.grad, torch.zeros_like(s2))


def test_sequence_scores_mean_and_sum():
    logp = torch.tensor([[-1.0, -2.0, -3.0], [-0.5, 0.0, 0.0], [0.0, 0.0, 0.0]], dtype=F64)
    mask = torch.tensor([[1, 1, 0], [1, 0, 0], [0, 0, 0]], dtype=F64)
    torch.testing.assert_close(sequence_scores(logp, mask), torch.tensor([-1.5, -0.5, 0.0], dtype=F64))
    torch.testing.assert_close(sequence_scores(logp, mask, "sum"), torch.tensor([-3.0, -0.5, 0.0], dtype=F64))
    with pytest.raises(ValueError, match="score"):
        ListwiseParams(score="max")


# ------------------------------------------------------------ policy registry


def _inputs(**kw):
    logp = torch.randn(4, 3, dtype=F64, requires_grad=True)
    mask = torch.ones(4, 3, dtype=F64)
    base = dict(logp=logp, old_logp=logp.detach(), mask=mask, policy_mask=mask,
                advantages=torch.tensor([1.0, -1.0, 0.5, 0.0], dtype=F64), num_generations=2, clip=ClipSettings())
    return PolicyInputs(**(base | kw))


def test_policy_registry_and_row_weights():
    assert {"clipped_surrogate", "listwise_cross_entropy", "listwise_weighted_mle",
            "listwise_centered_mle"} <= set(POLICY_LOSSES)
    norm = StepNormalizer(4, 12, 1)
    plain = POLICY_LOSSES["clipped_surrogate"](_inputs(), norm)
    rw = torch.tensor([2.0, 0.0, 1.0, 3.0], dtype=F64)
    weighted = POLICY_LOSSES["clipped_surrogate"](_inputs(row_weights=rw), norm)
    torch.testing.assert_close(weighted.per_token_loss, plain.per_token_loss * rw[:, None])
    assert plain.sequence_loss.item() == 0


def test_listwise_policy_with_clip_term_uses_weight_minus_uniform():
    w = torch.tensor([0.7, 0.3, 0.5, 0.5], dtype=F64)
    active = torch.tensor([True, False])
    inputs = _inputs(listwise_weights=w, listwise_active=active, params=ListwiseParams(clip_coef=0.5))
    term = POLICY_LOSSES["listwise_cross_entropy"](inputs, StepNormalizer(4, 12, 1, num_groups=1))
    # on-policy ratio 1: per-token loss = -coef * (w - 1/G), inactive group 0.
    want = -0.5 * torch.tensor([0.2, -0.2, 0.0, 0.0], dtype=F64)[:, None].expand(4, 3)
    torch.testing.assert_close(term.per_token_loss, want)
    with pytest.raises(ValueError, match="listwise_weights"):
        POLICY_LOSSES["listwise_weighted_mle"](_inputs(params=ListwiseParams()), StepNormalizer(4, 12, 1))


def test_reward_entropy_bonus_stays_on_when_equal_rewards_have_a_rounding_std():
    """Twelve rewards of 0.1 have a float std of ~1e-17, not 0: sigma_r must still be taken as 1."""
    from maxent_grpo.core.reward_entropy import entropy_bonus_rewards

    rewards = torch.full((3, 4), 0.1, dtype=torch.float64)
    assert 0 < float(rewards.reshape(-1).std()) < 1e-15  # the rounding this test is about
    entropy = torch.tensor([[1.0, 2.0, 3.0, 4.0]] * 3, dtype=torch.float64)
    out = entropy_bonus_rewards(rewards, entropy, coef=0.5)
    z = (entropy - entropy.mean(1, keepdim=True)) / entropy.std(1, keepdim=True)
    torch.testing.assert_close(out, rewards + 0.5 * 1.0 * z, rtol=0, atol=1e-12)
    # With a real spread, sigma_r is the batch reward std.
    varied = rewards + torch.tensor([[0.0, 1.0, 0.0, 1.0]] * 3, dtype=torch.float64)
    torch.testing.assert_close(entropy_bonus_rewards(varied, entropy, 0.5), varied + 0.5 * varied.reshape(-1).std() * z)


# ---------------------------------------------------------------- CISPO


@pytest.mark.parametrize("level", ["token", "sequence"])
def test_cispo_gradient_matches_a_float64_reference_token_by_token(level):
    """d loss / d logp_t = -min(r, eps_max) * A_i / num_tokens: the capped weight is a constant."""
    from maxent_grpo.core.losses import POLICY_LOSSES, ClipSettings, PolicyInputs, StepNormalizer, aggregate

    gen = torch.Generator().manual_seed(11)
    b, t, eps_max = 4, 6, 1.5
    old = -torch.rand(b, t, generator=gen, dtype=F64) * 3
    logp = (old + torch.randn(b, t, generator=gen, dtype=F64) * 0.8).requires_grad_(True)
    mask = torch.ones(b, t, dtype=F64)
    mask[1, 4:] = 0
    mask[3, 2:] = 0
    adv = torch.tensor([1.0, -0.5, 0.7, -2.0], dtype=F64)
    norm = StepNormalizer(num_sequences=b, num_tokens=int(mask.sum()), num_micro_batches=1)
    term = POLICY_LOSSES["cispo"](PolicyInputs(
        logp=logp, old_logp=old, mask=mask, policy_mask=mask, advantages=adv, num_generations=2,
        clip=ClipSettings(epsilon_low=0.2, epsilon_high=eps_max, importance_sampling_level=level),
    ), norm)
    aggregate(term.per_token_loss, mask, "dapo", norm).backward()
    n = int(mask.sum())
    for i in range(b):
        active = [j for j in range(t) if mask[i, j] > 0]
        seq_ratio = math.exp(sum(logp[i, j].item() - old[i, j].item() for j in active) / len(active))
        for j in range(t):
            r = math.exp(logp[i, j].item() - old[i, j].item()) if level == "token" else seq_ratio
            want = -min(r, eps_max) * adv[i].item() / n if mask[i, j] > 0 else 0.0
            assert logp.grad[i, j].item() == pytest.approx(want, rel=1e-12, abs=1e-15)
    from maxent_grpo.core.losses import cispo_surrogate

    terms = cispo_surrogate(logp, old, adv, mask=mask, epsilon_max=eps_max, importance_sampling_level=level)
    r = terms.ratio
    assert torch.equal(terms.high_clipped, (mask > 0) & (adv[:, None] > 0) & (r > eps_max))
    assert not terms.low_clipped.any()
    assert term.metrics["clip_ratio/high_mean"].total.item() == terms.high_clipped.sum().item()
    if level == "token":
        assert terms.high_clipped.any()  # the cap is reached: the test covers both branches


def test_cispo_is_one_registered_method():
    """Adding CISPO: its Method entry (preset, policy loss) and the loss in POLICY_LOSSES; nothing else."""
    from maxent_grpo.methods import get_method
    from maxent_grpo.config.load import load_config

    from tiny_runs import compiled

    cfg = load_config(overrides=["method=cispo"])
    assert (cfg.loss.loss_type, cfg.loss.epsilon_high) == ("dapo", 5.0)
    plan = compiled(overrides=["method=cispo"]).method
    assert get_method("cispo").family == "grpo"
    assert plan.loss.policy_loss == "cispo" and plan.loss.clip.epsilon_high == 5.0 and not plan.needs_reference
