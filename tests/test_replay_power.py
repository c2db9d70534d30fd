"""The replay study's power calculation (benchmarks/replay_power.py): the ANOVA moments against
simulated tables of known variance components and against a hand count, the predicted half-width and
power against the simulated spread of the §12 estimator, the OLS factor against the clustered OLS
itself, and the zero-variance boundaries."""

from __future__ import annotations

import math
import sys
from dataclasses import replace
from pathlib import Path

import numpy as np
import pandas as pd
import pytest
from scipy import stats

REPO_ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO_ROOT))  # benchmarks/ is a top-level folder, not part of the package

from benchmarks.replay_power import (  # noqa: E402
    Components,
    analyze,
    concentrated_effect_power,
    design_variance,
    draw_variance,
    half_width,
    mean_squares,
    ols_factor,
    pass_at_k_variance,
    power,
    random_seed_half_width,
    random_seed_se_df,
    smallest_design,
    upper_components,
    variance_components,
)


def _normal_tables(rng: np.random.Generator, reps: int, n: int, s: int, prompt: float, seed: float,
                   resid: float, delta: float = 0.0) -> np.ndarray:
    """``reps`` tables d_ps = delta + a_p + b_s + e_ps with normal terms of the given variances."""
    a = rng.normal(0, math.sqrt(prompt), (reps, n, 1))
    b = rng.normal(0, math.sqrt(seed), (reps, 1, s))
    e = rng.normal(0, math.sqrt(resid), (reps, n, s))
    return delta + a + b + e


def _estimate(t: np.ndarray) -> float:
    """The §12 estimate: the mean over prompts of each prompt's mean over seeds."""
    return float(t.mean(axis=1).mean())


def test_mean_squares_by_hand():
    # §12's Re:Dr - Dr.GRPO pass@8 pattern: +1 on three prompts in seed 1, -1 on one in seed 2.
    t = np.zeros((16, 3))
    t[0, 1] = t[1, 1] = t[2, 1] = 1.0
    t[3, 2] = -1.0
    ms = mean_squares(t)
    # Prompt means 1/3 (x3), -1/3, 0 (x12); seed means 0, 3/16, -1/16; grand mean 1/24.
    assert ms.prompt == pytest.approx(1.25 / 15, abs=1e-12)  # SS_P = 3 * 5/12
    assert ms.seed == pytest.approx((16 * (1 / 576 + (3 / 16 - 1 / 24) ** 2 + (1 / 16 + 1 / 24) ** 2)) / 2, abs=1e-12)
    ss_total = 4 - 48 / 576
    assert ms.residual == pytest.approx((ss_total - 1.25 - 2 * ms.seed) / 30, abs=1e-12)
    c = variance_components(ms, draw=0.05)
    assert c.prompt == pytest.approx((ms.prompt - ms.residual) / 3)
    assert c.seed == pytest.approx((ms.seed - ms.residual) / 16)
    assert c.seed_prompt == pytest.approx(ms.residual - 0.05)


def test_expected_mean_squares_recover_known_components():
    rng = np.random.default_rng(0)
    n, s, truth = 32, 5, {"prompt": 0.02, "seed": 0.01, "resid": 0.07}
    tables = _normal_tables(rng, 2000, n, s, truth["prompt"], truth["seed"], truth["resid"], delta=0.1)
    ms = [mean_squares(t) for t in tables]
    # Untruncated moments are unbiased: their means must match the expected mean squares.
    assert np.mean([m.residual for m in ms]) == pytest.approx(truth["resid"], rel=0.03)
    assert np.mean([(m.prompt - m.residual) / s for m in ms]) == pytest.approx(truth["prompt"], rel=0.08)
    assert np.mean([(m.seed - m.residual) / n for m in ms]) == pytest.approx(truth["seed"], rel=0.1)
    # Swapping the roles of prompts and seeds would give a different (wrong) expectation.
    assert np.mean([(m.prompt - m.residual) / n for m in ms]) < 0.5 * truth["prompt"]


def test_zero_components_stay_zero():
    rng = np.random.default_rng(1)
    ms = [mean_squares(t) for t in _normal_tables(rng, 1000, 16, 3, 0.0, 0.0, 0.05)]
    comps = [variance_components(m, draw=0.0) for m in ms]
    assert all(c.prompt >= 0 and c.seed >= 0 for c in comps)
    # The truncated estimator is 0 at least about half the time when the true component is 0.
    assert np.mean([c.prompt == 0.0 for c in comps]) > 0.4
    assert np.median([c.prompt for c in comps]) < 0.002
    # All-zero table (§12's many prompts that no arm solves): every component 0, no division by 0.
    zero = variance_components(mean_squares(np.zeros((16, 3))), draw=0.0)
    assert zero == Components(0.0, 0.0, 0.0, 0.0)
    assert half_width(zero, 64, 1, 5) == 0.0
    assert power(zero, 64, 1, 5, effect=0.1) == 1.0 and power(zero, 64, 1, 5, effect=0.0) == 0.05
    assert random_seed_half_width(zero, 64, 1, 5) == 0.0


def test_pure_prompt_and_pure_seed_tables():
    prompts = np.array([0.0, 1.0, -1.0, 0.5])
    t = prompts[:, None] + np.zeros((4, 3))
    c = variance_components(mean_squares(t), draw=0.0)
    assert c.prompt == pytest.approx(np.var(prompts, ddof=1)) and c.seed == 0.0 and c.seed_prompt == 0.0
    seeds = np.array([0.2, -0.1, 0.4])
    c = variance_components(mean_squares(np.zeros((4, 1)) + seeds[None, :]), draw=0.0)
    assert c.seed == pytest.approx(np.var(seeds, ddof=1)) and c.prompt == 0.0 and c.seed_prompt == 0.0


def test_draw_noise_is_capped_at_the_residual():
    ms = mean_squares(np.array([[0.0, 1.0], [1.0, 0.0], [0.0, 0.0]]))
    c = variance_components(ms, draw=10.0)
    # Capped, the draw noise takes the whole residual: the observed design's residual is preserved.
    assert c.draw == pytest.approx(ms.residual) and c.seed_prompt == 0.0
    assert design_variance(replace(c, prompt=0.0), 1, 2) == pytest.approx(ms.residual / 2)
    # Two observed draws: the residual holds draw / 2.
    c2 = variance_components(ms, draw=0.5 * ms.residual, draws_observed=2)
    assert c2.seed_prompt == pytest.approx(0.75 * ms.residual)


def test_pass_at_k_variance():
    assert pass_at_k_variance(0.0) == 0.0 and pass_at_k_variance(1.0) == 0.0
    assert pass_at_k_variance(0.5, k=1) == pytest.approx(0.25)
    q = 1 - 0.9 ** 8
    assert pass_at_k_variance(0.1) == pytest.approx(q * (1 - q))
    rng = np.random.default_rng(2)
    hits = (rng.random((20000, 8)) < 0.1).any(axis=1)
    assert hits.var() == pytest.approx(q * (1 - q), abs=0.01)
    assert draw_variance(np.array([0.1, 0.0]), np.array([0.0, 1.0])) == pytest.approx(q * (1 - q) / 2)


def _bernoulli_study(rng: np.random.Generator, reps: int, n: int, d: int, s: int) -> tuple[np.ndarray, Components]:
    """§12's estimator on simulated pass@8 indicators. Per replicate: the reference arm's per-(prompt,
    seed) success probability q0 ~ U(0.2, 0.5); the treatment's q0 + e_p + f_ps with a prompt effect
    e_p in {0, 0.3} and a seed x prompt term f_ps = +-0.1; D independent draws per arm and cell.
    Returns the per-replicate (prompt x seed) difference tables and the true components."""
    q0 = rng.uniform(0.2, 0.5, (reps, n, s))
    e = 0.3 * (rng.random((reps, n, 1)) < 0.5)
    f = 0.1 * rng.choice([-1.0, 1.0], (reps, n, s))
    q1 = q0 + e + f
    pass0 = (rng.random((reps, n, s, d)) < q0[..., None]).mean(axis=-1)
    pass1 = (rng.random((reps, n, s, d)) < q1[..., None]).mean(axis=-1)
    draw = float(np.mean(q0 * (1 - q0) + q1 * (1 - q1)))
    return pass1 - pass0, Components(prompt=0.3 ** 2 * 0.25, seed=0.0, seed_prompt=0.01, draw=draw)


@pytest.mark.parametrize("n,d,s", [(16, 1, 3), (32, 4, 5)])
def test_predicted_half_width_matches_simulated_spread(n, d, s):
    rng = np.random.default_rng(3)
    tables, truth = _bernoulli_study(rng, 2000, n, d, s)
    estimates = tables.mean(axis=2).mean(axis=1)
    v = design_variance(truth, d, s)
    # The spread of delta_hat over replicates is sqrt(V / n_p).
    assert estimates.std() == pytest.approx(math.sqrt(v / n), rel=0.05)
    # The §12 interval's squared standard error estimates V / n_p without bias.
    sp2 = tables.mean(axis=2).var(axis=1, ddof=1)
    assert sp2.mean() == pytest.approx(v, rel=0.03)
    # Its predicted half-width is t sqrt(V / n_p); the simulated intervals cover the truth ~95%.
    crit = stats.t(df=n - 1).ppf(0.975)
    assert half_width(truth, n, d, s) == pytest.approx(crit * math.sqrt(v / n))
    covered = np.abs(estimates - 0.15) <= crit * np.sqrt(sp2 / n)
    assert covered.mean() == pytest.approx(0.95, abs=0.02)


def test_ms_of_simulated_study_recover_its_components():
    rng = np.random.default_rng(4)
    tables, truth = _bernoulli_study(rng, 1500, 32, 1, 5)
    ms = [mean_squares(t) for t in tables]
    resid = truth.seed_prompt + truth.draw
    assert np.mean([m.residual for m in ms]) == pytest.approx(resid, rel=0.03)
    assert np.mean([(m.prompt - m.residual) / 5 for m in ms]) == pytest.approx(truth.prompt, rel=0.1)


def test_power_matches_simulated_rejection_rate():
    rng = np.random.default_rng(5)
    n, s, truth = 16, 3, Components(prompt=0.02, seed=0.0, seed_prompt=0.05, draw=0.0)
    tables = _normal_tables(rng, 3000, n, s, truth.prompt, 0.0, truth.seed_prompt, delta=0.12)
    per_prompt = tables.mean(axis=2)
    tstat = per_prompt.mean(axis=1) / (per_prompt.std(axis=1, ddof=1) / math.sqrt(n))
    rejected = np.abs(tstat) > stats.t(df=n - 1).ppf(0.975)
    predicted = power(truth, n, 1, s, effect=0.12)
    assert 0.3 < predicted < 0.8  # a case where a wrong noncentrality would show
    assert rejected.mean() == pytest.approx(predicted, abs=0.03)
    assert power(truth, n, 1, s, effect=0.0) == pytest.approx(0.05)
    assert power(truth, 64, 1, s, effect=0.12) > predicted  # more prompts, more power
    # Huge noncentrality: scipy's lower tail would be nan; the power is 1.
    assert power(Components(1e-4, 0.0, 0.0, 0.0), 128, 4, 8, effect=0.1) == pytest.approx(1.0)


def test_random_seed_variance_matches_simulation():
    rng = np.random.default_rng(6)
    n, s, truth = 32, 5, Components(prompt=0.01, seed=0.005, seed_prompt=0.06, draw=0.0)
    tables = _normal_tables(rng, 3000, n, s, truth.prompt, truth.seed, truth.seed_prompt)
    estimates = np.array([_estimate(t) for t in tables])
    se, df = random_seed_se_df(truth, n, 1, s)
    assert se ** 2 == pytest.approx(truth.seed / s + design_variance(truth, 1, s) / n)
    assert estimates.std() == pytest.approx(se, rel=0.05)
    # The seed-conditional (§12) spread leaves out seed / S and is too narrow here.
    assert math.sqrt(design_variance(truth, 1, s) / n) < 0.8 * estimates.std()
    assert s - 1 <= df <= (n - 1) * (s - 1)


def test_ols_factor_matches_clustered_ols():
    from benchmarks.modebench_stats import arm_effects

    rng = np.random.default_rng(7)
    n, s = 12, 3
    rows = []
    for arm, shift in (("base", 0.0), ("treat", 0.1), ("other", -0.05)):
        y = rng.integers(0, 2, (n, s)).astype(float) + shift
        rows += [{"arm": arm, "train_seed": j, "eval_seed": 0, "task": "t", "prompt": f"t/{i}", "y": y[i, j]}
                 for i in range(n) for j in range(s)]
    df = pd.DataFrame(rows)
    for arms in (("base", "treat"), ("base", "treat", "other")):
        data = df[df["arm"].isin(arms)]
        fx = arm_effects(data, "y", "base").set_index("arm").loc["treat"]
        diff = (data[data.arm == "treat"].pivot(index="prompt", columns="train_seed", values="y")
                - data[data.arm == "base"].pivot(index="prompt", columns="train_seed", values="y")).mean(axis=1)
        t_half = stats.t(df=n - 1).ppf(0.975) * diff.std(ddof=1) / math.sqrt(n)
        assert fx.effect == pytest.approx(diff.mean())
        assert (fx.hi - fx.lo) / 2 == pytest.approx(t_half * ols_factor(n, s, arms=len(arms)), rel=1e-9)


def test_upper_components_and_design_choice():
    ms = mean_squares(_normal_tables(np.random.default_rng(8), 1, 16, 3, 0.01, 0.01, 0.07)[0])
    point, upper = variance_components(ms, 0.03), upper_components(ms, 0.03)
    assert upper.prompt >= point.prompt and upper.seed >= point.seed and upper.seed_prompt > point.seed_prompt
    assert upper.draw == point.draw
    # The upper bound of MS_E at 80% is df MS / chi2_0.2(df).
    assert upper.seed_prompt + upper.draw == pytest.approx(30 * ms.residual / stats.chi2(30).ppf(0.2))
    best = smallest_design(point)
    assert best is not None
    n, d, s = best
    assert n >= 64 and s >= 5 and half_width(point, n, d, s) <= 0.08
    assert smallest_design(Components(1.0, 0.0, 1.0, 1.0)) is None
    # A component in [0, 1] per prompt with mean 0.1 adds at most 0.09: power falls.
    assert concentrated_effect_power(point, n, d, s) < power(point, n, d, s)


def test_report_on_committed_results():
    text = analyze()
    assert "| redr - dr_grpo | +0.0417 | 0.0833 | 0.2708 | 0.0708 |" in text
    assert "nan" not in text
