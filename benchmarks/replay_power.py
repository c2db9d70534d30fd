"""Power of a larger verified-replay study (BENCHMARKS.md §12): variance components of the per-prompt
pass@8 difference Re:Dr - Dr.GRPO from §12's raw results, and the predicted 95% half-width and power
of the §12 estimator for a design of n_p eval prompts, D draws (groups of 8) per prompt, S train seeds.

    python -m benchmarks.replay_power    # the tables from the committed results (seconds)

The model. For a contrast (treatment - reference), d_ps is the difference of the two arms' pass@8 on
eval prompt p after training seed s, each arm's pass@8 being the mean over D draws of 1[a verified
answer in the group of 8]:

    d_ps = delta + a_p + b_s + c_ps + w_ps

with independent zero-mean terms: a_p the prompt x arm interaction (variance ``prompt``), b_s the
seed x arm interaction (``seed``), c_ps the seed x prompt x arm residual (``seed_prompt``) and w_ps the
draw noise, of variance ``draw / D`` (``draw``: one draw of 8 for each arm).

The §12 estimator: delta_hat = the mean over prompts of each prompt's mean over seeds, with a t
interval over prompts (n_p - 1 df). Its between-prompt variance is that of a_p + mean_s(c_ps + w_ps),

    V = prompt + (seed_prompt + draw / D) / S,   half-width = t_{0.975, n_p - 1} sqrt(V / n_p).

b_s is common to every prompt, so it cancels in that spread: the §12 interval is conditional on the
training seeds drawn (as is the clustered OLS with seed fixed effects). Treating seeds as random adds
``seed / S`` to the variance (``random_seed_half_width``).

The draw variance is a plug-in (``draw_variance``) for independent draws in the two arms. §12 samples
every arm with the same eval seed, so two close models share many completions and the observed
residual can hold less draw noise than that; the plug-in is therefore capped at the residual, and a
"worst draw noise" scenario (independent arms at q = 0.5) bounds it from above.
"""

from __future__ import annotations

import math
import sys
from collections.abc import Callable
from dataclasses import dataclass, replace
from pathlib import Path

import numpy as np
import pandas as pd
from scipy import stats

from benchmarks.replay_study import RESULTS
from benchmarks.replay_study_stats import load

K = 8  # samples per draw: pass@8
ALPHA = 0.05
PROMPTS = (16, 32, 64, 96, 128)
DRAWS = (1, 2, 4)
SEEDS = (3, 5, 8)
TARGET_HALF_WIDTH = 0.08
TARGET_EFFECT = 0.10
MIN_PROMPTS, MIN_SEEDS = 64, 5
UPPER_LEVEL = 0.80  # one-sided confidence level of the conservative components
# The largest draw variance of a pass@8 difference: both arms at q = 0.5, independent draws.
WORST_DRAW = 0.5


@dataclass(frozen=True)
class MeanSquares:
    """Two-way ANOVA (prompts x seeds, one value per cell) mean squares of a difference table."""

    prompt: float
    seed: float
    residual: float
    n_prompts: int
    n_seeds: int

    @property
    def df_prompt(self) -> int:
        return self.n_prompts - 1

    @property
    def df_seed(self) -> int:
        return self.n_seeds - 1

    @property
    def df_residual(self) -> int:
        return (self.n_prompts - 1) * (self.n_seeds - 1)


@dataclass(frozen=True)
class Components:
    """Variance components of d_ps (see the module docstring); ``draw`` is for one draw of 8."""

    prompt: float
    seed: float
    seed_prompt: float
    draw: float


def mean_squares(table: np.ndarray) -> MeanSquares:
    """Mean squares of an n_p x S table d (rows prompts, columns seeds), one observation per cell:

    MS_P = S sum_p (d_p. - d..)^2 / (n_p - 1)                     E[MS_P] = s2_e + S prompt
    MS_S = n_p sum_s (d_.s - d..)^2 / (S - 1)                      E[MS_S] = s2_e + n_p seed
    MS_E = sum_ps (d_ps - d_p. - d_.s + d..)^2 / ((n_p-1)(S-1))    E[MS_E] = s2_e

    where s2_e = seed_prompt + draw / D (the residual at the table's D draws).
    """
    d = np.asarray(table, dtype=float)
    n, s = d.shape
    if n < 2 or s < 2:
        raise ValueError(f"need at least 2 prompts and 2 seeds, got a {n} x {s} table")
    grand = d.mean()
    rows, cols = d.mean(axis=1), d.mean(axis=0)
    resid = d - rows[:, None] - cols[None, :] + grand
    return MeanSquares(prompt=float(s * ((rows - grand) ** 2).sum() / (n - 1)),
                       seed=float(n * ((cols - grand) ** 2).sum() / (s - 1)),
                       residual=float((resid ** 2).sum() / ((n - 1) * (s - 1))),
                       n_prompts=n, n_seeds=s)


def variance_components(ms: MeanSquares, draw: float, draws_observed: int = 1) -> Components:
    """Method-of-moments components from the expected mean squares, negative estimates set to 0:

    prompt = (MS_P - MS_E) / S,  seed = (MS_S - MS_E) / n_p,  seed_prompt = MS_E - draw / D_obs.

    ``draw`` is an outside estimate of the one-draw draw variance of the difference (``draw_variance``);
    it is capped at D_obs MS_E, so the components add back up to the observed residual MS_E.
    """
    draw = min(draw, draws_observed * ms.residual)
    return Components(prompt=max(0.0, (ms.prompt - ms.residual) / ms.n_seeds),
                      seed=max(0.0, (ms.seed - ms.residual) / ms.n_prompts),
                      seed_prompt=max(0.0, ms.residual - draw / draws_observed),
                      draw=draw)


def upper_components(ms: MeanSquares, draw: float, level: float = UPPER_LEVEL,
                     draws_observed: int = 1) -> Components:
    """Conservative components: each mean square replaced by its one-sided ``level`` upper confidence
    bound df MS / chi2_{1 - level}(df) (exact for normal data), then the moments of
    ``variance_components`` with MS_E at its point value where it is subtracted:

    prompt = (U(MS_P) - MS_E) / S,  seed = (U(MS_S) - MS_E) / n_p,  seed_prompt = U(MS_E) - draw / D_obs.

    ``draw`` stays at its point value, so the whole inflation of the residual goes to seed_prompt, the
    part that more draws do not reduce.
    """
    def upper(value: float, df: int) -> float:
        return df * value / stats.chi2(df).ppf(1 - level)

    draw = min(draw, draws_observed * ms.residual)
    return Components(prompt=max(0.0, (upper(ms.prompt, ms.df_prompt) - ms.residual) / ms.n_seeds),
                      seed=max(0.0, (upper(ms.seed, ms.df_seed) - ms.residual) / ms.n_prompts),
                      seed_prompt=max(0.0, upper(ms.residual, ms.df_residual) - draw / draws_observed),
                      draw=draw)


def pass_at_k_variance(p: np.ndarray | float, k: int = K) -> np.ndarray:
    """Variance of one draw's pass@k = 1[any of k samples correct] at per-sample accuracy p:
    q (1 - q) with q = 1 - (1 - p)^k."""
    q = 1.0 - (1.0 - np.asarray(p, dtype=float)) ** k
    return q * (1.0 - q)


def draw_variance(accuracy_a: np.ndarray, accuracy_b: np.ndarray, k: int = K) -> float:
    """One-draw variance of the pass@k difference of two arms, averaged over cells: the mean over
    (prompt, seed) of q_a (1 - q_a) + q_b (1 - q_b), the per-sample accuracies plugged in for p.
    This assumes independent draws in the two arms."""
    return float(np.mean(pass_at_k_variance(accuracy_a, k) + pass_at_k_variance(accuracy_b, k)))


def design_variance(c: Components, draws: int, seeds: int) -> float:
    """Variance over prompts of a prompt's mean difference over S seeds, D draws each:
    V = prompt + (seed_prompt + draw / D) / S."""
    return c.prompt + (c.seed_prompt + c.draw / draws) / seeds


def half_width(c: Components, n_prompts: int, draws: int, seeds: int, alpha: float = ALPHA) -> float:
    """Predicted half-width of the §12 interval: t_{1 - alpha/2, n_p - 1} sqrt(V / n_p)."""
    se = math.sqrt(design_variance(c, draws, seeds) / n_prompts)
    return float(stats.t(df=n_prompts - 1).ppf(1 - alpha / 2) * se)


def ols_factor(n_prompts: int, seeds: int, arms: int = 2) -> float:
    """Ratio of the clustered-OLS half-width (arm + seed fixed effects, clustered by prompt, t with
    n_p - 1 df; ``benchmarks/modebench_stats.arm_effects``) to the §12 t interval in a balanced
    design. The arm coefficient is the mean difference and each prompt's score is its mean difference
    less the estimate, so the two variances differ only by statsmodels' small-sample factor
    (G / (G - 1)) (N - 1) / (N - K) against the t interval's G / (G - 1): sqrt((N - 1) / (N - K)),
    N = arms n_p S observations, K = arms + S - 1 parameters."""
    n_obs = arms * n_prompts * seeds
    return math.sqrt((n_obs - 1) / (n_obs - arms - seeds + 1))


def _t_power(effect: float, se: float, df: float, alpha: float) -> float:
    """Two-sided t test power: P(|T| > t_{1 - alpha/2, df}) with T noncentral t, noncentrality
    effect / se."""
    if se == 0.0:
        return 1.0 if effect != 0.0 else alpha
    crit = stats.t(df=df).ppf(1 - alpha / 2)
    nc = abs(effect) / se
    # P(T < -crit | nc) = P(T > crit | -nc): scipy's nct.cdf far in the lower tail returns nan.
    return float(stats.nct.sf(crit, df, nc) + stats.nct.sf(crit, df, -nc))


def power(c: Components, n_prompts: int, draws: int, seeds: int, effect: float = TARGET_EFFECT,
          alpha: float = ALPHA) -> float:
    """Power of the §12 test (t over prompts, n_p - 1 df) against a true mean difference ``effect``:
    noncentral t with noncentrality effect / sqrt(V / n_p)."""
    se = math.sqrt(design_variance(c, draws, seeds) / n_prompts)
    return _t_power(effect, se, n_prompts - 1, alpha)


def random_seed_se_df(c: Components, n_prompts: int, draws: int, seeds: int) -> tuple[float, float]:
    """Standard error and Satterthwaite df of delta_hat when the training seeds are random too:
    Var = seed / S + V / n_p = (E[MS_P] + E[MS_S] - E[MS_E]) / (n_p S), the mean squares at the new
    design; df = Var^2 (n_p S)^2 / (E[MS_P]^2/(n_p-1) + E[MS_S]^2/(S-1) + E[MS_E]^2/((n_p-1)(S-1)))."""
    resid = c.seed_prompt + c.draw / draws
    ms_p, ms_s = resid + seeds * c.prompt, resid + n_prompts * c.seed
    var = (ms_p + ms_s - resid) / (n_prompts * seeds)
    if var == 0.0:
        return 0.0, float(n_prompts - 1)
    denom = ms_p ** 2 / (n_prompts - 1) + ms_s ** 2 / (seeds - 1) + resid ** 2 / ((n_prompts - 1) * (seeds - 1))
    return math.sqrt(var), float((ms_p + ms_s - resid) ** 2 / denom)


def random_seed_half_width(c: Components, n_prompts: int, draws: int, seeds: int, alpha: float = ALPHA) -> float:
    """Half-width of an interval for the effect over random training seeds: t_{Satterthwaite df} se."""
    se, df = random_seed_se_df(c, n_prompts, draws, seeds)
    return float(stats.t(df=df).ppf(1 - alpha / 2) * se)


def random_seed_power(c: Components, n_prompts: int, draws: int, seeds: int, effect: float = TARGET_EFFECT,
                      alpha: float = ALPHA) -> float:
    """Power against ``effect`` with the seeds random (``random_seed_se_df``)."""
    se, df = random_seed_se_df(c, n_prompts, draws, seeds)
    return _t_power(effect, se, df, alpha)


def smallest_design(c: Components, target: float = TARGET_HALF_WIDTH, min_prompts: int = MIN_PROMPTS,
                    min_seeds: int = MIN_SEEDS, prompts: tuple[int, ...] = PROMPTS, draws: tuple[int, ...] = DRAWS,
                    seeds: tuple[int, ...] = SEEDS,
                    width: Callable[[Components, int, int, int], float] = half_width) -> tuple[int, int, int] | None:
    """The cheapest (n_p, D, S) of the grid with n_p >= min_prompts, S >= min_seeds and predicted
    half-width ``width(c, n_p, D, S)`` <= target, or None. Cheapest: fewest training seeds (a seed is
    a training run per arm), then fewest sampled groups per run n_p D, then fewer draws (more prompts)
    at equal groups."""
    fits = [(n, d, s) for n in prompts for d in draws for s in seeds
            if n >= min_prompts and s >= min_seeds and width(c, n, d, s) <= target]
    return min(fits, key=lambda x: (x[2], x[0] * x[1], x[1])) if fits else None


@dataclass(frozen=True)
class Contrast:
    """One contrast's pass@8 difference table, summarised."""

    name: str
    mean: float  # the §12 estimate: mean over prompts and seeds of the difference
    ms: MeanSquares
    draw: float  # one-draw variance of the difference, each run's per-prompt accuracy plugged in
    draw_pooled: float  # the same with each prompt's accuracy pooled over the arm's seeds


def cell_table(df: pd.DataFrame, arm: str, metric: str) -> pd.DataFrame:
    """``metric`` of ``arm`` as a prompts x train seeds table."""
    return df[df["arm"] == arm].pivot(index="prompt", columns="train_seed", values=metric).sort_index()


def contrast(df: pd.DataFrame, arm: str, baseline: str) -> Contrast:
    """arm - baseline on pass@8 from the per-(arm, seed, prompt) metrics of ``replay_study_stats.load``.
    The pooled draw variance adds the seed-to-seed spread of a prompt's accuracy, so it is larger."""
    diff = cell_table(df, arm, "pass@8") - cell_table(df, baseline, "pass@8")
    acc_a, acc_b = cell_table(df, arm, "accuracy"), cell_table(df, baseline, "accuracy")
    return Contrast(name=f"{arm} - {baseline}", mean=float(diff.to_numpy().mean()), ms=mean_squares(diff.to_numpy()),
                    draw=draw_variance(acc_a.to_numpy(), acc_b.to_numpy()),
                    draw_pooled=draw_variance(acc_a.mean(axis=1).to_numpy(), acc_b.mean(axis=1).to_numpy()))


def scenarios(con: Contrast) -> dict[str, Components]:
    """The components the design is computed under: the point estimates; their upper 80% bounds; and
    the worst draw noise (two independent arms at q = 0.5) on top of the upper-80% prompt and
    seed x prompt components."""
    upper = upper_components(con.ms, con.draw)
    return {"point": variance_components(con.ms, con.draw), "upper 80%": upper,
            "worst draw noise": replace(upper, draw=WORST_DRAW)}


def components_table(cons: list[Contrast]) -> str:
    """Per contrast: the mean squares, the components, the draw variance both ways (before the cap at
    MS_E of ``variance_components``), the upper bounds."""
    ms0 = cons[0].ms
    lines = [f"| contrast | mean diff | MS_P ({ms0.df_prompt} df) | MS_S ({ms0.df_seed} df) "
             f"| MS_E ({ms0.df_residual} df) | prompt x arm | seed x arm | draw, one draw: per run [per prompt] "
             "| seed x prompt x arm | upper 80%: prompt x arm, seed x arm, seed x prompt x arm |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    for con in cons:
        c, u = variance_components(con.ms, con.draw), upper_components(con.ms, con.draw)
        lines.append(f"| {con.name} | {con.mean:+.4f} | {con.ms.prompt:.4f} | {con.ms.seed:.4f} "
                     f"| {con.ms.residual:.4f} | {c.prompt:.4f} | {c.seed:.4f} | {con.draw:.4f} [{con.draw_pooled:.4f}] "
                     f"| {c.seed_prompt:.4f} | {u.prompt:.4f}, {u.seed:.4f}, {u.seed_prompt:.4f} |")
    return "\n".join(lines)


def design_table(con: Contrast) -> str:
    """Predicted half-width and power (true difference TARGET_EFFECT) over the design grid, under each
    scenario; the clustered OLS's half-width (two arms) and the seeds-random interval at the point."""
    sc = scenarios(con)
    point = sc["point"]
    lines = ["| n_p | S | D | half-width | power | OLS half-width | half-width (upper 80%) | power (upper 80%) "
             "| half-width (worst draw noise) | power (worst draw noise) | half-width, seeds random | power, seeds random |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for n in PROMPTS:
        for s in SEEDS:
            for d in DRAWS:
                h = half_width(point, n, d, s)
                cells = [str(n), str(s), str(d), f"{h:.3f}", f"{power(point, n, d, s):.2f}",
                         f"{h * ols_factor(n, s):.3f}"]
                for name in ("upper 80%", "worst draw noise"):
                    cells += [f"{half_width(sc[name], n, d, s):.3f}", f"{power(sc[name], n, d, s):.2f}"]
                cells += [f"{random_seed_half_width(point, n, d, s):.3f}", f"{random_seed_power(point, n, d, s):.2f}"]
                lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def recommendations(con: Contrast) -> str:
    """The cheapest design with n_p >= MIN_PROMPTS, S >= MIN_SEEDS and a predicted half-width <=
    TARGET_HALF_WIDTH under each scenario, with its half-width and power."""
    lines = [f"{con.name}: the cheapest design with n_p >= {MIN_PROMPTS}, S >= {MIN_SEEDS}, 95% half-width <= "
             f"{TARGET_HALF_WIDTH} (power against a true {TARGET_EFFECT:+.2f}, two-sided alpha {ALPHA}):"]
    for name, c in scenarios(con).items():
        best = smallest_design(c)
        if best is None:
            lines.append(f"* {name}: no design of the grid")
            continue
        n, d, s = best
        lines.append(f"* {name}: n_p = {n}, D = {d}, S = {s}: half-width {half_width(c, n, d, s):.3f} "
                     f"(OLS {half_width(c, n, d, s) * ols_factor(n, s):.3f}), power {power(c, n, d, s):.2f}")
    point = scenarios(con)["point"]
    best = smallest_design(point, width=random_seed_half_width)
    if best is None:
        lines.append("* seeds random (point components): no design of the grid")
    else:
        n, d, s = best
        lines.append(f"* seeds random (point components): n_p = {n}, D = {d}, S = {s}: half-width "
                     f"{random_seed_half_width(point, n, d, s):.3f}, power {random_seed_power(point, n, d, s):.2f}")
    return "\n".join(lines)


def concentrated_effect_power(c: Components, n_prompts: int, draws: int, seeds: int,
                              effect: float = TARGET_EFFECT) -> float:
    """Power when the mean difference ``effect`` is carried by a share ``effect`` of the prompts at +1
    each (0 elsewhere): the prompt x arm variance grows by effect (1 - effect), the most an effect
    within [0, 1] per prompt can add."""
    return power(replace(c, prompt=c.prompt + effect * (1 - effect)), n_prompts, draws, seeds, effect)


def analyze(results: Path = RESULTS, baseline: str = "dr_grpo", arms: tuple[str, ...] = ("redr", "remax")) -> str:
    """The report: the data line, the components of each contrast, the first contrast's design grid and
    the recommended designs."""
    df, failed = load(results)
    if failed:
        raise ValueError(f"runs with unscorable completions: {failed}")
    cons = [contrast(df, arm, baseline) for arm in arms]
    main_con = cons[0]
    ms = main_con.ms
    head = (f"Variance components of the per-(prompt, seed) pass@8 difference against {baseline} "
            f"({ms.n_prompts} eval prompts x {ms.n_seeds} train seeds, one draw of {K}); two-way ANOVA, "
            "method of moments, negative estimates set to 0; draw variance for one draw of each arm, "
            "independent draws assumed.")
    parts = [head, components_table(cons), design_table(main_con), recommendations(main_con)]
    parts += [recommendations(con) for con in cons[1:]]
    upper = scenarios(main_con)["upper 80%"]
    best = smallest_design(upper)
    if best is not None:
        n, d, s = best
        parts.append(f"Power of n_p = {n}, D = {d}, S = {s} when the {TARGET_EFFECT:+.2f} is carried by "
                     f"{TARGET_EFFECT:.0%} of prompts at +1 (upper-80% components): "
                     f"{concentrated_effect_power(upper, n, d, s):.2f}")
    return "\n\n".join(parts)


def main() -> int:
    print(analyze())
    return 0


if __name__ == "__main__":
    sys.exit(main())
