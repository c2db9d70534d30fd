"""ModeBench's metrics (ALGORITHMS.md §18): the spec's closed forms, §10's estimators at n = k,
and the package's own functions (modebench 0.4.0) on random mode tables."""

from __future__ import annotations

import json
import random
from pathlib import Path

import pytest

from maxent_grpo.core.eval_metrics import distinct_at_k, pass_at_k
from maxent_grpo.core.mode_metrics import (PER_GROUP, POOLED, cell_summary, effective_modes, mode_diversity,
                                           modebench_cell, prompt_pcmd, rarefied_distinct)

modebench = pytest.importorskip("modebench", reason="modebench is not installed (the GPU machine's image)")
mb = pytest.importorskip("modebench.metrics", reason="modebench is not installed (the GPU machine's image)")


def _group(*keys, unscorable=False):
    """Attempts: a key verifies, None is a failed draw."""
    return [(k is not None, k, unscorable) for k in keys]


def test_closed_forms():
    assert mode_diversity({"A": 2, "B": 1}) == pytest.approx(2 / 3, abs=1e-15)
    assert mode_diversity({"A": 3}) == 0.0
    assert mode_diversity({"A": 1}) is None and mode_diversity({}) is None
    assert mode_diversity({"A": 1, "B": 1, "C": 1}) == 1.0
    rng = random.Random(0)
    for _ in range(100):
        counts = [rng.randint(0, 6) for _ in range(rng.randint(1, 5))]
        if sum(counts) >= 2:
            assert rarefied_distinct(counts, 2) == pytest.approx(1 + mode_diversity(counts), abs=1e-14)
    assert effective_modes(0.5) == 2.0 and effective_modes(1.0) is None and effective_modes(None) is None


def test_pooling():
    assert prompt_pcmd([_group("A", "A"), _group("B", "B")], POOLED) == pytest.approx(2 / 3, abs=1e-15)
    assert prompt_pcmd([_group("A", "A"), _group("B", "B")], PER_GROUP) == 0.0
    assert prompt_pcmd([_group("A"), _group("B")], POOLED) == 1.0
    assert prompt_pcmd([_group("A"), _group("B")], PER_GROUP) is None


def test_reportable_at_30_defined_prompts_and_one_unscorable_nulls_everything():
    defined = [[_group("A", "B")]]
    undefined = [[_group("A", None)]]
    assert not modebench_cell(defined * 29 + undefined * 5)["reportable"]
    cell = modebench_cell(defined * 30 + undefined)
    assert cell["reportable"] and cell["defined_prompts"] == 30 and cell["prompts"] == 31
    failed = modebench_cell(defined * 30 + [[_group("A", None) + [(False, None, True)]]])
    assert failed["status"] == "verifier_failure" and not failed["reportable"]
    assert all(failed[k] is None for k in ("accuracy", "pass@k", "distinct@k", "pcmd"))


def test_empirical_metrics_equal_section_10_at_n_equal_k():
    rng = random.Random(1)
    for _ in range(50):
        k = rng.randint(1, 8)
        group = _group(*[rng.choice([None, "a", "b", "c"]) for _ in range(k)])
        cell = modebench_cell([[group]])
        correct = [key for ok, key, _ in group if ok]
        assert cell["accuracy"] == len(correct) / k
        assert cell["pass@k"] == pass_at_k(k, len(correct), k)
        assert cell["distinct@k"] == pytest.approx(distinct_at_k([key if ok else None for ok, key, _ in group],
                                                                 [float(ok) for ok, _, _ in group], k), abs=1e-12)


def _as_draws(groups):
    return [{"attempts": [{"verified": ok, "status": "correct" if ok else "incorrect", "canonical_key": key}
                          for ok, key, _ in g]} for g in groups]


@pytest.mark.parametrize("aggregation", [POOLED, PER_GROUP])
def test_equal_to_the_package_on_random_tables(aggregation):
    rng = random.Random(2)
    for _ in range(40):
        prompts = [[_group(*[rng.choice([None, "a", "b", "c", "d"]) for _ in range(rng.randint(1, 6))])
                    for _ in range(rng.randint(1, 4))] for _ in range(rng.randint(1, 40))]
        ours = [prompt_pcmd(p, aggregation) for p in prompts]
        theirs = [mb.prompt_mode_diversity(_as_draws(p), aggregation) for p in prompts]
        for a, b in zip(ours, theirs):
            assert (a is None) == (b is None) and (a is None or a == pytest.approx(b, abs=1e-15))
        mine, package = cell_summary(ours, 10), mb.cell_summary([{"draws": _as_draws(p)} for p in prompts],
                                                                  aggregation, 10)
        for key in ("defined_prompts", "prompts", "support", "reportable"):
            assert mine[key] == package[key]
        for key, tol in (("pcmd", 1e-15), ("rarefied_distinct_at_2", 1e-15), ("effective_modes", 1e-12),
                         ("standard_error", 1e-12)):
            theirs_value = package["d_mode" if key == "pcmd" else key]
            assert (mine[key] is None) == (theirs_value is None)
            if theirs_value is not None:
                assert mine[key] == pytest.approx(theirs_value, abs=tol)
        counts = {"a": rng.randint(0, 5), "b": rng.randint(0, 5)}
        for depth in (1, 2, 3):
            assert rarefied_distinct(counts, depth) == (None if mb.rarefied_distinct(counts, depth) is None
                                                        else pytest.approx(mb.rarefied_distinct(counts, depth), abs=1e-15))


def test_the_walkthrough_graded_offline():
    """The package's walkthrough responses through our grading: every cell accuracy 0.5, pass 1,
    distinct 2, PCMD 1 and not reportable (as the package's expected block says)."""
    from maxent_grpo.tasks.modebench_package import grade_row

    walkthrough = json.loads((Path(modebench.__file__).parent / "walkthrough.json").read_text())
    for record in walkthrough["records"]:
        task = json.dumps({k: record[k] for k in ("id", "level", "domain", "problem", "answer")} | {"dataset_sha256": None})
        graded = [grade_row({"mbp_task": task}, r) for r in record["responses"]]
        cell = modebench_cell([[[(g["verified"], g["canonical_key"], False) for g in graded]]])
        expected = walkthrough["expected"]["per_cell"]
        assert (cell["accuracy"], cell["pass@k"], cell["distinct@k"], cell["pcmd"], cell["reportable"]) == (
            expected["accuracy"], expected["pass_at_k"], expected["distinct_at_k"], expected["pcmd"], expected["reportable"])


def test_the_eval_summary_has_one_mb_cell_per_task():
    from maxent_grpo.evaluate import modebench_summary

    def rec(task, prompt, key, correct=True, mode="sampled", keyed=True):
        return {"task": task, "prompt_index": prompt, "mode_key": key, "correct": correct, "mode": mode, "keyed": keyed,
                "draw": 0, "unscorable": False}

    records = [rec("a", 0, "x"), rec("a", 0, "y"), rec("a", 1, "x"), rec("a", 1, None, False),
               rec("a", 0, "x", mode="greedy"), rec(None, 5, None, keyed=False)]
    one = modebench_summary(records)
    assert one["mb/pcmd"] == 1.0 and one["mb/pcmd_defined"] == 1 and one["mb/pcmd_prompts"] == 2
    assert one["mb/accuracy"] == 0.75 and one["mb/distinct@k"] == 1.5 and one["mb/pcmd_reportable"] is False
    two = modebench_summary(records + [rec("b", 2, "z"), rec("b", 2, "z")])
    assert two["mb/b/pcmd"] == 0.0 and two["mb/a/pcmd"] == 1.0 and "mb/pcmd" not in two
