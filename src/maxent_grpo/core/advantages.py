"""Rewards to group advantages (ALGORITHMS.md §2).

Layout: ``P`` prompts x ``G`` generations, prompt-major, so rows
``p*G .. p*G+G-1`` are prompt ``p`` and ``N = P*G``. A reward of ``NaN`` marks a
row for which every reward function returned ``None``: it gets advantage 0 and
is left out of its group's statistics.

A group is "zero-std" when its valid rewards are all equal (or it has fewer than
two valid rewards). Equality is tested exactly (max == min) instead of reading
``std == 0``, because a float mean of equal values is not always that value
(``(0.1+0.1+0.1)/3 != 0.1``), which would leave tiny non-zero advantages.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

# Added to the standard deviation before dividing (TRL's constant).
STD_EPS = 1e-4

SCALE_REWARDS = ("group", "batch", "none")

# REINFORCE++'s floor on the token variance before ``rsqrt`` (OpenRLHF ``var.clamp(min=1e-8)``).
WHITEN_VAR_EPS = 1e-8


@dataclass(frozen=True)
class AdvantageInputs:
    """What an advantage estimator reads: one batch, grouped ``[P, G]`` (prompt-major).

    ``rewards``: ``NaN`` marks a row no reward function scored. ``token_counts``: the
    completion tokens of each row that enter the loss (None where the caller has none;
    estimators registered with ``needs_token_counts`` refuse that).
    """

    rewards: torch.Tensor
    scale_rewards: str
    token_counts: torch.Tensor | None = None


@dataclass(frozen=True)
class AdvantageEstimator:
    """A registered ``loss.advantage_estimator``: ``fn`` maps :class:`AdvantageInputs` to the
    advantages ``[P, G]`` (0 on ``NaN`` rows); ``scale_rewards`` are the values it accepts."""

    name: str
    fn: Callable[[AdvantageInputs], torch.Tensor]
    help: str
    scale_rewards: tuple[str, ...] = SCALE_REWARDS
    needs_token_counts: bool = False


ADVANTAGE_ESTIMATORS: dict[str, AdvantageEstimator] = {}


def register_advantage_estimator(
    name: str, help: str, *, scale_rewards: tuple[str, ...] = SCALE_REWARDS, needs_token_counts: bool = False,
) -> Callable[[Callable[[AdvantageInputs], torch.Tensor]], Callable[[AdvantageInputs], torch.Tensor]]:
    """Register ``fn`` as ``loss.advantage_estimator: name`` (verl's ``register_adv_est``)."""

    def wrap(fn: Callable[[AdvantageInputs], torch.Tensor]) -> Callable[[AdvantageInputs], torch.Tensor]:
        if name in ADVANTAGE_ESTIMATORS:
            raise ValueError(f"advantage estimator {name!r} is registered twice")
        ADVANTAGE_ESTIMATORS[name] = AdvantageEstimator(name, fn, help, scale_rewards, needs_token_counts)
        return fn

    return wrap


def advantage_settings_problem(estimator: str, scale_rewards: str) -> str | None:
    """Why ``scale_rewards`` does not go with ``estimator`` (one line naming both), or None."""
    if estimator not in ADVANTAGE_ESTIMATORS:
        return f"advantage_estimator must be one of {sorted(ADVANTAGE_ESTIMATORS)}, got {estimator!r}"
    if scale_rewards not in SCALE_REWARDS:
        return f"scale_rewards must be one of {list(SCALE_REWARDS)}, got {scale_rewards!r}"
    allowed = ADVANTAGE_ESTIMATORS[estimator].scale_rewards
    if scale_rewards not in allowed:
        return (f"scale_rewards must be {' or '.join(allowed)} with advantage_estimator {estimator!r} "
                f"(its advantages are already scaled), got {scale_rewards!r}")
    return None


def combine_rewards(per_function: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
    """Weighted nan-sum over reward functions: ``[N, K]`` x ``[K]`` -> ``[N]``.

    ``NaN`` entries (the function returned ``None``) are skipped; a row where every
    function is ``NaN`` stays ``NaN``.
    """
    if per_function.dim() != 2:
        raise ValueError(f"per_function must be [N, K], got shape {tuple(per_function.shape)}")
    if weights.dim() != 1 or weights.shape[0] != per_function.shape[1]:
        raise ValueError(
            f"weights must be [K={per_function.shape[1]}], got shape {tuple(weights.shape)}"
        )
    missing = torch.isnan(per_function)
    weighted = torch.where(missing, torch.zeros_like(per_function), per_function * weights.to(per_function))
    total = weighted.sum(dim=1)
    return torch.where(missing.all(dim=1), torch.full_like(total, float("nan")), total)


REWARD_AGGREGATIONS = ("sum_then_normalize", "normalize_then_sum")


def normalize_then_sum(per_function: torch.Tensor, weights: torch.Tensor, num_generations: int) -> torch.Tensor:
    """GDPO's aggregation (arXiv 2601.05242; TRL ``multi_objective_aggregation="normalize_then_sum"``):
    each reward function normalised over its group first, then the weighted sum,
    ``r_i = sum_k w_k (r_ik - mean_g r_k) / (std_g r_k + 1e-4)``: ``[N, K]`` x ``[K]`` -> ``[N]``.

    A sparse 0/1 reward is then not drowned by a dense one with a larger spread. Mean and
    (unbiased) std skip ``NaN`` entries; a ``NaN`` entry adds nothing; a row where every
    function is ``NaN`` stays ``NaN``. Follow it with ``scale_rewards: batch`` for TRL's
    advantages: the sum has group mean 0 (no ``NaN`` rows), so the group-centred and
    batch-centred versions agree.
    """
    if per_function.dim() != 2:
        raise ValueError(f"per_function must be [N, K], got shape {tuple(per_function.shape)}")
    n, k = per_function.shape
    if weights.dim() != 1 or weights.shape[0] != k:
        raise ValueError(f"weights must be [K={k}], got shape {tuple(weights.shape)}")
    grouped = per_function.T.reshape(k * (n // num_generations), num_generations) if n % num_generations == 0 else None
    if grouped is None or num_generations < 2:
        raise ValueError(f"per_function rows ({n}) must be groups of num_generations={num_generations} >= 2")
    _, _, mean, std = _group_moments(grouped)
    normalised = ((grouped - mean[:, None]) / (std[:, None] + STD_EPS)).reshape(k, n).T
    return combine_rewards(normalised, weights)


def zero_truncated_rewards(rewards: torch.Tensor, truncated: torch.Tensor) -> torch.Tensor:
    """Reward 0 for completions that hit ``max_completion_length`` without EOS."""
    if truncated.shape != rewards.shape or truncated.dtype != torch.bool:
        raise ValueError(
            f"truncated must be a bool tensor shaped like rewards {tuple(rewards.shape)}, "
            f"got {truncated.dtype} {tuple(truncated.shape)}"
        )
    return torch.where(truncated, torch.zeros_like(rewards), rewards)


def _grouped(rewards: torch.Tensor, num_generations: int) -> torch.Tensor:
    if isinstance(num_generations, bool) or not isinstance(num_generations, int):
        raise ValueError(f"num_generations must be an int, got {num_generations!r}")
    if num_generations < 2:
        raise ValueError(f"num_generations must be >= 2 for group statistics, got {num_generations}")
    if rewards.dim() != 1:
        raise ValueError(f"rewards must be 1-D [N], got shape {tuple(rewards.shape)}")
    if rewards.shape[0] % num_generations != 0:
        raise ValueError(
            f"rewards has {rewards.shape[0]} rows, not a multiple of num_generations={num_generations}"
        )
    return rewards.view(-1, num_generations)


def _group_moments(r: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Per group ``[P, G]``: valid mask, count, mean and unbiased std over valid entries."""
    valid = ~torch.isnan(r)
    n = valid.sum(dim=1)
    r0 = torch.where(valid, r, torch.zeros_like(r))
    mean = r0.sum(dim=1) / n.clamp(min=1)
    dev = torch.where(valid, r - mean[:, None], torch.zeros_like(r))
    var = (dev * dev).sum(dim=1) / (n - 1).clamp(min=1)
    return valid, n, mean, var.sqrt()


def zero_std_groups(rewards: torch.Tensor, num_generations: int) -> torch.Tensor:
    """``[P]`` bool: the group's valid rewards are all equal (or fewer than two are valid)."""
    return _zero_std(_grouped(rewards, num_generations))


def _zero_std(r: torch.Tensor) -> torch.Tensor:
    valid = ~torch.isnan(r)
    hi = torch.where(valid, r, torch.full_like(r, -torch.inf)).amax(dim=1)
    lo = torch.where(valid, r, torch.full_like(r, torch.inf)).amin(dim=1)
    return (valid.sum(dim=1) < 2) | (hi == lo)


def group_reward_std(rewards: torch.Tensor, num_generations: int) -> torch.Tensor:
    """``[P]`` unbiased reward std per group over valid rows; exactly 0 for zero-std groups."""
    r = _grouped(rewards, num_generations)
    _, _, _, std = _group_moments(r)
    return torch.where(zero_std_groups(rewards, num_generations), torch.zeros_like(std), std)


def _batch_std(rewards: torch.Tensor) -> torch.Tensor:
    valid = rewards[~torch.isnan(rewards)]
    if valid.numel() < 2:
        return torch.zeros((), dtype=rewards.dtype, device=rewards.device)
    return valid.std(unbiased=True)




def _group_baseline(centre: Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]):
    """An estimator from a centring ``(r [P, G], valid counts [P], valid means [P]) -> [P, G]``,
    then §2's ``scale_rewards``; ``NaN`` rows and zero-std groups get exactly 0."""

    def estimator(inputs: AdvantageInputs) -> torch.Tensor:
        r = inputs.rewards
        valid, n, mean, std = _group_moments(r)
        adv = centre(r, n, mean)
        if inputs.scale_rewards == "group":
            adv = adv / (std[:, None] + STD_EPS)
        elif inputs.scale_rewards == "batch":
            adv = adv / (_batch_std(r.reshape(-1)) + STD_EPS)
        keep = valid & ~_zero_std(r)[:, None]
        return torch.where(keep, adv, torch.zeros_like(adv))

    return estimator


def _grpo_centered(r: torch.Tensor, n: torch.Tensor, mean: torch.Tensor) -> torch.Tensor:
    return r - mean[:, None]


def _rloo_centered(r: torch.Tensor, n: torch.Tensor, mean: torch.Tensor) -> torch.Tensor:
    # r_i - mean_{j != i} r_j == n/(n-1) * (r_i - mean), with n the group's valid count.
    n = n.to(r.dtype)
    return (n / (n - 1).clamp(min=1))[:, None] * (r - mean[:, None])


register_advantage_estimator("grpo", "group mean baseline, A_i = r_i - mean_g(r)")(_group_baseline(_grpo_centered))
register_advantage_estimator(
    "rloo", "leave-one-out baseline, A_i = r_i - mean_{j!=i} r_j")(_group_baseline(_rloo_centered))


class NonBinaryRewardError(ValueError):
    """A reward other than 0.0 or 1.0 reached an estimator defined for binary rewards only."""


def check_binary_rewards(rewards: torch.Tensor, what: str) -> None:
    """``ValueError`` naming the first valid (non-NaN) reward of ``rewards [P, G]`` that is not
    exactly 0.0 or 1.0, and its row (prompt-major ``p*G + i``): :class:`NonBinaryRewardError`."""
    bad = ~torch.isnan(rewards) & (rewards != 0) & (rewards != 1)
    if bad.any():
        row = int(torch.nonzero(bad.reshape(-1))[0])
        value = float(rewards.reshape(-1)[row])
        raise NonBinaryRewardError(f"{what} needs binary rewards (exactly 0.0 or 1.0): row {row} has reward {value!r} "
                         f"({int(bad.sum())} such rows in the batch)")


@register_advantage_estimator(
    "maxrl", "MaxRL (arXiv 2602.02710): A_i = G_v*r_i/K - 1 for binary rewards, K successes of G_v "
    "valid rows (0 when K = 0); needs scale_rewards none", scale_rewards=("none",))
def maxrl_advantages(inputs: AdvantageInputs) -> torch.Tensor:
    """MaxRL advantages (arXiv 2602.02710; ALGORITHMS.md §16, "Chosen"): ``[P, G]`` -> ``[P, G]``.

    Per group, over its valid rows only (``NaN``: no reward applied; such a row gets 0 and is
    not counted): ``G_v`` valid rows, ``K = sum r`` successes, and

        ``A_i = (G_v * r_i) / K - 1``  if ``K > 0`` and ``G_v >= 2``, else 0,

    i.e. ``(r_i - rbar) / rbar`` with ``rbar = K / G_v``: a success gets ``(G_v-K)/K``, a
    failure ``-1``, each group sums to 0, and ``K = G_v`` gives exactly 0. Computed in the
    reward dtype in remax's order (``remax/core/objectives.py`` ``binary_maxrl_advantages``:
    ``(r*G)/max(K, 1) - 1``), so float64 agrees bit for bit. Every valid reward must be
    exactly 0.0 or 1.0 (``ValueError`` naming the value and its row); ``scale_rewards`` must be
    ``none`` (dividing by ``rbar`` is the scaling).
    """
    r = inputs.rewards
    if inputs.scale_rewards != "none":
        raise ValueError(advantage_settings_problem("maxrl", inputs.scale_rewards))
    check_binary_rewards(r, "advantage_estimator maxrl")
    valid = ~torch.isnan(r)
    r0 = torch.where(valid, r, torch.zeros_like(r))
    g_v = valid.sum(dim=1).to(r.dtype)[:, None]  # [P, 1]
    k = r0.sum(dim=1, keepdim=True)  # [P, 1], an exact integer count
    adv = (g_v * r0) / k.clamp(min=1) - 1
    keep = valid & (k > 0) & (g_v >= 2)
    return torch.where(keep, adv, torch.zeros_like(adv))


def maxrl_group_stats(rewards: torch.Tensor, num_generations: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Per group with at least one valid reward: the success rate ``K / G_v`` and ``K == 0``
    (``[P']`` float and bool; the ``maxrl/success_rate`` and ``maxrl/no_success_frac`` metrics)."""
    r = _grouped(rewards, num_generations)
    valid = ~torch.isnan(r)
    g_v = valid.sum(dim=1)
    k = torch.where(valid, r, torch.zeros_like(r)).sum(dim=1)
    has = g_v > 0
    return (k / g_v.clamp(min=1).to(r.dtype))[has], (k == 0)[has]


def _whiten_over_tokens(a: torch.Tensor, valid: torch.Tensor, token_counts: torch.Tensor) -> torch.Tensor:
    """``(a - mean) * rsqrt(max(var, 1e-8))`` with the mean and population variance over every
    valid completion token of the batch: row ``i`` counts ``T_i`` times. Rows with no tokens (or
    ``NaN`` reward) get 0 and are not counted; when every counted value is equal, exactly 0."""
    w = torch.where(valid, token_counts.to(a.dtype), torch.zeros_like(a))
    counted = w > 0
    if not counted.any():
        return torch.zeros_like(a)
    hi = torch.where(counted, a, torch.full_like(a, -torch.inf)).amax()
    lo = torch.where(counted, a, torch.full_like(a, torch.inf)).amin()
    if hi == lo:
        return torch.zeros_like(a)
    n = w.sum()
    a0 = torch.where(counted, a, torch.zeros_like(a))
    mean = (w * a0).sum() / n
    dev = torch.where(counted, a0 - mean, torch.zeros_like(a))
    var = (w * dev * dev).sum() / n
    return torch.where(counted, dev * var.clamp(min=WHITEN_VAR_EPS).rsqrt(), torch.zeros_like(a))


def _token_counts(inputs: AdvantageInputs, name: str) -> torch.Tensor:
    t = inputs.token_counts
    if t is None:
        raise ValueError(f"advantage_estimator {name} needs the completions' token counts (token_counts)")
    if t.shape != inputs.rewards.shape or bool((t < 0).any()):
        raise ValueError(f"token_counts must be >= 0 and shaped like the rewards {tuple(inputs.rewards.shape)}, "
                         f"got {tuple(t.shape)}")
    return t


@register_advantage_estimator(
    "reinforce_pp", "REINFORCE++ (arXiv 2501.03262): the sequence reward whitened over the batch's completion "
    "tokens, no baseline; needs scale_rewards none", scale_rewards=("none",), needs_token_counts=True)
def reinforce_pp_advantages(inputs: AdvantageInputs) -> torch.Tensor:
    """REINFORCE++ outcome advantages (arXiv 2501.03262): ``[P, G]`` rewards -> ``[P, G]``.

    Outcome reward, ``gamma = 1``, no critic and no KL in the reward (our KL is in the loss):
    every token of completion ``i`` has return ``r_i``, and the returns are whitened over all
    valid completion tokens of the batch (OpenRLHF ``_normalize_advantages``; verl
    ``compute_reinforce_plus_plus_outcome_advantage`` + ``masked_whiten``):

        ``A_i = (r_i - mu) * rsqrt(max(sigma^2, 1e-8))``,
        ``mu = sum_i T_i r_i / sum_i T_i``, ``sigma^2 = sum_i T_i (r_i - mu)^2 / sum_i T_i``.

    Our advantages are per sequence, and a sequence's token returns are all ``r_i``, so the
    token-level statistics are sequence statistics with each sequence counted once per valid
    token (``T_i = token_counts``, after any truncation mask): a 0-token completion adds
    nothing to them (and gets 0), nor does a ``NaN`` row. The variance is OpenRLHF's
    (population, floored at 1e-8 under the rsqrt); verl divides by ``N_tok - 1`` and adds 1e-8.
    A batch whose counted rewards are all equal gets exactly 0. §2's zero-std rule does not
    hold per group (no group baseline). "The batch" is what the caller passes (one process's).
    """
    if inputs.scale_rewards != "none":
        raise ValueError(advantage_settings_problem("reinforce_pp", inputs.scale_rewards))
    r = inputs.rewards
    return _whiten_over_tokens(r, ~torch.isnan(r), _token_counts(inputs, "reinforce_pp"))


@register_advantage_estimator(
    "reinforce_pp_baseline", "REINFORCE++-baseline: r_i - mean_g(r), then whitened over the batch's completion "
    "tokens; needs scale_rewards none", scale_rewards=("none",), needs_token_counts=True)
def reinforce_pp_baseline_advantages(inputs: AdvantageInputs) -> torch.Tensor:
    """REINFORCE++-baseline outcome advantages (arXiv 2501.03262): ``[P, G]`` -> ``[P, G]``.

    First the group baseline of §2, ``b_i = r_i - mean_g(r)`` over the group's valid rows
    (exactly 0 in a zero-std group; verl ``compute_reinforce_plus_plus_baseline_outcome_advantage``,
    OpenRLHF ``reinforce_baseline``: ``rewards - rewards.mean(-1)``), then the same token
    whitening as :func:`reinforce_pp_advantages`: ``A_i = (b_i - mu) * rsqrt(max(sigma^2, 1e-8))``
    with ``mu``, ``sigma^2`` over the batch's valid tokens (row ``i`` counted ``T_i`` times). The
    group mean counts every valid row whatever its length (a sequence-level baseline, as in both
    peers); the whitening shift ``mu`` makes a zero-std group's rows ``-mu / sigma``, not 0.
    """
    if inputs.scale_rewards != "none":
        raise ValueError(advantage_settings_problem("reinforce_pp_baseline", inputs.scale_rewards))
    r = inputs.rewards
    valid, _, mean, _ = _group_moments(r)
    centred = torch.where(valid & ~_zero_std(r)[:, None], r - mean[:, None], torch.zeros_like(r))
    return _whiten_over_tokens(centred, valid, _token_counts(inputs, "reinforce_pp_baseline"))


def compute_advantages(
    rewards: torch.Tensor,
    num_generations: int,
    *,
    estimator: str = "grpo",
    scale_rewards: str = "group",
    token_counts: torch.Tensor | None = None,
) -> torch.Tensor:
    """Advantages ``[N]`` from total rewards ``[N]`` (prompt-major groups of ``num_generations``).

    * ``estimator="grpo"``: ``A_i = r_i - mean_g(r)``; ``"rloo"``: ``A_i = r_i - mean_{j!=i} r_j``;
      ``"maxrl"``, ``"reinforce_pp"``, ``"reinforce_pp_baseline"``: see their functions
      (:data:`ADVANTAGE_ESTIMATORS` holds every registered one).
    * ``scale_rewards="group"``: divide by the group's unbiased std ``+ 1e-4``.
      ``"batch"``: divide by ``std(all valid rewards passed in) + 1e-4`` (unbiased,
      one scalar; the centring stays per group, as in TRL). Pass the whole
      optimizer batch, gathered over ranks, for that scalar to be the global one.
      ``"none"`` (Dr.GRPO): no division. An estimator may accept only some of these.
    * ``token_counts[N]``: each completion's tokens in the loss (the REINFORCE++ estimators
      whiten over them).
    * Rows with ``NaN`` reward get 0 and do not count in their group's statistics; for the
      group estimators, groups whose valid rewards are all equal get exactly 0.
    """
    problem = advantage_settings_problem(estimator, scale_rewards)
    if problem is not None:
        raise ValueError(problem)
    r = _grouped(rewards, num_generations)
    counts = None
    if token_counts is not None:
        if token_counts.shape != rewards.shape:
            raise ValueError(f"token_counts must be [N={rewards.shape[0]}], got shape {tuple(token_counts.shape)}")
        counts = token_counts.view(-1, num_generations)
    return ADVANTAGE_ESTIMATORS[estimator].fn(AdvantageInputs(r, scale_rewards, counts)).reshape(-1)
