"""benchmarks/capacity.py: the capacity model's table is what docs/SCALING.md quotes, and its disk probe runs."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

REPO_ROOT = Path(__file__).resolve().parents[1]
# benchmarks/ is a top-level folder of the repo, not part of the installed package.
sys.path.insert(0, str(REPO_ROOT))

from benchmarks import capacity  # noqa: E402


def test_one_gpu_colocated_is_the_measured_step():
    row = capacity.colocated("1.5B", 1, capacity.Inputs())
    assert row.step_s == pytest.approx(capacity.GEN_S_1_5B + capacity.UPD_S_1_5B)
    assert row.tokens_per_gpu_s == pytest.approx(capacity.TOKENS_PER_STEP / row.step_s)
    assert capacity.server("1.5B", 1, "disk", capacity.Inputs()).step_s is None


def test_per_gpu_throughput_never_grows_with_the_cluster():
    rows = capacity.table(capacity.Inputs())
    assert len(rows) == 2 * 3 * 3
    for model in capacity.PARAMS:
        for layout in ("colocated", "server, disk sync", "server, NCCL sync"):
            rates = [r.tokens_per_gpu_s for r in rows if r.model == model and r.layout == layout and r.step_s]
            assert rates == sorted(rates, reverse=True), (model, layout)


def test_the_table_in_scaling_md_is_the_scripts(capsys):
    assert capacity.main([]) == 0
    printed = capsys.readouterr().out.strip()
    assert printed in (REPO_ROOT / "docs" / "SCALING.md").read_text()


def test_the_disk_probe_measures_a_small_file(tmp_path):
    write, read = capacity.measure_disk(tmp_path, size_gib=1 / 16)
    assert write > 0 and read > 0
    assert list(tmp_path.iterdir()) == []
