"""Rows: a generated source's table without `datasets`, the same rows and splits as `datasets` gives."""

from __future__ import annotations

import pytest

from maxent_grpo.data.datasets import load_prompt_dataset, split_train_eval
from maxent_grpo.data.rows import Rows
from maxent_grpo.errors import DataError

datasets = pytest.importorskip("datasets", reason="datasets is not installed (the GPU machine's image)")

GENERATED = ["reasoning_gym:chain_sum", "modebench:all", "modebench:pair_sum", "calculator"]


def _without_filled(value):
    """``value`` less the None entries ``datasets`` adds to nested records (a struct's missing keys)."""
    if isinstance(value, dict):
        return {k: _without_filled(v) for k, v in value.items() if v is not None}
    if isinstance(value, list):
        return [_without_filled(v) for v in value]
    return value


@pytest.mark.parametrize("source", GENERATED)
def test_a_generated_source_is_rows_that_datasets_would_give_back_unchanged(source):
    """No `datasets` in the generated path, and nothing a `datasets` round trip would change but one
    thing: the columns, every value and its type (ints stay ints) are the same, and a nested record
    keeps its own keys (`datasets` gives a chat message without `name` a `name: None`)."""
    rows = load_prompt_dataset(source, size=12, seed=3)
    assert isinstance(rows, Rows)
    table = datasets.Dataset.from_list(list(rows))
    assert rows.column_names == table.column_names
    assert [_without_filled(r) for r in rows] == [_without_filled(r) for r in table]
    top = [{k: v for k, v in r.items() if not isinstance(v, list)} for r in rows]
    assert top == [{k: v for k, v in r.items() if not isinstance(v, list)} for r in table]


@pytest.mark.parametrize("eval_size, seed", [(1, 0), (3, 7), (0.25, 11), (11, 5)])
def test_the_held_out_split_is_the_one_datasets_draws(eval_size, seed):
    """The same held-out rows as `datasets.Dataset.train_test_split` (seeded permutation, test rows
    first): a run's validation prompts do not depend on whether its source is generated."""
    rows = load_prompt_dataset("modebench:pair_sum", size=12, seed=0)
    ours = split_train_eval(rows, eval_size, seed)
    theirs = split_train_eval(datasets.Dataset.from_list(list(rows)), eval_size, seed)
    for a, b in zip(ours, theirs):
        assert list(a) == list(b)


def test_rows_fill_missing_columns_and_hand_out_copies():
    rows = Rows([{"prompt": "a", "answer": 1}, {"prompt": "b", "extra": [1, 2]}])
    assert rows.column_names == ["prompt", "answer", "extra"]
    assert rows[1] == {"prompt": "b", "answer": None, "extra": [1, 2]}
    rows[0]["prompt"] = "changed"
    assert next(iter(rows))["prompt"] == "a"
    assert rows.rename_column("answer", "solution").column_names == ["prompt", "solution", "extra"]
    assert rows.add_column("k", [1, 2])["k"] == [1, 2]
    with pytest.raises(KeyError, match="no column 'missing'"):
        rows["missing"]
    with pytest.raises(ValueError, match="test_size"):
        rows.train_test_split(test_size=2, seed=0)


def test_a_generated_answer_that_is_not_a_string_or_number_is_named():
    from maxent_grpo.data.datasets import _standardise

    with pytest.raises(DataError, match="answer column 'answer' must hold strings or numbers, got \\[1\\]"):
        _standardise(Rows([{"prompt": "p", "answer": [1]}]), "src", "prompt", "answer")
    fixed = _standardise(Rows([{"prompt": "p", "answer": 3}, {"prompt": "q", "answer": None}]), "src", "prompt", "answer")
    assert fixed["answer"] == ["3", None]
