"""ModeBench tasks: verifiers, mode keys and mode counts on hand-worked examples; splits; the reward."""

from __future__ import annotations

import json
import random

import pytest
import torch

from maxent_grpo.core.eval_metrics import coverage_at_k, distinct_at_k
from maxent_grpo.rewards.registry import REWARD_FUNCTIONS
from maxent_grpo.tasks import coloring, countdown, pair_sum
from maxent_grpo.methods.xdr import distinct_best_answers
from maxent_grpo.tasks.modebench import TASKS, answer_key, mode_info, modebench_rows
from maxent_grpo.data.datasets import load_prompt_dataset
from maxent_grpo.errors import DataError

# ------------------------------------------------------------------ countdown


@pytest.mark.parametrize("expression", ["2 * 3 + 4", "4 + 3 * 2", "(2 * 3) + 4", "3*2+4", "2 × 3 + 4"])
def test_countdown_accepts_valid(expression):
    assert countdown.verify(expression, [2, 3, 4], 10)


@pytest.mark.parametrize("expression, why", [
    ("2 * 3 + 5", "5 is not given"),
    ("2 * 3 + 4 + 0", "an extra number"),
    ("10", "numbers unused"),
    ("2 * 5", "3 and 4 unused"),
    ("2 + 3 + 4", "equals 9"),
    ("(4 + 2 * 3", "does not parse"),
    ("2 ** 3 + 2", "power is not allowed"),
    ("-2 + 3 * 4", "unary minus is not allowed"),
    ("4 / (3 - 3) + 2", "division by zero"),
    ("import os", "not arithmetic"),
    (None, "no answer"),
])
def test_countdown_rejects_invalid(expression, why):
    assert not countdown.verify(expression, [2, 3, 4], 10), why


def test_countdown_exact_fractions():
    # 6 / (1 - 3/4) = 24 needs exact arithmetic through a non-integer intermediate.
    assert countdown.verify("6 / (1 - 3 / 4)", [6, 1, 3, 4], 24)
    assert countdown.evaluate_expression("1 / 3 * 3")[0] == 1
    assert countdown.verify("1 / 3 * 3", [1, 3, 3], 1)


def test_countdown_multiset_counts_repeats():
    assert countdown.verify("2 * 2 + 1", [2, 2, 1], 5)
    assert not countdown.verify("2 * 1 + 3", [2, 2, 1], 5)  # 3 not given, one 2 unused


def test_countdown_key_collisions():
    key = countdown.canonical_key
    # Commutativity and associativity of + and * (with - and / as inverses): one mode.
    assert key("3 + 4 - 1") == key("4 - 1 + 3") == key("4 - (1 - 3)") == key("(3 + 4) - 1")
    assert key("2 * 3 * 4") == key("4 * (3 * 2)")
    assert key("6 / 3 * 2") == key("2 * 6 / 3") == key("6 / (3 / 2)")
    # Different expressions, even of equal value, are different modes.
    assert key("(3 + 4) * 1") != key("(3 + 4) / 1")
    assert key("2 * 3") != key("2 + 4")
    assert key("4 - 1") != key("1 - 4")
    assert key("(1 + 2) * 3") != key("1 + 2 * 3")


def test_countdown_mode_enumeration_by_hand():
    # 1, 3, 4 -> 8: 1 + 3 + 4 and (3 - 1) * 4; nothing else (4 * 3 - 1 = 11, 4 / 1 * 3 = 12, ...).
    modes = countdown.enumerate_modes([1, 3, 4], 8)
    assert set(modes) == {countdown.canonical_key("1 + 3 + 4"), countdown.canonical_key("(3 - 1) * 4")}
    for key, expression in modes.items():
        assert countdown.mode_key(expression, [1, 3, 4], 8) == key
    # 2, 3, 4 -> 10: 2 * 3 + 4 and 4 * 3 - 2 (2 * 4 + 3 = 11, (2 + 3) * 4 = 20, 2 + 3 + 4 = 9, ...).
    assert set(countdown.enumerate_modes([2, 3, 4], 10)) == {
        countdown.canonical_key("2 * 3 + 4"), countdown.canonical_key("4 * 3 - 2")}


def test_countdown_problems_have_their_mode_count():
    rng = random.Random(3)
    for _ in range(20):
        p = countdown.make_problem(rng)
        assert 2 <= p["num_valid"] <= 8
        assert p["num_valid"] == len(countdown.enumerate_modes(p["numbers"], p["target"]))
        assert countdown.verify(p["example"], p["numbers"], p["target"])


# ------------------------------------------------------------------- colouring

# A 4-cycle 1-2-3-4-1.
NODES = ["1", "2", "3", "4"]
EDGES = [["1", "2"], ["2", "3"], ["3", "4"], ["4", "1"]]


def test_coloring_by_hand():
    fixed = {"1": "R", "3": "G"}
    # 2 and 4 each touch 1 (R) and 3 (G): only B is left for both.
    assert coloring.enumerate_modes(NODES, EDGES, fixed) == ["2=B,4=B"]
    assert coloring.verify("2=B, 4=B", NODES, EDGES, fixed)
    assert coloring.verify("4 = blue; 2 = B", NODES, EDGES, fixed)
    assert not coloring.verify("2=R, 4=B", NODES, EDGES, fixed)  # 2 clashes with 1
    assert not coloring.verify("2=B", NODES, EDGES, fixed)  # 4 missing
    assert not coloring.verify("2=B, 4=B, 1=R", NODES, EDGES, fixed)  # names a fixed node
    assert not coloring.verify("2=B, 2=B, 4=B", NODES, EDGES, fixed)  # a node twice
    assert not coloring.verify("2=Y, 4=B", NODES, EDGES, fixed)  # not a colour
    assert not coloring.verify("2=B, 4=B because", NODES, EDGES, fixed)  # extra text


def test_coloring_modes_and_key_collisions():
    fixed = {"1": "R"}  # 2, 3, 4 open on the 4-cycle: 2, 4 in {G, B}; 3 differs from both.
    modes = coloring.enumerate_modes(NODES, EDGES, fixed)
    # 2 = 4 = G: 3 in {R, B}; 2 = 4 = B: 3 in {R, G}; 2 != 4: 3 = R. 6 modes.
    assert len(modes) == 6
    assert coloring.mode_key("4=G, 3=R, 2=B", NODES, EDGES, fixed) == coloring.mode_key("2=B,3=R,4=G", NODES, EDGES, fixed)
    assert coloring.mode_key("2=G, 3=R, 4=B", NODES, EDGES, fixed) != coloring.mode_key("2=B, 3=R, 4=G", NODES, EDGES, fixed)
    assert coloring.mode_key("2=R, 3=G, 4=B", NODES, EDGES, fixed) is None


# -------------------------------------------------------------------- pair_sum


def test_pair_sum_by_hand():
    assert pair_sum.verify("3 + 4", 7) and pair_sum.verify("6+1", 7)
    assert not pair_sum.verify("0 + 7", 7) and not pair_sum.verify("3 + 5", 7) and not pair_sum.verify("3 + 4 + 0", 7)
    assert pair_sum.mode_key("3 + 4", 7) == pair_sum.mode_key("4+3", 7) == "3+4"
    assert pair_sum.mode_key("2 + 5", 7) != pair_sum.mode_key("3 + 4", 7)
    assert [pair_sum.num_valid(n) for n in (5, 7, 8, 16)] == [2, 3, 4, 8]


# ------------------------------------------------------------- data and reward


@pytest.mark.parametrize("task", sorted(TASKS))
def test_splits_are_leak_free_and_eval_is_fixed(task):
    train = {r["mb_problem"] for r in modebench_rows(task, size=300, seed=1)}
    evals = modebench_rows(task, size=30, seed=0, split="eval")
    assert not train & {r["mb_problem"] for r in evals}
    assert evals == modebench_rows(task, size=30, seed=7, split="eval")  # seed-independent
    assert len({r["mb_problem"] for r in evals}) == len(evals)  # distinct problems


@pytest.mark.parametrize("task", sorted(TASKS))
def test_rows_answer_is_valid_and_modes_counted(task):
    for row in modebench_rows(task, size=10, seed=0):
        key, num_valid = mode_info(row, row["answer"])
        assert key is not None and 2 <= num_valid <= 8
        problem = json.loads(row["mb_problem"])
        assert TASKS[task].verify(problem["example"], problem)


def test_reward_and_mode_keyed_coverage():
    rows = modebench_rows("pair_sum", size=1, seed=0, split="eval")  # target 6, 9, 12 or 15
    row = rows[0]
    n = json.loads(row["mb_problem"])["target"]
    texts = [f"\\boxed{{1 + {n - 1}}}", f"so \\boxed{{{n - 1}+1}}", f"\\boxed{{2 + {n - 2}}}", "\\boxed{1 + 1}"]
    reward = REWARD_FUNCTIONS["modebench"]()
    scores = reward(prompts=[row["prompt"]] * 4, completions=texts, mb_task=[row["mb_task"]] * 4,
                    mb_problem=[row["mb_problem"]] * 4)
    assert scores == [1.0, 1.0, 1.0, 0.0]
    keys = [mode_info(row, t)[0] for t in texts]
    assert keys[0] == keys[1] != keys[2] and keys[3] is None
    # Two modes among four samples, of n // 2 valid ones.
    distinct = distinct_at_k(keys, [s == 1.0 for s in scores], 4)
    assert distinct == 2 and coverage_at_k(distinct, mode_info(row, texts[0])[1]) == 2 / (n // 2)


def test_seed_clusters_and_mode_adaptive_kappa_count_modes():
    """SEED's clusters and xDr's kappa use the mode key on ModeBench rows: `1 + n-1` and
    `n-1+1` are one answer there; elsewhere the canonical final answer decides."""
    row = modebench_rows("pair_sum", size=1, seed=0, split="eval")[0]
    n = json.loads(row["mb_problem"])["target"]
    texts = [f"\\boxed{{1 + {n - 1}}}", f"\\boxed{{{n - 1}+1}}", f"\\boxed{{2 + {n - 2}}}", "\\boxed{1 + 1}"]
    keys = [answer_key(row, t) for t in texts]
    assert keys[0] == keys[1] != keys[2] and keys[3] is None
    total = torch.tensor([1.0, 1.0, 0.0, 0.0, 1.0, 1.0, 1.0, 0.0])  # two groups of four
    assert distinct_best_answers(keys + keys, total, 4).tolist() == [1.0, 2.0]
    plain = {"prompt": "2 + 2?", "answer": "4"}
    assert answer_key(plain, "so \\boxed{4.0}") == answer_key(plain, "\\boxed{4}") == "4"
    assert answer_key(plain, "no answer") is None


def test_data_source():
    ds = load_prompt_dataset("modebench:all", size=3, task_kwargs={"split": "eval"})
    assert [r["mb_task"] for r in ds][:3] == list(TASKS)
    with pytest.raises(DataError, match="unknown ModeBench task"):
        load_prompt_dataset("modebench:chess", size=3)
    with pytest.raises(DataError, match="task_kwargs"):
        load_prompt_dataset("modebench:pair_sum", size=3, task_kwargs={"level": 2})


def test_per_prompt_metrics_count_modes_not_strings():
    from maxent_grpo.evaluate import per_prompt_metrics, per_task_means

    def rec(i, s, answer, key, correct, mode="sampled"):
        return {"prompt_index": i, "sample": s, "mode": mode, "task": "pair_sum", "score": float(correct),
                "correct": correct, "answer": answer, "mode_key": key, "num_valid": 3, "keyed": True,
                "draw": 0, "unscorable": False}

    # Prompt 0 (n = 7, 3 modes): "3 + 4" and "4 + 3" are one mode, "2 + 5" another, one wrong.
    records = [rec(0, 0, "3 + 4", "3+4", True), rec(0, 1, "4 + 3", "3+4", True), rec(0, 2, "2 + 5", "2+5", True),
               rec(0, 3, "9", None, False), rec(0, 0, "3 + 4", "3+4", True, mode="greedy"),
               # Prompt 1: nothing correct.
               *[rec(1, s, "1", None, False) for s in range(4)], rec(1, 0, "1", None, False, mode="greedy")]
    first, second = per_prompt_metrics(records, 4)
    assert first["distinct@4"] == 2 and first["coverage@4"] == pytest.approx(2 / 3)
    assert first["pass@4"] == 1 and first["mean@4"] == 0.75 and first["greedy_pass@1"] == 1
    # distinct@1 = expected modes in one sample = P(correct) = 3/4.
    assert first["distinct@1"] == pytest.approx(0.75)
    assert second["pass@4"] == 0 and second["coverage@4"] == 0 and second["greedy_pass@1"] == 0
    pooled = per_task_means([first, second])
    assert pooled["pair_sum/coverage@4"] == pytest.approx(1 / 3) and pooled["pair_sum/pass@4"] == 0.5
