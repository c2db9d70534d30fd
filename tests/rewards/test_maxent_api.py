"""The seed-facing API in maxent_grpo.rewards.maxent, against float64 references written per group."""

from __future__ import annotations

import math

import pytest
import torch

from maxent_grpo.rewards import maxent as mx
from maxent_grpo.rewards.maxent import (
    ControllerMetaSettings,
    ControllerState,
    KlControllerSettings,
    QDistributionSettings,
    ReferenceLogprobs,
    SeedGrpoInputs,
    TauSchedule,
    WeightingSettings,
    WeightLoggingView,
    WeightNormalizationSettings,
    WeightStats,
)

NAN = float("nan")


def ref_softmax(xs):
    m = max(xs)
    es = [math.exp(x - m) for x in xs]
    return [e / sum(es) for e in es]


def ref_grpo(rewards):
    """GRPO advantages of one group, scale_rewards='group', NaN rows left out and given 0."""
    known = [r for r in rewards if not math.isnan(r)]
    n = len(known)
    mean = sum(known) / n
    std = math.sqrt(sum((r - mean) ** 2 for r in known) / (n - 1)) if n > 1 else 0.0
    if n < 2 or max(known) == min(known):
        return [0.0] * len(rewards)
    return [0.0 if math.isnan(r) else (r - mean) / (std + 1e-4) for r in rewards]


def ref_q(rewards, temp, eps):
    g = len(rewards)
    e = min(eps, 1 / g - 1e-8)
    return [(1 - g * e) * v + e for v in ref_softmax([(0.0 if math.isnan(r) else r) / temp for r in rewards])]


def ref_seed_scale(ids, logps, counts, alpha):
    l = [lp / max(c, 1) for lp, c in zip(logps, counts)]
    m = max(l)
    mass: dict[int, float] = {}
    for cid, li in zip(ids, l):
        mass[cid] = mass.get(cid, 0.0) + math.exp(li - m)
    tot = sum(mass.values())
    h = -sum(v / tot * math.log(v / tot) for v in mass.values())
    return 1 / (1 + alpha / math.log(len(ids)) * h)


def batch(p=3, g=4, k=2, seed=0):
    gen = torch.Generator().manual_seed(seed)
    per_function = torch.randint(0, 3, (p * g, k), generator=gen).to(torch.float64)
    per_function[1, :] = NAN  # a row with no applicable reward
    per_function[2, 1] = NAN  # one function not applicable
    per_function[g:2 * g, :] = 1.0  # a zero-std group
    return per_function


def _cfg(**kw) -> WeightingSettings:
    return WeightingSettings(tau=kw.pop("tau", 0.5), beta=kw.pop("beta", 0.0), **kw)


# ---------------------------------------------------------------- reward statistics


def test_compute_reward_statistics_matches_reference():
    pf, weights, g = batch(), [1.0, 0.5], 4
    rc = mx.compute_reward_statistics(pf, weights, g, q_temperature=0.7, q_epsilon=1e-3, names=["acc", "fmt"])
    assert rc.reward_names == ("acc", "fmt")
    totals = []
    for row in pf.tolist():
        vals = [w * v for w, v in zip(weights, row) if not math.isnan(v)]
        totals.append(sum(vals) if vals else NAN)
    got = rc.total.tolist()
    assert [math.isnan(t) for t in got] == [math.isnan(t) for t in totals]
    assert [t for t in got if not math.isnan(t)] == pytest.approx([t for t in totals if not math.isnan(t)])
    for p in range(3):
        grp = totals[p * g:(p + 1) * g]
        assert rc.advantages[p * g:(p + 1) * g].tolist() == pytest.approx(ref_grpo(grp), abs=1e-9)
        assert rc.q[p].tolist() == pytest.approx(ref_q(grp, 0.7, 1e-3), abs=1e-9)
    assert rc.advantages[1] == 0.0
    assert rc.zero_std.tolist() == [False, True, False]
    assert rc.frac_zero_std == pytest.approx(1 / 3)
    assert rc.seed_scales is None
    assert rc.group_std[1] == 0.0
    known = [t for t in totals if not math.isnan(t)]
    mean = sum(known) / len(known)
    assert rc.train_reward_mean == pytest.approx(mean)
    assert rc.train_reward_std == pytest.approx(math.sqrt(sum((t - mean) ** 2 for t in known) / (len(known) - 1)))


def test_truncated_completions_get_zero_reward():
    pf = torch.tensor([[1.0], [1.0], [0.5], [1.0]], dtype=torch.float64)
    truncated = torch.tensor([False, True, False, False])
    rc = mx.compute_reward_statistics(pf, [1.0], 2, q_temperature=1.0, q_epsilon=0.0, truncated=truncated,
                                      zero_truncated_completion_rewards=True)
    assert rc.total.tolist() == [1.0, 0.0, 0.5, 1.0]
    ignored = mx.compute_reward_statistics(pf, [1.0], 2, q_temperature=1.0, q_epsilon=0.0, truncated=truncated)
    assert ignored.total.tolist() == [1.0, 1.0, 0.5, 1.0]
    with pytest.raises(ValueError, match="truncated"):
        mx.compute_reward_statistics(pf, [1.0], 2, q_temperature=1.0, q_epsilon=0.0,
                                     zero_truncated_completion_rewards=True)


def test_seed_scales_multiply_advantages():
    pf, g = batch(seed=1), 4
    gen = torch.Generator().manual_seed(5)
    seed = SeedGrpoInputs(
        cluster_ids=torch.randint(0, 2, (12,), generator=gen),
        seq_logps=-torch.rand(12, generator=gen, dtype=torch.float64) * 30,
        token_counts=torch.randint(1, 20, (12,), generator=gen),
        alpha=0.5,
    )
    plain = mx.compute_reward_statistics(pf, [1.0, 1.0], g, q_temperature=1.0, q_epsilon=1e-6)
    rc = mx.compute_reward_statistics(pf, [1.0, 1.0], g, q_temperature=1.0, q_epsilon=1e-6, seed_grpo=seed)
    for p in range(3):
        sl = slice(p * g, (p + 1) * g)
        scale = ref_seed_scale(seed.cluster_ids[sl].tolist(), seed.seq_logps[sl].tolist(),
                               seed.token_counts[sl].tolist(), 0.5)
        assert float(rc.seed_scales[p]) == pytest.approx(scale, abs=1e-9)
        assert rc.advantages[sl].tolist() == pytest.approx((plain.advantages[sl] * scale).tolist(), abs=1e-9)
    assert torch.equal(rc.q, plain.q)


def test_estimator_and_scaling_pass_through():
    pf = torch.tensor([[0.0], [1.0], [3.0], [2.0], [2.0], [6.0]], dtype=torch.float64)
    rc = mx.compute_reward_statistics(pf, [1.0], 3, q_temperature=1.0, q_epsilon=0.0,
                                      scale_rewards="none", advantage_estimator="rloo")
    # leave-one-out baseline: r_i - mean of the others
    expect = [0 - 2.0, 1 - 1.5, 3 - 0.5, 2 - 4.0, 2 - 4.0, 6 - 2.0]
    assert rc.advantages.tolist() == pytest.approx(expect, abs=1e-12)


def test_reward_statistics_reject_bad_shapes():
    with pytest.raises(ValueError, match="num_generations"):
        mx.compute_reward_statistics(torch.ones(4, 1), [1.0], 1, q_temperature=1.0, q_epsilon=0.0)
    with pytest.raises(ValueError, match="num_generations"):
        mx.compute_reward_statistics(torch.ones(5, 1), [1.0], 2, q_temperature=1.0, q_epsilon=0.0)
    with pytest.raises(ValueError, match="names"):
        mx.compute_reward_statistics(torch.ones(4, 2), [1.0, 1.0], 2, q_temperature=1.0, q_epsilon=0.0, names=["a"])


def test_policy_entropy_bonus_recomputes_everything():
    pf, g, coef = batch(seed=2), 4, 0.3
    seed = SeedGrpoInputs(torch.arange(12) % 3, -torch.rand(12, dtype=torch.float64) * 10, torch.full((12,), 5))
    rc = mx.compute_reward_statistics(pf, [1.0, 0.5], g, q_temperature=0.5, q_epsilon=1e-4, seed_grpo=seed)
    ent = torch.rand(12, generator=torch.Generator().manual_seed(3), dtype=torch.float64) * 2
    out = mx.apply_policy_entropy_bonus(rc, ent, coef)
    r = rc.total.tolist()
    known = [x for x in r if not math.isnan(x)]
    mu = sum(known) / len(known)
    sigma = math.sqrt(sum((x - mu) ** 2 for x in known) / (len(known) - 1))
    for p in range(3):
        h = ent[p * g:(p + 1) * g].tolist()
        hm = sum(h) / g
        hs = max(math.sqrt(sum((x - hm) ** 2 for x in h) / (g - 1)), 1e-6)
        new = [ri + coef * sigma * (hi - hm) / hs for ri, hi in zip(r[p * g:(p + 1) * g], h)]
        got = out.total[p * g:(p + 1) * g].tolist()
        assert [x for x in got if not math.isnan(x)] == pytest.approx([x for x in new if not math.isnan(x)])
        scale = float(rc.seed_scales[p])
        expect_adv = [a * scale for a in ref_grpo(new)]
        assert out.advantages[p * g:(p + 1) * g].tolist() == pytest.approx(expect_adv, abs=1e-9)
        assert out.q[p].tolist() == pytest.approx(ref_q(new, 0.5, 1e-4), abs=1e-9)
    assert out.zero_std.tolist() == [False, False, False]  # the bonus breaks the tie of group 1
    assert out.per_function is rc.per_function
    assert mx.apply_policy_entropy_bonus(rc, ent, 0.0) is rc
    with pytest.raises(ValueError, match="already"):
        mx.apply_policy_entropy_bonus(out, ent, coef)
    with pytest.raises(ValueError, match="mean_token_entropy"):
        mx.apply_policy_entropy_bonus(rc, ent[:8], coef)


def test_reward_moments_skip_missing_rewards():
    assert mx.reward_moments(torch.tensor([1.0, NAN, 3.0])) == (pytest.approx(2.0), pytest.approx(math.sqrt(2)))
    assert mx.reward_moments(torch.tensor([NAN])) == (0.0, 0.0)
    assert mx.reward_moments(torch.tensor([4.0])) == (4.0, 0.0)


# ---------------------------------------------------------------- settings


def test_weighting_settings_properties_and_validation():
    cfg = WeightingSettings(
        tau=0.3, beta=0.04,
        normalization=WeightNormalizationSettings(len_norm_ref=False),
        q_distribution=QDistributionSettings(temperature=0.5, epsilon=1e-3),
        tau_schedule=TauSchedule(target_entropy=1.2, lr=0.1, min=0.01, max=2.0, warmup_steps=3),
        kl_controller=KlControllerSettings(target=0.05, horizon=100, step_size=0.2),
    )
    assert cfg.denom == pytest.approx(0.34)
    assert (cfg.len_norm_ref, cfg.q_temperature, cfg.q_epsilon) == (False, 0.5, 1e-3)
    assert (cfg.tau_target_entropy, cfg.tau_lr, cfg.tau_min, cfg.tau_max, cfg.tau_warmup_steps) == (1.2, 0.1, 0.01, 2.0, 3)
    assert cfg.kl_target == 0.05
    assert cfg.controller_state == ControllerState.initial(0.3, 0.04)
    with pytest.raises(ValueError, match="tau"):
        _cfg(tau=-1.0)
    with pytest.raises(ValueError, match="scale_rewards"):
        _cfg(scale_rewards="yes")
    with pytest.raises(ValueError, match="controller_state"):
        _cfg(tau=0.5, controller_state=ControllerState.initial(0.4, 0.0))
    with pytest.raises(ValueError, match="q_distribution.temperature"):
        QDistributionSettings(temperature=0.0)


# ---------------------------------------------------------------- weights


def _ref_stats(n, seed):
    gen = torch.Generator().manual_seed(seed)
    counts = torch.randint(1, 50, (n,), generator=gen)
    return ReferenceLogprobs(-torch.rand(n, generator=gen, dtype=torch.float64) * counts * 2, counts)


@pytest.mark.parametrize("len_norm", [True, False])
def test_compute_weight_stats_matches_reference(len_norm):
    pf, g = batch(seed=4), 4
    rc = mx.compute_reward_statistics(pf, [1.0, 1.0], g, q_temperature=1.0, q_epsilon=1e-4)
    ref = _ref_stats(12, 6)
    cfg = _cfg(tau=0.4, beta=0.2, normalization=WeightNormalizationSettings(len_norm_ref=len_norm))
    ws = mx.compute_weight_stats(rc, ref, cfg)
    entropies = []
    for p in range(3):
        q = rc.q[p].tolist()
        lref = [s / c if len_norm else s for s, c in zip(ref.ref_logp_sum[p * g:(p + 1) * g].tolist(),
                                                         ref.ref_tok_counts[p * g:(p + 1) * g].tolist())]
        w = ref_softmax([(math.log(qi) + 0.2 * li) / 0.6 for qi, li in zip(q, lref)])
        assert ws.weights_grouped[p].tolist() == pytest.approx(w, abs=1e-9)
        entropies.append(-sum(x * math.log(x) for x in w))
        assert ws.advantage_entropy[p * g:(p + 1) * g].tolist() == pytest.approx([x - 1 / g for x in w], abs=1e-9)
    assert ws.weight_entropy == pytest.approx(sum(entropies) / 3, abs=1e-9)
    assert (ws.weight_entropy_min, ws.weight_entropy_max) == (pytest.approx(min(entropies)), pytest.approx(max(entropies)))
    assert torch.equal(ws.flat_weights, ws.weights_grouped.reshape(-1))


def test_groups_left_out_of_the_loss_get_uniform_weights_and_no_say_in_the_entropy():
    """A zero-variance group does not enter the listwise loss: with a reference term its weights
    would not be uniform, and the tau controller would steer on a group that trains nothing."""
    pf, g = batch(seed=4), 4
    pf[4:8] = 0.5  # group 1: every completion got the same rewards
    rc = mx.compute_reward_statistics(pf, [1.0, 1.0], g, q_temperature=1.0, q_epsilon=1e-4)
    assert rc.zero_std.tolist() == [False, True, False]
    ref, cfg = _ref_stats(12, 6), _cfg(tau=0.4, beta=0.2)
    every = mx.compute_weight_stats(rc, ref, cfg)
    assert not torch.allclose(every.weights_grouped[1], torch.full((g,), 1 / g, dtype=torch.float64))  # tilted by the reference
    ws = mx.compute_weight_stats(rc, ref, cfg, active=~rc.zero_std)
    assert ws.weights_grouped[1].tolist() == [1 / g] * g and ws.advantage_entropy[4:8].tolist() == [0.0] * g
    assert torch.equal(ws.weights_grouped[[0, 2]], every.weights_grouped[[0, 2]])
    h = [-sum(x * math.log(x) for x in every.weights_grouped[p].tolist()) for p in (0, 2)]
    assert ws.weight_entropy == pytest.approx(sum(h) / 2, abs=1e-12) and ws.num_active_groups == 2
    assert (ws.weight_entropy_min, ws.weight_entropy_max) == (pytest.approx(min(h)), pytest.approx(max(h)))
    none = mx.compute_weight_stats(rc, ref, cfg, active=torch.zeros(3, dtype=torch.bool))
    assert none.num_active_groups == 0 and math.isnan(none.weight_entropy)


def test_weight_stats_without_reference_model():
    pf, g = batch(seed=7), 4
    rc = mx.compute_reward_statistics(pf, [1.0, 1.0], g, q_temperature=1.0, q_epsilon=1e-4)
    ws = mx.compute_weight_stats(rc, None, _cfg(tau=0.25, beta=0.0))
    for p in range(3):
        assert ws.weights_grouped[p].tolist() == pytest.approx(ref_softmax([math.log(q) / 0.25 for q in rc.q[p].tolist()]))
    with pytest.raises(ValueError, match="ref_stats"):
        mx.compute_weight_stats(rc, None, _cfg(tau=0.25, beta=0.1))
    with pytest.raises(ValueError, match="ref_stats"):
        mx.compute_weight_stats(rc, _ref_stats(8, 0), _cfg(tau=0.25, beta=0.1))


def test_reference_splits_and_entropy_of_uniform_weights():
    ref = ReferenceLogprobs(torch.tensor([-4.0, -9.0, -2.0, -8.0]), torch.tensor([2, 3, 0, 4]))
    assert mx.split_reference_logprobs(ref, 2, True).tolist() == [[-2.0, -3.0], [-2.0, -2.0]]
    assert mx.split_reference_logprobs(ref, 2, False).tolist() == [[-4.0, -9.0], [-2.0, -8.0]]
    assert mx.split_reference_token_counts(ref, 2).tolist() == [[2, 3], [0, 4]]
    assert ref.ref_logp_mean == pytest.approx(-2.25)
    assert ref.avg_completion_tokens == pytest.approx(2.25)
    with pytest.raises(ValueError, match="num_generations"):
        mx.split_reference_logprobs(ref, 3, True)
    uniform = torch.full((3, 8), 1 / 8)
    u = WeightStats(uniform, uniform.reshape(-1), *mx.collect_weight_entropy(uniform))
    assert u.weight_entropy == pytest.approx(math.log(8), abs=1e-6)
    view = u.logging_view()
    assert view.entropy_norm == pytest.approx(1.0, abs=1e-6)
    assert view.advantage_entropy_mean == pytest.approx(0.0, abs=1e-7)
    mean, lo, hi, adv = mx.collect_weight_entropy(torch.tensor([[0.5, 0.5], [1.0, 0.0]]))
    assert (mean, lo, hi) == (pytest.approx(math.log(2) / 2), 0.0, pytest.approx(math.log(2)))
    assert adv.tolist() == [0.0, 0.0, 0.5, -0.5]


# ---------------------------------------------------------------- controllers through the config


def _stats(entropy: float) -> WeightStats:
    return WeightStats(torch.full((1, 2), 0.5), torch.full((2,), 0.5), entropy, entropy, entropy, torch.zeros(2))


def test_maybe_update_tau_in_place_and_in_sync():
    cfg = _cfg(tau=0.5, beta=0.1, tau_schedule=TauSchedule(target_entropy=1.0, lr=0.2, warmup_steps=1))
    mx.maybe_update_tau(cfg, _stats(0.4), global_step=1)
    assert cfg.tau == 0.5  # warm-up
    mx.maybe_update_tau(cfg, _stats(0.4), global_step=2)
    assert cfg.tau == pytest.approx(0.5 * math.exp(0.2 * 0.6))
    assert cfg.controller_state.tau == cfg.tau and cfg.denom == pytest.approx(cfg.tau + 0.1)
    mx.maybe_update_tau(cfg, WeightLoggingView(entropy=0.4), global_step=3, lr_scale=0.0)
    assert cfg.controller_state.tau_entropy_ema == pytest.approx(0.4)
    cfg.tau = 0.9  # set by hand: the controller continues from it
    mx.maybe_update_tau(cfg, _stats(0.4), global_step=4)
    assert cfg.tau == pytest.approx(0.9 * math.exp(0.2 * 0.6))
    with pytest.raises(ValueError, match="weight_stats"):
        mx.maybe_update_tau(cfg, 0.4, global_step=5)


def test_maybe_update_beta_and_meta():
    cfg = _cfg(tau=0.5, beta=0.2, kl_controller=KlControllerSettings(target=0.1, horizon=10, step_size=0.2))
    mx.maybe_update_beta(cfg, 0.11, global_step=7)
    assert cfg.beta == pytest.approx(0.2 * 1.01) and cfg.controller_state.beta == cfg.beta
    # Stamped with the step it happened at, also for methods whose tau never moves (no tau step).
    assert cfg.controller_state.beta_history[-1] == (7, pytest.approx(0.2 * 1.01))
    assert mx.apply_meta_controller_update(cfg, tau_grad=1.0) is False  # meta disabled
    meta = _cfg(tau=0.5, beta=0.2, controller_meta=ControllerMetaSettings(lr_tau=0.1, lr_beta=0.1))
    assert mx.apply_meta_controller_update(meta, tau_grad=1.0, beta_grad=-1.0) is True
    assert (meta.tau, meta.beta) == (pytest.approx(0.4), pytest.approx(0.3))
    assert mx.apply_meta_controller_update(meta) is False


def test_update_controllers_runs_the_meta_controller_instead_every_n_steps():
    """§8: with the meta controller on, tau <- tau - lr_tau (H - H*) and
    beta <- beta + lr_beta clip(KL - KL*, +-g) every n steps; the tau and beta controllers rest."""
    schedule = TauSchedule(target_entropy=1.0, lr=5.0)
    kl = KlControllerSettings(target=0.1, horizon=10, step_size=0.2)
    meta = _cfg(tau=0.5, beta=0.2, tau_schedule=schedule, kl_controller=kl,
                controller_meta=ControllerMetaSettings(lr_tau=0.1, lr_beta=2.0, every=2, grad_clip=0.05))
    mx.update_controllers(meta, WeightLoggingView(entropy=1.4), 0.3, step=3)
    assert (meta.tau, meta.beta) == (0.5, 0.2)  # not a multiple of every
    mx.update_controllers(meta, WeightLoggingView(entropy=1.4), 0.3, step=4)
    assert meta.tau == pytest.approx(0.5 - 0.1 * (1.4 - 1.0))
    assert meta.beta == pytest.approx(0.2 + 2.0 * 0.05)  # KL - KL* = 0.2 clipped to 0.05
    assert meta.controller_state.tau_history[-1] == (4, pytest.approx(0.46))
    plain = _cfg(tau=0.5, beta=0.2, tau_schedule=schedule, kl_controller=kl)
    mx.update_controllers(plain, WeightLoggingView(entropy=1.4), 0.11, step=1)
    assert plain.tau == pytest.approx(0.5 * math.exp(5.0 * (1.0 - 1.4)))  # the tau controller
    assert plain.beta == pytest.approx(0.2 * 1.01)  # the beta controller
    mx.update_controllers(plain, None, None, step=2)
    assert plain.tau == pytest.approx(0.5 * math.exp(5.0 * (1.0 - 1.4)))


def test_controller_state_round_trips_through_a_checkpoint_snapshot():
    """The controller state travels in each checkpoint's trainer_state.json (controller_state_dict)."""
    import json

    cfg = _cfg(tau=0.5, beta=0.2, tau_schedule=TauSchedule(target_entropy=1.0, lr=0.2))
    mx.maybe_update_tau(cfg, _stats(0.3), global_step=1)
    snapshot = json.loads(json.dumps(mx.controller_state_dict(cfg)))
    fresh = _cfg(tau=0.5, beta=0.2, tau_schedule=TauSchedule(target_entropy=1.0, lr=0.2))
    mx.restore_controller_state(fresh, snapshot)
    assert (fresh.tau, fresh.beta, fresh.controller_state) == (cfg.tau, cfg.beta, cfg.controller_state)
    assert snapshot["tau_entropy_ema"] == pytest.approx(0.3)