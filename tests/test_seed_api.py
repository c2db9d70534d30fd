"""docs/SEED_API.md says where each name of the seed's API pages lives: every name it calls on the
product's path resolves at its seed module path, and every name it calls removed or not built is
absent there (a page that claims otherwise misleads a user of the seed's API)."""

from __future__ import annotations

import importlib
import re
from pathlib import Path

import pytest

DOC = Path(__file__).resolve().parents[1] / "docs" / "SEED_API.md"


def _rows() -> list[tuple[str, str, str]]:
    """(module, name, status) for every name in the page's tables."""
    rows, module = [], None
    for line in DOC.read_text().splitlines():
        heading = re.match(r"^## `([\w.]+)`", line)
        if heading:
            module = heading.group(1)
            continue
        cells = [c.strip() for c in line.strip().strip("|").split("|")] if line.startswith("| `") else []
        if module is None or len(cells) < 2:
            continue
        status = re.match(r"on the path|removed|not built|", cells[1]).group(0) or cells[1]
        for name in re.findall(r"`(\w+)[^`]*`", cells[0]):
            rows.append((module, name, status))
    return rows


ROWS = _rows()


def test_the_page_lists_the_seeds_central_names():
    names = {(m, n) for m, n, _ in ROWS}
    assert {("maxent_grpo.training.pipeline", "prepare_training_batch"),
            ("maxent_grpo.training.pipeline", "PreparedBatch"),
            ("maxent_grpo.rewards.maxent", "compute_reward_statistics")} <= names
    assert {s for _, _, s in ROWS} <= {"on the path", "removed", "not built"}


@pytest.mark.parametrize("module, name, status", ROWS, ids=[f"{m.rsplit('.', 1)[1]}.{n}" for m, n, _ in ROWS])
def test_each_name_is_where_the_page_says(module, name, status):
    present = hasattr(importlib.import_module(module), name)
    assert present == (status == "on the path"), f"{module}.{name}: the page says '{status}'"
