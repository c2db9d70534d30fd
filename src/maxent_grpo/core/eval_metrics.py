"""Evaluation metrics over n sampled completions per prompt (ALGORITHMS.md section 10).

Every ``@k`` metric here is the expectation over a uniformly random k-subset of
the n samples drawn for a prompt, so that n > k samples give a lower-variance
estimate of what k samples would show, without bias:

* ``pass@k``     P(at least one of the k is correct) = 1 - C(n-c, k) / C(n, k)
* ``mean@k``     E[mean score of the k] = mean score of all n
* ``distinct@k`` E[number of distinct correct answers among the k]
                 = sum over distinct correct answers a of pass@k(n, m_a, k),
                 m_a the number of samples that gave a (linearity of expectation)
* ``coverage@k`` distinct@k / number of valid answers, for tasks that enumerate them

Pure Python: no torch, no I/O.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Hashable, Sequence
from dataclasses import dataclass, replace

__all__ = [
    "PromptSamples",
    "coverage_at_k",
    "distinct_at_k",
    "distinct_correct",
    "mean_at_k",
    "pass_at_k",
    "summarize_eval",
]


def _check_nck(n: int, c: int, k: int) -> None:
    if not isinstance(n, int) or n < 1:
        raise ValueError(f"n must be a positive int, got {n!r}")
    if not isinstance(c, int) or not 0 <= c <= n:
        raise ValueError(f"c must be an int in [0, n={n}], got {c!r}")
    if not isinstance(k, int) or not 1 <= k <= n:
        raise ValueError(f"k must be an int in [1, n={n}], got {k!r}")


def pass_at_k(n: int, c: int, k: int) -> float:
    """Unbiased pass@k from ``n`` samples of which ``c`` are correct.

    ``C(n-c, k) / C(n, k) = prod_{i=n-c+1}^{n} (1 - k/i)``: the product form stays in
    [0, 1] at every factor, where the binomials overflow floats for large n.
    """
    _check_nck(n, c, k)
    if n - c < k:
        return 1.0
    all_wrong = 1.0
    for i in range(n - c + 1, n + 1):
        all_wrong *= 1.0 - k / i
    return 1.0 - all_wrong


def mean_at_k(scores: Sequence[float], k: int) -> float:
    """Expected mean score of a random k-subset of ``scores``: the mean of all of them."""
    n = len(scores)
    if n == 0:
        raise ValueError("scores must not be empty")
    if not isinstance(k, int) or not 1 <= k <= n:
        raise ValueError(f"k must be an int in [1, len(scores)={n}], got {k!r}")
    return float(sum(float(s) for s in scores) / n)


def _correct_answer_counts(answers: Sequence[Hashable | None], correct: Sequence[bool]) -> Counter:
    if len(answers) != len(correct):
        raise ValueError(f"answers ({len(answers)}) and correct ({len(correct)}) must have the same length")
    # A correct sample without a canonical answer cannot be told apart from others: not counted.
    return Counter(a for a, ok in zip(answers, correct) if ok and a is not None)


def distinct_correct(answers: Sequence[Hashable | None], correct: Sequence[bool]) -> int:
    """Number of distinct canonical answers among the correct samples (``None`` answers are not counted)."""
    return len(_correct_answer_counts(answers, correct))


def distinct_at_k(answers: Sequence[Hashable | None], correct: Sequence[bool], k: int) -> float:
    """Expected number of distinct correct answers in a random k-subset of the n samples."""
    counts = _correct_answer_counts(answers, correct)
    n = len(answers)
    if n == 0:
        raise ValueError("answers must not be empty")
    return float(sum(pass_at_k(n, m, k) for m in counts.values()))


def coverage_at_k(distinct: float, num_valid: int) -> float:
    """Fraction of a task's ``num_valid`` valid answers found: ``distinct / num_valid``."""
    if not isinstance(num_valid, int) or num_valid < 1:
        raise ValueError(f"num_valid must be a positive int, got {num_valid!r}")
    if distinct < 0 or distinct > num_valid:
        raise ValueError(f"distinct must be in [0, num_valid={num_valid}], got {distinct!r}")
    return float(distinct / num_valid)


@dataclass(frozen=True)
class PromptSamples:
    """The n sampled completions of one prompt, scored.

    ``scores`` are rewards in [0, 1] (or 0/1 correctness flags); a sample counts as
    correct when its score is at least ``summarize_eval``'s ``correct_threshold``.
    ``answers`` are the canonical (parsed, normalised) answers, ``None`` where none parsed.
    ``greedy_correct`` and ``num_valid`` are optional per-prompt extras.
    """

    scores: Sequence[float]
    answers: Sequence[Hashable | None]
    greedy_correct: bool | None = None
    num_valid: int | None = None


def _check_per_prompt(name: str, values: Sequence, already: list) -> None:
    if len(values) != len(already):
        raise ValueError(f"{name} has {len(values)} entries for {len(already)} prompts")
    if any(v is not None for v in already):
        raise ValueError(f"{name} is given both per prompt and as an argument")


def summarize_eval(
    per_prompt: Sequence[PromptSamples | tuple[Sequence[float], Sequence[Hashable | None]]],
    ks: Sequence[int],
    *,
    correct_threshold: float = 1.0,
    greedy: Sequence[bool] | None = None,
    num_valid: Sequence[int | None] | None = None,
) -> dict[str, float]:
    """Average the per-prompt metrics over prompts.

    Returns ``pass@k``, ``mean@k``, ``distinct@k`` for every k in ``ks``; ``coverage@k``
    averaged over the prompts that give ``num_valid``; ``greedy_pass@1`` averaged over
    the prompts that give ``greedy_correct``; and ``num_prompts``.
    Each prompt needs at least ``max(ks)`` samples. ``greedy`` and ``num_valid``, one
    entry per prompt, are another way to give ``greedy_correct`` and ``num_valid``.
    """
    if len(per_prompt) == 0:
        raise ValueError("per_prompt must not be empty")
    if len(ks) == 0 or any(not isinstance(k, int) or k < 1 for k in ks):
        raise ValueError(f"ks must be a non-empty list of positive ints, got {list(ks)!r}")
    prompts = [p if isinstance(p, PromptSamples) else PromptSamples(scores=p[0], answers=p[1]) for p in per_prompt]
    if greedy is not None:
        _check_per_prompt("greedy", greedy, [p.greedy_correct for p in prompts])
        prompts = [replace(p, greedy_correct=g) for p, g in zip(prompts, greedy)]
    if num_valid is not None:
        _check_per_prompt("num_valid", num_valid, [p.num_valid for p in prompts])
        prompts = [replace(p, num_valid=v) for p, v in zip(prompts, num_valid)]
    totals: dict[str, float] = {}
    coverage_count = 0
    greedy = []
    for i, p in enumerate(prompts):
        n = len(p.scores)
        if len(p.answers) != n:
            raise ValueError(f"per_prompt[{i}]: {n} scores but {len(p.answers)} answers")
        if n < max(ks):
            raise ValueError(f"per_prompt[{i}] has {n} samples, fewer than max(ks)={max(ks)}")
        correct = [float(s) >= correct_threshold for s in p.scores]
        c = sum(correct)
        if p.num_valid is not None:
            coverage_count += 1
        for k in ks:
            distinct = distinct_at_k(p.answers, correct, k)
            values = {
                f"pass@{k}": pass_at_k(n, c, k),
                f"mean@{k}": mean_at_k(p.scores, k),
                f"distinct@{k}": distinct,
            }
            if p.num_valid is not None:
                values[f"coverage@{k}"] = coverage_at_k(distinct, p.num_valid)
            for name, value in values.items():
                totals[name] = totals.get(name, 0.0) + value
        if p.greedy_correct is not None:
            greedy.append(bool(p.greedy_correct))
    summary = {}
    for name, total in totals.items():
        denominator = coverage_count if name.startswith("coverage@") else len(prompts)
        summary[name] = total / denominator
    if greedy:
        summary["greedy_pass@1"] = sum(greedy) / len(greedy)
    summary["num_prompts"] = float(len(prompts))
    return summary
