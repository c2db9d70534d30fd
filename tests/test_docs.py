"""The user documentation's shape: BENCHMARKS.md stays a page read in minutes whose links all land,
each study's full account is linked from it, the raw results stay compressed and small, and the
documents speak of the product (no tracker issue numbers)."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
BENCHMARKS = ROOT / "BENCHMARKS.md"
STUDIES = ROOT / "docs" / "benchmarks"
RESULTS = ROOT / "benchmarks" / "results"


def _anchor(heading: str) -> str:
    """GitHub's anchor for a markdown heading."""
    text = re.sub(r"[^\w\- ]", "", heading.lstrip("#").strip().lower())
    return text.replace(" ", "-")


def _anchors(path: Path) -> set[str]:
    return {_anchor(line) for line in path.read_text().splitlines() if line.startswith("#")}


def test_benchmarks_page_is_short_and_its_links_land():
    text = BENCHMARKS.read_text()
    assert len(text.splitlines()) <= 600
    for target in re.findall(r"\]\(([^)\s]+)\)", text):
        path, _, anchor = target.partition("#")
        file = BENCHMARKS if not path else ROOT / path
        assert file.exists(), f"BENCHMARKS.md links to {target}: no such file"
        if anchor:
            assert anchor in _anchors(file), f"BENCHMARKS.md links to {target}: no such heading"


def test_every_study_is_linked_from_the_page_and_links_back():
    text = BENCHMARKS.read_text()
    studies = sorted(STUDIES.glob("*.md"))
    assert studies
    for study in studies:
        assert f"docs/benchmarks/{study.name}" in text, f"{study.name} is not linked from BENCHMARKS.md"
        back = re.findall(r"\]\(\.\./\.\./BENCHMARKS\.md#([^)\s]+)\)", study.read_text())
        assert back, f"{study.name} does not link back to its section"
        assert set(back) <= _anchors(BENCHMARKS), f"{study.name} links to a heading BENCHMARKS.md lacks"


def test_the_page_keeps_the_sections_the_documentation_cites():
    """README.md, docs/, src/ and scripts/ cite BENCHMARKS.md by section number (scripts/gpu_check.py
    sends GPU figures to §9)."""
    numbers = {m.group(1) for m in re.finditer(r"^## (\d+[a-z]?)\. ", BENCHMARKS.read_text(), re.M)}
    cited = set()
    for path in [ROOT / "README.md", *ROOT.glob("docs/*.md"), *ROOT.glob("src/**/*.py"), *ROOT.glob("scripts/*.py"),
                 *ROOT.glob("benchmarks/*.py"), *ROOT.glob("recipes/*.yaml")]:
        for m in re.finditer(r"BENCHMARKS(?:\.md)?`? (§\d+[a-z]?(?:, §\d+[a-z]?)*)", path.read_text()):
            cited |= set(re.findall(r"§(\d+[a-z]?)", m.group(1)))
    assert "9" in cited and cited <= numbers, sorted(cited - numbers)


def test_raw_results_are_compressed_and_small():
    files = [p for p in RESULTS.rglob("*") if p.is_file()]
    assert files
    assert not [p for p in files if p.suffix == ".jsonl"], "store JSON lines as .jsonl.gz (benchmarks/result_files.py)"
    big = [p for p in files if p.stat().st_size > 2 * 1024 * 1024]
    assert big == [], big


def test_user_docs_name_no_tracker_issues():
    docs = [ROOT / "README.md", BENCHMARKS, ROOT / "benchmarks" / "README.md", *ROOT.glob("docs/**/*.md")]
    found = [f"{p.relative_to(ROOT)}: {m.group(0)}" for p in docs
             for m in re.finditer(r"\b[Ii]ssue (?:#?\d+)|\(issue \d+\)", p.read_text())]
    assert found == []
