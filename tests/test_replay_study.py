"""The verified-replay study (benchmarks/replay_study.py, BENCHMARKS.md §12): its per-prompt ModeBench
metrics against hand counts, its intervals against an independent formula, its arms, and the smoke
run (slow)."""

from __future__ import annotations

import json
import math
import sys
from pathlib import Path

import pytest

REPO_ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO_ROOT))  # benchmarks/ is a top-level folder, not part of the package

from benchmarks import result_files  # noqa: E402
from benchmarks.modebench import smoke_model  # noqa: E402
from benchmarks.replay_study import ARMS, RECIPE, START, main, study_length  # noqa: E402
from benchmarks.replay_study_stats import analyze, arm_mean, effects, load, per_seed, prompt_metrics  # noqa: E402


def _record(prompt, draw, sample, correct, key, mode="sampled", unscorable=False):
    return {"prompt_index": prompt, "draw": draw, "sample": sample, "mode": mode, "correct": correct,
            "mode_key": key, "task": "graph_coloring", "unscorable": unscorable}


def _prompt(prompt, draws, greedy):
    """Records of one prompt: ``draws`` lists of (correct, key) per sample, then the greedy one."""
    out = [_record(prompt, d, d * len(g) + i, c, k) for d, g in enumerate(draws) for i, (c, k) in enumerate(g)]
    return out + [_record(prompt, 0, 0, greedy, "g" if greedy else None, mode="greedy")]


MISS = (False, None)


def test_prompt_metrics_by_hand():
    records = (
        # Draw 0: A, A and a "correct" row without a key (not verified); draw 1: B. Pooled {A: 2, B: 1}.
        _prompt(0, [[(True, "A"), (True, "A"), (True, None), MISS], [(True, "B"), MISS, MISS, MISS]], greedy=True)
        # Nothing verified: PCMD undefined (None), not 0.
        + _prompt(1, [[MISS] * 4, [MISS] * 4], greedy=False)
        # One verified answer in each draw, one mode: pooled {C: 2} gives PCMD 0.
        + _prompt(2, [[(True, "C"), MISS, MISS, MISS], [MISS, MISS, (True, "C"), MISS]], greedy=False)
    )
    p0, p1, p2 = prompt_metrics(records)
    assert (p0["pass@8"], p0["distinct@8"], p0["accuracy"], p0["greedy_pass@1"]) == (1.0, 1.0, 3 / 8, 1.0)
    assert p0["pcmd"] == pytest.approx(1 - (2 * 1 + 1 * 0) / (3 * 2), abs=1e-15)  # 2/3
    assert (p1["pass@8"], p1["distinct@8"], p1["accuracy"], p1["pcmd"], p1["greedy_pass@1"]) == (0, 0, 0, None, 0)
    assert (p2["pass@8"], p2["distinct@8"], p2["pcmd"]) == (1.0, 1.0, 0.0)
    # pass@8 per draw, averaged: a prompt verified in only one of two draws reads 0.5.
    half = prompt_metrics(_prompt(3, [[(True, "A"), MISS], [MISS, MISS]], greedy=False))[0]
    assert half["pass@8"] == 0.5 and half["distinct@8"] == 0.5


def _write_run(results: Path, arm: str, seed: int, records: list[dict], steps: list[dict] | None = None,
               reportable: bool = False):
    run = results / arm / f"seed{seed}"
    (run / "eval").mkdir(parents=True)
    (run / "eval" / "completions.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    (run / "eval" / "summary.json").write_text(json.dumps({"mb/pcmd_reportable": reportable}))
    if steps is not None:
        (run / "train_metrics.jsonl").write_text("".join(json.dumps(m) + "\n" for m in steps))
    (run / "done.json").write_text(json.dumps({"arm": arm, "seed": seed, "steps": len(steps or []),
                                               "train_s": 1.0, "eval_s": 1.0, "eval_seed": 0}))


def _steps(replay: bool) -> list[dict]:
    base = {"rewards/modebench_pkg/mean": 0.25, "frac_reward_zero_std": 0.5, "time/total": 10.0}
    if not replay:
        return [base, base]
    return [{**base, "replay/time_s": 0.0, "time/replay_admission": 0.01, "replay/time_share": 0.001,
             "bank/prompts": 1.0, "bank/modes": 1.0},
            {**base, "replay/time_s": 2.0, "time/replay_admission": 0.03, "replay/time_share": 0.203,
             "replay/groups": 1.0, "replay/modes": 2.0, "bank/prompts": 2.0, "bank/modes": 3.0}]


def test_analyze_reads_runs_and_gives_prompt_clustered_intervals(tmp_path):
    results = tmp_path / "results"
    outcomes = {"dr_grpo": [1, 0, 1, 0], "redr": [1, 1, 1, 0], "redr_control": [1, 0, 1, 0]}
    for arm, passed in outcomes.items():
        for seed in (0, 1):
            records = [r for p, ok in enumerate(passed) for r in _prompt(
                p, [[(True, f"k{p}"), (bool(ok) and seed == 1, f"j{p}")] if ok else [MISS, MISS]], greedy=False)]
            _write_run(results, arm, seed, records, _steps(arm != "dr_grpo"), reportable=(arm, seed) == ("redr", 1))
    # A run with an unscorable completion is left out whole (ModeBench's failure policy), and named.
    _write_run(results, "maxrl", 0, [_record(0, 0, 0, False, None, unscorable=True)], _steps(False))
    df, failed = load(results)
    assert failed == ["maxrl/seed0"] and set(df["arm"]) == set(outcomes)
    assert len(df) == 3 * 2 * 4
    # The mean's interval, independently: prompt means over seeds (redr: 1, 1, 1, 0), t(3) over prompts.
    mean, lo, hi, n = arm_mean(df[df["arm"] == "redr"], "pass@8")
    values = [1.0, 1.0, 1.0, 0.0]
    sd = math.sqrt(sum((v - 0.75) ** 2 for v in values) / 3)
    assert (mean, n) == (0.75, 4)
    assert hi - mean == pytest.approx(3.182446305284263 * sd / 2, rel=1e-12)  # t(0.975, 3)
    assert mean - lo == pytest.approx(hi - mean, rel=1e-12)
    report = analyze(results, arms=list(ARMS), baseline="dr_grpo")
    assert "| dr_grpo | 2 |" in report and "(baseline)" in report and "Left out" in report
    assert "| redr - redr_control |" in report
    # Each seed alone (pass@8 / distinct@8 over the 4 prompts; seed 1 verifies a second key on solved
    # prompts), then the per-seed differences and their t interval over seeds (zero spread here).
    assert "| 1 | 0.500 / 1.000 | 0.750 / 1.500 | 0.500 / 1.000 |" in report
    assert "| redr | 0: +25.0, 1: +25.0 | +25.0 [+25.0, +25.0] |" in report
    # PCMD's reportability is each run's evaluation's verdict, counted per arm.
    assert "reportable in 1/2 runs" in report.split("| redr | 2 |")[1].splitlines()[0]
    assert "reportable in 0/2 runs" in report.split("| dr_grpo | 2 |")[1].splitlines()[0]
    # The control equals the baseline on every observation: effect 0, a zero-width interval.
    assert "| redr_control | 2 |" in report
    control = effects(df, "pass@8", "dr_grpo").set_index("arm").loc["redr_control"]
    assert abs(control.effect) < 1e-12 and abs(control.lo) < 1e-6 and abs(control.hi) < 1e-6
    # Replay's cost: the step that replayed (2.0 s, share 0.203) apart from the one with an empty bank.
    assert "| redr | 4 | 2 | 2.000 | 0.020 | 0.203 | 0.102 | 2.000 |" in report



def test_an_arm_equal_to_the_baseline_reads_zero_whatever_the_other_arms():
    """PCMD is defined on different runs per arm, and an arm may lack a seed: an arm whose every value
    equals the baseline's has effect 0 and its own rows alone decide it. A joint fit with shared seed
    effects fails this (the third arm's seed-1 values move the seed effect the baseline is measured from)."""
    import pandas as pd

    rows = []
    for prompt in range(6):
        for seed in (0, 1):
            rows.append({"arm": "dr_grpo", "train_seed": seed, "prompt": f"p{prompt}", "pcmd": 0.0})
            rows.append({"arm": "remax", "train_seed": seed, "prompt": f"p{prompt}",
                         "pcmd": 0.2 + 0.6 * seed + 0.05 * prompt})
        rows.append({"arm": "maxent_listwise", "train_seed": 0, "prompt": f"p{prompt}", "pcmd": 0.0})
    df = pd.DataFrame(rows).assign(task="graph_coloring", eval_seed=0)
    table = effects(df, "pcmd", "dr_grpo").set_index("arm")
    assert abs(table.loc["maxent_listwise", "effect"]) < 1e-12
    # remax against the baseline alone: its mean difference within seeds, (0.325 + 0.925) / 2.
    assert table.loc["remax", "effect"] == pytest.approx(0.625, abs=1e-12)
    # Holm across the two arms: the smaller p doubled, the larger never below it.
    assert table.loc["remax", "p_holm"] == pytest.approx(min(1.0, 2 * table.loc["remax", "p"]), rel=1e-12)



def test_per_seed_differences_and_their_interval_over_seeds():
    """Seeds as a random draw: per-seed pass@8 differences +10, +20, +30 points (one prompt, so each is the
    seed's mean), their mean 20 and t(0.975, 2) * 10 / sqrt(3) = 24.84 either side; a seed one arm lacks
    is left out of that arm's differences."""
    import pandas as pd

    base = [0.2, 0.3, 0.4, 0.5]
    rows = [{"arm": "dr_grpo", "train_seed": s, "prompt": "p0", "pass@8": b, "distinct@8": b}
            for s, b in enumerate(base)]
    rows += [{"arm": "redr", "train_seed": s, "prompt": "p0", "pass@8": base[s] + d, "distinct@8": 1.0}
             for s, d in enumerate((0.1, 0.2, 0.3))]
    table = per_seed(pd.DataFrame(rows), ["dr_grpo", "redr"], "dr_grpo")
    assert "| 3 | 0.500 / 0.500 | - |" in table
    assert "| redr | 0: +10.0, 1: +20.0, 2: +30.0 | +20.0 [-4.8, +44.8] |" in table

def test_every_arm_compiles_with_its_loss_replay_and_advantage():
    from tiny_runs import compiled

    from maxent_grpo.config.load import load_config

    for arm, overrides in ARMS.items():
        if arm == START:
            continue
        cfg = load_config(RECIPE, overrides)
        compiled(RECIPE, overrides)  # every check of the compiler passes
        if arm == "maxent_listwise":  # the default method: its own listwise loss, the recipe's beta 0
            assert (cfg.method, cfg.loss.beta) == ("maxent_listwise", 0.0)
        else:
            assert (cfg.loss.loss_type, cfg.loss.scale_rewards, cfg.loss.beta) == ("dr_grpo", "none", 0.0), arm
        assert cfg.replay.enabled == arm.startswith("redr") or arm == "remax", arm
        assert cfg.replay.compute_only == (arm == "redr_control"), arm
        assert (cfg.loss.advantage_estimator == "maxrl") == (arm in ("remax", "maxrl")), arm
        assert [r.name for r in cfg.rewards] == ["modebench_pkg"]  # binary: MaxRL's requirement, every arm alike


@pytest.mark.slow
def test_smoke_two_arms_two_steps(tmp_path, capsys):
    pytest.importorskip("modebench.api", reason="modebench is not installed")
    assert main(["smoke", "--work-dir", str(tmp_path)]) == 0
    report = capsys.readouterr().out
    results = tmp_path / "results"
    for arm in ("dr_grpo", "redr"):
        run = results / arm / "seed0"
        assert json.loads((run / "done.json").read_text())["steps"] == 2
        records = result_files.read_jsonl(run / "eval" / "completions.jsonl")  # stored gzipped
        assert all("prompt" not in r and r["task"] == "graph_coloring" for r in records)
        assert len([r for r in records if r["mode"] == "sampled"]) == 2 * 1 * 4  # prompts x draws x k
    assert "replay/time_s" in result_files.read_text(results / "redr" / "seed0" / "train_metrics.jsonl")
    assert "| redr | 1 |" in report
    # Resumable: a second run trains nothing (the files stay as they were).
    stamps = {p: p.stat().st_mtime_ns for p in results.glob("*/seed0/**/*") if p.is_file()}
    assert main(["smoke", "--work-dir", str(tmp_path)]) == 0
    assert {p: p.stat().st_mtime_ns for p in stamps} == stamps



@pytest.mark.slow
def test_a_cut_off_run_resumes_from_its_checkpoint_as_if_never_cut(tmp_path):
    """A study run cut off after step 1 (a 1-step call: its checkpoint, no done.json) resumes from that
    checkpoint when called for 2 steps, and ends where an uninterrupted 2-step run ends: the same step
    records (the replay bank's included) and the same final weights, bit for bit on one thread."""
    pytest.importorskip("modebench.api", reason="modebench is not installed")
    import hashlib

    from benchmarks.modebench import _env, train_arm

    model_dir = smoke_model(tmp_path)
    sets = [f"model.name_or_path={model_dir}", "generation.num_generations=4", "generation.max_new_tokens=8",
            "training.micro_batch_size=4"]

    def train(name: str, steps: int):
        base = ["--config", str(RECIPE), *[a for kv in [*sets, f"training.max_steps={steps}"] for a in ("--set", kv)]]
        return train_arm("redr", ARMS["redr"], 0, results=tmp_path / name, work=tmp_path / f"{name}-runs",
                         base=base, env=_env(1))

    cut = train("cut", 1)
    assert (cut.steps, cut.resumed_from) == (1, 0)
    resumed = train("cut", 2)
    whole = train("whole", 2)
    assert (resumed.steps, resumed.resumed_from, whole.resumed_from) == (2, 1, 0)

    def records(trained):
        rows = result_files.read_jsonl(trained.out / "train_metrics.jsonl")
        return [{k: v for k, v in r.items() if not k.startswith(("time/", "replay/time")) and "time" not in k}
                for r in rows]

    assert [r["step"] for r in records(resumed)] == [1, 2]
    assert records(resumed) == records(whole)
    assert "bank/modes" in records(resumed)[1]

    def weights(trained):
        return hashlib.sha256((trained.final / "model.safetensors").read_bytes()).hexdigest()

    assert weights(resumed) == weights(whole)

def test_study_length_is_where_pass_at_8_stops_falling():
    curve = [(0, 0.50), (10, 0.45), (20, 0.40), (30, 0.36), (40, 0.35), (50, 0.30), (60, 0.29), (70, 0.31), (80, 0.28)]
    assert study_length(curve) == 50  # from 50 on nothing is lower by more than 0.03 (0.28 >= 0.27)
    assert study_length(curve, tolerance=0.0) == 80
    assert study_length([(0, 0.5), (40, 0.4), (50, 0.3)]) == 50  # the last checkpoint has nothing after it
    assert study_length([(0, 0.5), (10, 0.2), (20, 0.3)], min_length=40) is None  # never reached 40 steps
    assert study_length([(0, 0.5), (40, 0.3), (50, 0.35), (60, 0.29)]) == 40  # a rise and a fall within 0.03


@pytest.mark.slow
def test_length_evaluates_every_checkpoint_and_resumes(tmp_path, capsys):
    pytest.importorskip("modebench.api", reason="modebench is not installed")
    model_dir = smoke_model(tmp_path)
    args = ["length", "--steps", "2", "--every", "1", "--eval-problems", "2", "--work-dir", str(tmp_path / "runs"),
            "--results", str(tmp_path / "results"), *[a for kv in (
                f"model.name_or_path={model_dir}", "generation.num_generations=4", "generation.max_new_tokens=8",
                "training.micro_batch_size=4", "eval.k=4") for a in ("--set", kv)]]
    assert main(args) == 0
    report = capsys.readouterr().out
    out = tmp_path / "results" / "length" / "dr_grpo" / "seed0"
    assert [json.loads((out / f"step-{n}" / "done.json").read_text())["step"] for n in (1, 2)] == [1, 2]
    assert (tmp_path / "results" / START / "seed0" / "done.json").is_file()  # step 0: the study's start run
    assert len(result_files.read_jsonl(out / "train_metrics.jsonl")) == 2
    assert [line.split("|")[1].strip() for line in report.splitlines() if line.startswith("| ") and "step" not in line] \
        == ["0", "1", "2"]
    assert not (tmp_path / "runs" / "length" / "dr_grpo" / "seed0").exists()  # checkpoints go once all are evaluated
    # Resumable: a step not evaluated yet (its checkpoints gone, so the run trains again) is evaluated
    # alone; a step already evaluated is kept as it was.
    (out / "step-2" / "done.json").unlink()
    stamp = (out / "step-1" / "done.json").stat().st_mtime_ns
    assert main(args) == 0
    assert (out / "step-2" / "done.json").is_file()
    assert (out / "step-1" / "done.json").stat().st_mtime_ns == stamp
