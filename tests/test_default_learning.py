"""The default-run study (benchmarks/default_learning.py, BENCHMARKS.md §3): its rules on hand-made
runs, its interval against the t table, and a real run through `run` on the tiny model that resumes."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

REPO_ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO_ROOT))  # benchmarks/ is a top-level folder, not part of the package

from benchmarks import result_files  # noqa: E402
from benchmarks.default_learning import ARMS, load, main, per_seed, summarize, t_interval, table  # noqa: E402


def _rows(rewards, lengths, entropy=0.5, acc=0.0):
    return [{"step": i + 1, "reward": r, "rewards/boxed_accuracy/mean": acc, "completions/mean_length": n,
             "entropy": entropy, "step_time": 10.0 + i} for i, (r, n) in enumerate(zip(rewards, lengths))]


def test_rules_at_their_margins():
    steps = [10.0] * 6
    # A fall of 0.25 with the length falling: a collapse; of 0.2 exactly: not; with the length steady: not.
    assert summarize("a", 0, _rows([0.5] * 3 + [0.25] * 3, [10] * 3 + [9] * 3)).collapsed
    assert not summarize("a", 0, _rows([0.5] * 3 + [0.3] * 3, [10] * 3 + [9] * 3)).collapsed
    assert not summarize("a", 0, _rows([0.5] * 3 + [0.25] * 3, steps)).collapsed
    # Learning needs a rise of at least 0.1 (0.125 is exact in binary; 0.0625 is not enough).
    assert summarize("a", 0, _rows([0.5] * 3 + [0.625] * 3, steps)).learns
    assert not summarize("a", 0, _rows([0.5] * 3 + [0.5625] * 3, steps)).learns
    run = summarize("a", 0, _rows([0.5, 0.6, 0.7, 0.1, 0.2, 0.9, 1.0, 1.1], [12, 11, 10, 9, 8, 7, 6, 5]))
    assert run.reward == pytest.approx((0.6, 1.0)) and run.length == pytest.approx((11.0, 6.0))
    assert run.sec_per_step == 13.5  # the median over the run's steps
    with pytest.raises(ValueError, match="need at least 6"):
        summarize("a", 0, _rows([0.5] * 5, [10] * 5))


def test_interval_is_student_t():
    # n = 4, sd = 1.2910 (values 1..4), t(0.975, 3) = 3.182446: half-width 3.182446 * 1.290994 / 2.
    mean, lo, hi = t_interval([1.0, 2.0, 3.0, 4.0])
    assert mean == 2.5 and hi - mean == pytest.approx(3.182446 * 1.290994 / 2, rel=1e-5)
    assert mean - lo == pytest.approx(hi - mean)


def test_table_counts_per_arm(tmp_path):
    for arm, seed, rewards, lengths in [
        ("weighted_mle", 0, [0.5] * 3 + [0.2] * 3, [10] * 3 + [4] * 3),  # collapses
        ("weighted_mle", 1, [0.5] * 3 + [0.7] * 3, [10] * 6),  # learns
        ("centered_mle", 0, [0.5] * 3 + [0.7] * 3, [10] * 6),
    ]:
        out = tmp_path / arm / f"seed{seed}"
        out.mkdir(parents=True)
        (out / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in _rows(rewards, lengths)))
        (out / "done.json").write_text("{}")
    (tmp_path / "dr_grpo" / "seed0").mkdir(parents=True)  # cut off: no done.json, not counted
    by_arm = load(tmp_path)
    assert list(by_arm) == ["weighted_mle", "centered_mle"]
    text = table(by_arm)
    assert "| weighted_mle | 2 | 1 | 1 | 0.500 -> 0.450 |" in text
    assert "| centered_mle | 1 | 0 | 1 |" in text
    assert "| 0 | 0.50 -> 0.20 C | 0.50 -> 0.70 |" in per_seed(by_arm)


def test_run_trains_each_arm_and_seed_once_and_resumes(tiny_model_dir, tmp_path, monkeypatch):
    """Two arms x one seed of 6 steps on the tiny model through the real CLI; a second call finds them done."""
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    results = tmp_path / "results"
    extra = ["--set", f"model.name_or_path={tiny_model_dir}", "--set", "data.task_kwargs={}", "--set", "data.size=32",
             "--set", "generation.num_generations=4", "--set", "generation.max_new_tokens=8",
             "--set", "training.prompts_per_step=2", "--set", "training.micro_batch_size=4",
             "--set", "training.max_steps=6"]
    argv = ["run", "--arms", "weighted_mle,centered_mle", "--seeds", "0", "--results", str(results),
            "--work-dir", str(tmp_path / "work"), "--", *extra]
    assert main(argv) == 0
    done = {p.parent.parent.name: json.loads(p.read_text()) for p in results.glob("*/seed0/done.json")}
    assert set(done) == {"weighted_mle", "centered_mle"} and all(d["steps"] == 6 for d in done.values())
    for arm in done:
        assert not (tmp_path / "work" / arm / "seed0").exists()  # removed once its metrics are kept
        rows = result_files.read_jsonl(results / arm / "seed0" / "metrics.jsonl")  # stored gzipped
        assert (results / arm / "seed0" / "metrics.jsonl.gz").is_file()
        assert [r["step"] for r in rows] == list(range(1, 7))
    before = {p: p.stat().st_mtime_ns for p in results.rglob("*") if p.is_file()}
    assert main(argv) == 0
    assert {p: p.stat().st_mtime_ns for p in results.rglob("*") if p.is_file()} == before
    assert set(ARMS) >= set(done)
