"""Eval metrics against brute force over every k-subset of the samples."""

from __future__ import annotations

import itertools
import math
import random
from fractions import Fraction

import pytest

from maxent_grpo.core.eval_metrics import (
    PromptSamples,
    coverage_at_k,
    distinct_at_k,
    distinct_correct,
    mean_at_k,
    pass_at_k,
    summarize_eval,
)


def _subsets(n, k):
    return list(itertools.combinations(range(n), k))


def brute_pass(correct, k):
    subsets = _subsets(len(correct), k)
    return Fraction(sum(any(correct[i] for i in s) for s in subsets), len(subsets))


def brute_mean(scores, k):
    subsets = _subsets(len(scores), k)
    return sum(Fraction(sum(Fraction(scores[i]) for i in s), k) for s in subsets) / len(subsets)


def brute_distinct(answers, correct, k):
    subsets = _subsets(len(answers), k)
    total = sum(len({answers[i] for i in s if correct[i] and answers[i] is not None}) for s in subsets)
    return Fraction(total, len(subsets))


@pytest.mark.parametrize("n", range(1, 9))
def test_pass_at_k_matches_subset_enumeration(n):
    for c in range(n + 1):
        correct = [True] * c + [False] * (n - c)
        for k in range(1, n + 1):
            assert pass_at_k(n, c, k) == pytest.approx(float(brute_pass(correct, k)), abs=1e-12)


def test_pass_at_k_boundaries_and_large_n():
    assert pass_at_k(10, 0, 3) == 0.0
    assert pass_at_k(10, 10, 1) == 1.0
    assert pass_at_k(10, 8, 3) == 1.0  # fewer than k wrong samples: some correct one is always drawn
    assert pass_at_k(5, 2, 1) == pytest.approx(0.4)  # pass@1 is the fraction correct
    # n in the thousands: binomials overflow float, the product form does not.
    n, c, k = 2000, 37, 100
    exact = 1 - Fraction(math.comb(n - c, k), math.comb(n, k))
    assert pass_at_k(n, c, k) == pytest.approx(float(exact), rel=1e-12)
    # Monotone in k and in c.
    assert pass_at_k(50, 5, 10) < pass_at_k(50, 5, 20) < pass_at_k(50, 6, 20)


@pytest.mark.parametrize("bad", [dict(n=0, c=0, k=1), dict(n=4, c=5, k=1), dict(n=4, c=1, k=5), dict(n=4, c=1, k=0)])
def test_pass_at_k_rejects_bad_arguments(bad):
    with pytest.raises(ValueError, match="must be"):
        pass_at_k(**bad)


def test_mean_at_k_matches_subset_enumeration():
    rng = random.Random(0)
    for n in range(1, 7):
        scores = [rng.choice([0.0, 0.25, 0.5, 1.0]) for _ in range(n)]
        for k in range(1, n + 1):
            assert mean_at_k(scores, k) == pytest.approx(float(brute_mean(scores, k)), abs=1e-12)
    with pytest.raises(ValueError, match="k"):
        mean_at_k([1.0, 0.0], 3)


def test_distinct_at_k_matches_subset_enumeration():
    rng = random.Random(1)
    for _ in range(40):
        n = rng.randint(1, 8)
        answers = [rng.choice(["1", "2", "3", None]) for _ in range(n)]
        correct = [rng.random() < 0.6 for _ in range(n)]
        for k in range(1, n + 1):
            expected = brute_distinct(answers, correct, k)
            assert distinct_at_k(answers, correct, k) == pytest.approx(float(expected), abs=1e-12)
        # With k = n every sample is drawn: the plain count.
        assert distinct_at_k(answers, correct, n) == pytest.approx(distinct_correct(answers, correct))


def test_distinct_correct_counts_only_correct_parsed_answers():
    answers = ["4", "4", "5", None, "6", "x"]
    correct = [True, True, True, True, False, False]
    assert distinct_correct(answers, correct) == 2
    with pytest.raises(ValueError, match="same length"):
        distinct_correct(["1"], [True, False])


def test_coverage_at_k():
    assert coverage_at_k(3, 4) == 0.75
    with pytest.raises(ValueError, match="num_valid"):
        coverage_at_k(1, 0)
    with pytest.raises(ValueError, match="distinct"):
        coverage_at_k(5, 4)


def test_summarize_eval_averages_the_brute_force_values_over_prompts():
    prompts = [
        PromptSamples(scores=[1, 0, 1, 0, 0], answers=["7", "8", "7", None, "9"], greedy_correct=True, num_valid=2),
        PromptSamples(scores=[0, 0, 0, 0, 0], answers=["1", "2", "3", "4", "5"], greedy_correct=False),
        PromptSamples(scores=[1.0, 0.5, 1.0, 1.0, 0.0], answers=["a", "b", "c", "a", None]),
    ]
    ks = [1, 2, 4]
    out = summarize_eval(prompts, ks)
    for k in ks:
        flags = [[s >= 1.0 for s in p.scores] for p in prompts]
        exp_pass = sum(brute_pass(f, k) for f in flags) / 3
        exp_mean = sum(brute_mean(p.scores, k) for p in prompts) / 3
        exp_distinct = sum(brute_distinct(p.answers, f, k) for p, f in zip(prompts, flags)) / 3
        assert out[f"pass@{k}"] == pytest.approx(float(exp_pass), abs=1e-12)
        assert out[f"mean@{k}"] == pytest.approx(float(exp_mean), abs=1e-12)
        assert out[f"distinct@{k}"] == pytest.approx(float(exp_distinct), abs=1e-12)
        # coverage only over the one prompt that enumerates its valid answers
        assert out[f"coverage@{k}"] == pytest.approx(float(brute_distinct(prompts[0].answers, flags[0], k)) / 2)
    assert out["greedy_pass@1"] == 0.5
    assert out["num_prompts"] == 3
    # The threshold decides what counts as correct: 0.5 makes prompt 3's "b" correct too.
    loose = summarize_eval(prompts, [4], correct_threshold=0.5)
    assert loose["distinct@4"] > out["distinct@4"]


def test_summarize_eval_accepts_tuples_and_omits_optional_keys():
    out = summarize_eval([([1, 0], ["2", "3"]), ([0, 0], ["1", "1"])], [1, 2])
    assert out["pass@1"] == pytest.approx(0.25)
    assert out["pass@2"] == pytest.approx(0.5)
    assert "greedy_pass@1" not in out and "coverage@1" not in out


def test_summarize_eval_rejects_too_few_samples():
    with pytest.raises(ValueError, match="max\\(ks\\)"):
        summarize_eval([([1, 0], ["2", "3"])], [4])
    with pytest.raises(ValueError, match="ks"):
        summarize_eval([([1, 0], ["2", "3"])], [])


def test_summarize_eval_takes_greedy_and_num_valid_as_arguments_too():
    samples = [([1, 0, 1], ["7", "8", "7"]), ([0, 0, 1], ["1", "2", "3"])]
    by_argument = summarize_eval(samples, [2], greedy=[True, False], num_valid=[2, None])
    per_prompt = summarize_eval(
        [PromptSamples(*samples[0], greedy_correct=True, num_valid=2), PromptSamples(*samples[1], greedy_correct=False)],
        [2],
    )
    assert by_argument == per_prompt
    assert by_argument["greedy_pass@1"] == 0.5
    with pytest.raises(ValueError, match="greedy has 1 entries for 2 prompts"):
        summarize_eval(samples, [2], greedy=[True])
    with pytest.raises(ValueError, match="num_valid is given both"):
        summarize_eval([PromptSamples(*samples[0], num_valid=2)], [2], num_valid=[2])
