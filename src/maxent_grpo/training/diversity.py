"""Per-group diversity of completions: distinct-n and mean pairwise Jaccard distance (§9)."""

from __future__ import annotations

from itertools import combinations


def distinct_n(token_lists: list[list[int]], n: int) -> float:
    """Distinct n-grams over all n-grams in the group (0 when the group has none)."""
    grams = [tuple(toks[i : i + n]) for toks in token_lists for i in range(len(toks) - n + 1)]
    return len(set(grams)) / len(grams) if grams else 0.0


def mean_pairwise_jaccard_distance(token_lists: list[list[int]]) -> float:
    """Mean over pairs of 1 - |A & B| / |A | B| on token sets (two empty sets are identical)."""
    sets = [set(t) for t in token_lists]
    pairs = list(combinations(sets, 2))
    if not pairs:
        return 0.0
    total = 0.0
    for a, b in pairs:
        union = a | b
        total += 1.0 - (len(a & b) / len(union) if union else 1.0)
    return total / len(pairs)


def group_diversity(groups: list[list[list[int]]]) -> dict[str, float]:
    """Averages over groups of distinct-1, distinct-2 and pairwise Jaccard distance."""
    if not groups:
        return {}
    k = len(groups)
    return {
        "diversity/distinct_1": sum(distinct_n(g, 1) for g in groups) / k,
        "diversity/distinct_2": sum(distinct_n(g, 2) for g in groups) / k,
        "diversity/jaccard_distance": sum(mean_pairwise_jaccard_distance(g) for g in groups) / k,
    }
