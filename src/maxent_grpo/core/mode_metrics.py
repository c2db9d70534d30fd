"""ModeBench's metrics (ALGORITHMS.md §18; ``modebench/metrics.py`` 0.4.0): empirical accuracy,
pass@k and distinct@k per group, and PCMD, the pairwise correct-mode diversity.

For one prompt's group of ``k`` responses, ``K`` verified, ``n_m`` of them in mode ``m``:

* accuracy ``K/k``; pass@k ``1[K >= 1]`` (the group is the sample, not §10's estimator);
  distinct@k the number of distinct verified keys;
* PCMD ``D = 1 - sum_m n_m (n_m - 1) / (K (K - 1))``, defined iff ``K >= 2`` (None
  otherwise): the unbiased Gini-Simpson index of the success-conditional mode
  distribution, so accuracy cancels. ``POOLED`` (the default, the anchor's tables) adds a
  prompt's groups' counts first; ``PER_GROUP`` averages the defined groups.
* A cell (prompts of one task) averages prompts with equal weight; its PCMD is the mean
  over defined prompts, reported with its support, a standard error, ``1 + PCMD``
  (rarefied distinct at depth 2) and ``1 / (1 - PCMD)`` (effective modes), and is
  *reportable* iff at least ``min_defined_prompts`` (30) prompts are defined and no
  attempt was unscorable. One unscorable attempt nulls every value (reason
  ``verifier_failure``).

Pure Python.
"""

from __future__ import annotations

import math
import statistics
from collections import Counter
from collections.abc import Iterable, Mapping, Sequence

__all__ = ["POOLED", "PER_GROUP", "Attempt", "cell_summary", "effective_modes", "mode_diversity",
           "modebench_cell", "prompt_pcmd", "rarefied_distinct"]

POOLED, PER_GROUP = "pooled", "per_group"
MIN_DEFINED_PROMPTS = 30

# One graded response: (verified, canonical key or None, unscorable).
Attempt = tuple[bool, "str | None", bool]


def _counts(counts: Mapping | Iterable[int]) -> list[int]:
    values = list(counts.values()) if isinstance(counts, Mapping) else list(counts)
    if any(isinstance(n, bool) or not isinstance(n, int) or n < 0 for n in values):
        raise ValueError(f"mode counts must be non-negative ints, got {values}")
    return values


def mode_diversity(counts: Mapping | Iterable[int]) -> float | None:
    """PCMD of one prompt's verified-mode counts; None below 2 verified responses."""
    values = _counts(counts)
    total = sum(values)
    if total < 2:
        return None
    return 1.0 - sum(n * (n - 1) for n in values) / (total * (total - 1))


def rarefied_distinct(counts: Mapping | Iterable[int], depth: int = 2) -> float | None:
    """Expected distinct modes among ``depth`` verified draws without replacement,
    ``sum_m [1 - prod_{i<depth} (K - n_m - i) / (K - i)]``; None when ``K < depth``."""
    if isinstance(depth, bool) or not isinstance(depth, int) or depth < 1:
        raise ValueError(f"depth must be an int >= 1, got {depth!r}")
    values = _counts(counts)
    total = sum(values)
    if total < depth:
        return None
    expected = 0.0
    for n in values:
        if n:
            missed = 1.0
            for i in range(depth):
                missed *= (total - n - i) / (total - i)
            expected += 1.0 - missed
    return expected


def effective_modes(pcmd: float | None) -> float | None:
    """``1 / (1 - PCMD)`` of an already aggregated PCMD; None for None or 1."""
    if pcmd is None:
        return None
    if not math.isfinite(pcmd) or not 0.0 <= pcmd <= 1.0:
        raise ValueError(f"PCMD must be in [0, 1], got {pcmd!r}")
    return None if pcmd == 1.0 else 1.0 / (1.0 - pcmd)


def _verified_counts(group: Sequence[Attempt]) -> Counter:
    return Counter(key for verified, key, _ in group if verified)


def prompt_pcmd(groups: Sequence[Sequence[Attempt]], aggregation: str = POOLED) -> float | None:
    """One prompt's PCMD over its groups, pooled or per group."""
    if aggregation == POOLED:
        pooled: Counter = Counter()
        for group in groups:
            pooled.update(_verified_counts(group))
        return mode_diversity(pooled)
    if aggregation != PER_GROUP:
        raise ValueError(f"aggregation must be {POOLED!r} or {PER_GROUP!r}, got {aggregation!r}")
    defined = [v for v in (mode_diversity(_verified_counts(g)) for g in groups) if v is not None]
    return statistics.fmean(defined) if defined else None


def cell_summary(values: Sequence[float | None], min_defined_prompts: int = MIN_DEFINED_PROMPTS) -> dict:
    """A cell's PCMD from its prompts' values (None where undefined), with its support."""
    if isinstance(min_defined_prompts, bool) or not isinstance(min_defined_prompts, int) or min_defined_prompts < 1:
        raise ValueError(f"min_defined_prompts must be an int >= 1, got {min_defined_prompts!r}")
    defined = [v for v in values if v is not None]
    mean = statistics.fmean(defined) if defined else None
    return {
        "pcmd": mean,
        "defined_prompts": len(defined),
        "prompts": len(values),
        "support": len(defined) / len(values) if values else 0.0,
        "reportable": len(defined) >= min_defined_prompts,
        "standard_error": statistics.stdev(defined) / math.sqrt(len(defined)) if len(defined) > 1 else None,
        "rarefied_distinct_at_2": None if mean is None else 1.0 + mean,
        "effective_modes": effective_modes(mean),
    }


def modebench_cell(prompts: Sequence[Sequence[Sequence[Attempt]]], *, aggregation: str = POOLED,
                   min_defined_prompts: int = MIN_DEFINED_PROMPTS, failed_elsewhere: bool = False) -> dict:
    """The ``mb/`` metrics of one cell: ``prompts[p][d]`` is draw ``d`` (a group of ``k`` attempts)
    of prompt ``p``. accuracy, pass@k and distinct@k are averaged over a prompt's groups, then
    over prompts; PCMD as :func:`cell_summary`. Any unscorable attempt nulls every value, and so
    does ``failed_elsewhere`` (an unscorable attempt in another cell of the same evaluation)."""
    if not prompts or any(not groups or any(not g for g in groups) for groups in prompts):
        raise ValueError("a ModeBench cell needs at least one prompt, each with at least one non-empty group")
    if failed_elsewhere or any(unscorable for groups in prompts for g in groups for _, _, unscorable in g):
        return {"accuracy": None, "pass@k": None, "distinct@k": None, "pcmd": None, "defined_prompts": None,
                "prompts": len(prompts), "standard_error": None, "reportable": False, "status": "verifier_failure"}

    def per_prompt(fn) -> float:
        return statistics.fmean(statistics.fmean(fn(g) for g in groups) for groups in prompts)

    summary = cell_summary([prompt_pcmd(groups, aggregation) for groups in prompts], min_defined_prompts)
    return {
        "accuracy": per_prompt(lambda g: sum(v for v, _, _ in g) / len(g)),
        "pass@k": per_prompt(lambda g: float(any(v for v, _, _ in g))),
        "distinct@k": per_prompt(lambda g: float(len(_verified_counts(g)))),
        "pcmd": summary["pcmd"],
        "defined_prompts": summary["defined_prompts"],
        "prompts": summary["prompts"],
        "standard_error": summary["standard_error"],
        "reportable": summary["reportable"],
        "status": "complete",
    }
