"""The ModeBench study: its statistics on data with known effects (fast), and the smoke run (slow)."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import numpy as np
import pandas as pd
import pytest

REPO_ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO_ROOT))  # benchmarks/ is a top-level folder, not part of the package

from benchmarks import result_files  # noqa: E402
from benchmarks.modebench import ARMS, main  # noqa: E402
from benchmarks.modebench_stats import EQUIVALENCE_MARGIN, arm_effects, holm, load_observations  # noqa: E402


def _observations(effects: dict[str, float], prompts: int = 60, seed: int = 0) -> pd.DataFrame:
    """0/1 outcomes with a prompt-level random intercept and a known additive effect per arm."""
    rng = np.random.default_rng(seed)
    base = rng.uniform(0.2, 0.6, size=prompts)
    rows = []
    for arm, effect in effects.items():
        for train_seed in range(3):
            for eval_seed in range(2):
                for p in range(prompts):
                    task = ("a", "b", "c")[p % 3]
                    prob = base[p] + effect + 0.05 * train_seed + (0.1 if task == "b" else 0.0)
                    value = float(rng.random() < prob)
                    rows.append({"arm": arm, "train_seed": train_seed, "eval_seed": eval_seed, "task": task,
                                 "prompt": f"{task}/{p}", "pass@8": value, "mean@8": prob})
    return pd.DataFrame(rows)


def test_arm_effects_recover_known_effects_with_covering_intervals():
    df = _observations({"base": 0.0, "up": 0.2, "same": 0.0})
    table = arm_effects(df, "pass@8", "base").set_index("arm")
    assert set(table.index) == {"up", "same"}
    up, same = table.loc["up"], table.loc["same"]
    # Within 3 clustered standard errors of the truth (a fixed draw: deterministic).
    assert abs(up.effect - 0.2) < 3 * up.se and abs(same.effect) < 3 * same.se
    assert up.lo > 0.05  # a 20-point effect on 360 observations per arm is detected
    assert table.loc["up", "p_holm"] < 0.05 < table.loc["same", "p_holm"]
    # The interval is the estimate +- t(0.975, clusters - 1) clustered standard errors (60 prompts: t = 2.0010).
    row = table.loc["up"]
    assert row.hi - row.lo == pytest.approx(2 * 2.000995 * row.se, rel=1e-4)


def test_tost_on_mean_separates_flat_from_shifted():
    # mean@8 here is the exact probability: no noise, so "same" is flat and "up" is not.
    df = _observations({"base": 0.0, "up": 0.2, "same": 0.0})
    df["mean@8"] += np.random.default_rng(1).normal(0, 0.01, len(df))
    table = arm_effects(df, "mean@8", "base").set_index("arm")
    assert table.loc["same", "p_tost"] < 0.05
    assert table.loc["up", "p_tost"] > 0.5
    assert abs(table.loc["same", "effect"]) < EQUIVALENCE_MARGIN


def test_holm_by_hand():
    # Sorted p: 0.01 * 3 = 0.03; 0.02 * 2 = 0.04; 0.04 * 1 = 0.04 (monotone), in the input order.
    assert holm([0.04, 0.01, 0.02]) == pytest.approx([0.04, 0.03, 0.04])


def test_arms_sit_on_dr_grpo():
    for arm, overrides in ARMS.items():
        if overrides:
            assert overrides["loss.loss_type"] == "dr_grpo" and overrides["loss.scale_rewards"] == "none", arm
    assert {ARMS[f"xdr_tau{t}"]["xdr.tau"] for t in (0.0, 0.01, 0.05, 0.25)} == {0.0, 0.01, 0.05, 0.25}


@pytest.mark.slow
def test_smoke_two_arms_two_steps(tmp_path, capsys):
    assert main(["smoke", "--work-dir", str(tmp_path)]) == 0
    report = capsys.readouterr().out
    results = tmp_path / "results"
    for arm in ("dr_grpo", "xdr_tau0.05"):
        run = results / arm / "seed0"
        done = json.loads((run / "done.json").read_text())
        assert done["steps"] == 2 and done["eval_seeds"] == [0, 1]
        config = (run / "config.yaml").read_text()
        assert "loss_type: dr_grpo" in config and "scale_rewards: none" in config
        records = result_files.read_jsonl(run / "eval-seed0" / "completions.jsonl")  # stored gzipped
        assert all("mode_key" in r and r["num_valid"] >= 2 and "prompt" not in r for r in records)
        assert {r["task"] for r in records} == {"pair_sum", "coloring", "countdown"}
        assert len(result_files.read_jsonl(run / "eval-seed1" / "per_prompt.jsonl")) == 6
        assert not (run / "eval-seed1" / "per_prompt.jsonl").exists()
    df = load_observations(results)
    assert len(df) == 2 * 2 * 6  # arms x eval seeds x prompts
    assert "| xdr_tau0.05 | 1 |" in report and "(baseline)" in report
    assert (results / "dose_response.png").stat().st_size > 0 and (results / "per_task.png").stat().st_size > 0
    # Resumable: a second run finds every (arm, seed) done and trains nothing (the files stay as they were).
    stamps = {p: p.stat().st_mtime_ns for p in results.glob("*/seed0/**/*") if p.is_file()}
    assert main(["smoke", "--work-dir", str(tmp_path)]) == 0
    assert {p: p.stat().st_mtime_ns for p in stamps} == stamps
    assert not (tmp_path / "runs" / "dr_grpo" / "seed0").exists()
