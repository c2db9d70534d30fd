"""``Rows``: the table of a generated prompt source (reasoning-gym, ModeBench, the calculator), without ``datasets``.

A generated task is a list of dicts already, and a machine may have no ``datasets`` (a bare GPU
image). ``Rows`` offers the part of ``datasets.Dataset``'s interface the trainer reads:
``len``, a row by index (a fresh dict), a column by name, iteration, ``column_names``,
``select``, ``rename_column``, ``add_column`` and ``train_test_split``, whose permutation is
``datasets``' own (``np.random.default_rng(seed).permutation(n)``, the test rows first), so a held-out
split is the same rows either way (``tests/data/test_rows.py`` checks it against ``datasets``). File
and hub sources still return a ``datasets.Dataset``.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping, Sequence
from typing import Any

import numpy as np


class Rows:
    """Rows of dicts with one set of columns; a row that lacks a column holds None there. Values are
    kept as given: a nested record keeps its own keys (``datasets`` would give a chat message
    without ``name`` a ``name: None``)."""

    def __init__(self, rows: Sequence[Mapping[str, Any]]):
        columns: dict[str, None] = {}
        for row in rows:
            columns.update(dict.fromkeys(row))
        self._columns = list(columns)
        self._rows = [{c: row.get(c) for c in self._columns} for row in rows]

    @property
    def column_names(self) -> list[str]:
        return list(self._columns)

    def __len__(self) -> int:
        return len(self._rows)

    def __getitem__(self, key: int | str) -> dict[str, Any] | list[Any]:
        if isinstance(key, str):
            if key not in self._columns:
                raise KeyError(f"no column {key!r}; columns: {self._columns}")
            return [row[key] for row in self._rows]
        return dict(self._rows[key])

    def __iter__(self) -> Iterator[dict[str, Any]]:
        return (dict(row) for row in self._rows)

    def select(self, indices) -> Rows:
        return Rows([self._rows[int(i)] for i in indices])

    def rename_column(self, old: str, new: str) -> Rows:
        if old not in self._columns or new in self._columns:
            raise ValueError(f"cannot rename column {old!r} to {new!r}; columns: {self._columns}")
        return Rows([{(new if c == old else c): v for c, v in row.items()} for row in self._rows])

    def add_column(self, name: str, values: Sequence[Any]) -> Rows:
        if name in self._columns or len(values) != len(self._rows):
            raise ValueError(f"cannot add column {name!r} of {len(values)} values to {len(self._rows)} rows "
                             f"with columns {self._columns}")
        return Rows([{**row, name: value} for row, value in zip(self._rows, values)])

    def train_test_split(self, test_size: int, seed: int) -> dict[str, Rows]:
        """``{"train", "test"}`` as ``datasets.Dataset.train_test_split(test_size=int, seed=seed)`` splits them."""
        n = len(self._rows)
        if not 1 <= test_size < n:
            raise ValueError(f"test_size must be in [1, {n - 1}], got {test_size}")
        order = np.random.default_rng(seed).permutation(n)
        return {"train": self.select(order[test_size:]), "test": self.select(order[:test_size])}
