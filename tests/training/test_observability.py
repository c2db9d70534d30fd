"""What a real (tiny) training run shows: tracker files read back, completion tables checked
against independent recomputations, and ``maxent-grpo report`` on the run folder."""

from __future__ import annotations

import base64
import glob
import importlib.util
import json
import math
import statistics
from html import escape as html_escape
from pathlib import Path

import pytest

from maxent_grpo.cli import main
from maxent_grpo.training.metrics import read_metrics
from tiny_runs import read_jsonl, wandb_history
from tiny_runs import tiny_overrides as tiny_run_args

COLUMNS = ["prompt", "completion", "rewards", "reward", "advantage", "weight", "length", "finish_reason", "rank"]
REWARD_WEIGHTS = {"boxed_accuracy": 1.0, "length": 0.5}
G, PROMPTS, MAX_NEW = 4, 2, 8
HAS_WANDB = importlib.util.find_spec("wandb") is not None

pytestmark = pytest.mark.slow  # every test here reads a training run (a few seconds each)


# Weighted, and varying on random text (its length in characters), so groups are not all-equal.
REWARDS = "[{name: boxed_accuracy}, {name: length, weight: 0.5, kwargs: {max_length: 32, direction: favour}}]"


def tiny_overrides(model_dir, out, *, steps=2, extra=()):
    return tiny_run_args(model_dir, out, rewards=REWARDS, steps=steps, num_generations=G,
                         max_new_tokens=MAX_NEW, prompts_per_step=PROMPTS, extra=extra)


@pytest.fixture(scope="module")
def grpo_run(tiny_model_dir, tmp_path_factory):
    """A 2-step grpo run with every tracker that is installed among tensorboard and wandb, and validation."""
    out = tmp_path_factory.mktemp("grpo") / "run"
    trackers = ["tensorboard"] + (["wandb"] if HAS_WANDB else [])
    args = tiny_overrides(tiny_model_dir, out, extra=[
        "method=grpo", "loss.scale_rewards=group", "loss.advantage_estimator=grpo",
        f"logging.report_to=[{', '.join(trackers)}]",
        "data.eval_size=4", "eval.every_steps=1", "eval.k=2", "eval.num_prompts=2",
    ])
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("WANDB_MODE", "offline")
        mp.setenv("WANDB_SILENT", "true")
        assert main(["train", *args]) == 0
        if HAS_WANDB:
            import wandb

            wandb.teardown()  # run.finish() can return before wandb's service has written the file
    return out


@pytest.fixture(scope="module")
def listwise_run(tiny_model_dir, tmp_path_factory):
    out = tmp_path_factory.mktemp("listwise") / "run"
    assert main(["train", *tiny_overrides(tiny_model_dir, out, extra=["method=maxent_listwise"])]) == 0
    return out


# ----------------------------------------------------------------------------- tensorboard


def test_tensorboard_holds_every_metric_of_every_step_and_the_tables(grpo_run):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    rows = read_metrics(grpo_run / "metrics.jsonl")
    events = EventAccumulator(str(grpo_run / "tensorboard"), size_guidance={"scalars": 0, "tensors": 0})
    events.Reload()
    keys = {k for r in rows for k in r if k != "step" and r[k] is not None}
    assert {"reward", "loss", "kl" if "kl" in keys else "reward_std", "eval/pass@1", "eval/greedy_pass@1"} <= keys
    assert keys <= set(events.Tags()["scalars"])
    for key in keys:
        scalars = events.Scalars(key)
        assert [s.step for s in scalars] == [r["step"] for r in rows if r.get(key) is not None], key
        assert [s.value for s in scalars] == pytest.approx(
            [r[key] for r in rows if r.get(key) is not None], rel=1e-6, abs=1e-6), key  # stored as float32
    tables = events.Tensors("completions/text_summary")
    assert [t.step for t in tables] == [1, 2]
    for t in tables:
        # Markdown rows end at "\n" only (not at the form feeds or other separators of str.splitlines).
        lines = t.tensor_proto.string_val[0].decode().split("\n")
        assert lines[0] == "| " + " | ".join(COLUMNS) + " |"
        completions = read_jsonl(grpo_run / "completions" / f"step-{t.step}.jsonl")
        assert len(lines) == 2 + len(completions)
        for line, row in zip(lines[2:], completions):
            cells = line.split(" | ")
            # The numbers at the end of each line are the table's own columns, in order.
            assert cells[-5:] == [str(row["advantage"]), str(row["weight"]), str(row["length"]), row["finish_reason"], "0 |"]
    assert "config/text_summary" in events.Tags()["tensors"]


# ----------------------------------------------------------------------------- wandb


@pytest.mark.skipif(not HAS_WANDB, reason="wandb is not installed")
def test_wandb_offline_run_holds_the_metrics_and_the_tables(grpo_run):
    rows = read_metrics(grpo_run / "metrics.jsonl")
    run_dirs = glob.glob(str(grpo_run / "wandb" / "offline-run-*"))
    assert len(run_dirs) == 1
    history = wandb_history(glob.glob(run_dirs[0] + "/run-*.wandb")[0])
    assert [h["_step"] for h in history] == [1, 2]
    for h, r in zip(history, rows):
        for key in ("reward", "loss", "grad_norm", "eval/pass@1", "rewards/length/mean"):
            assert h[key] == pytest.approx(r[key], rel=1e-12), key
        assert h["completions/_type"] == "table-file"
        table = json.loads(Path(run_dirs[0], "files", h["completions/path"]).read_text())
        assert table["columns"] == COLUMNS
        completions = read_jsonl(grpo_run / "completions" / f"step-{h['_step']}.jsonl")
        assert [row[1] for row in table["data"]] == [c["completion"] for c in completions]
        assert [row[4] for row in table["data"]] == pytest.approx([c["advantage"] for c in completions])


# ----------------------------------------------------------------------------- completion tables


def _groups(rows):
    assert len(rows) == PROMPTS * G
    return [rows[i : i + G] for i in range(0, len(rows), G)]


def test_completion_table_rows_recompute_from_their_own_rewards(grpo_run):
    metrics = {r["step"]: r for r in read_metrics(grpo_run / "metrics.jsonl")}
    nonzero = 0
    for step in (1, 2):
        rows = read_jsonl(grpo_run / "completions" / f"step-{step}.jsonl")
        for group in _groups(rows):
            assert len({r["prompt"] for r in group}) == 1
            totals = []
            for r in group:
                assert list(r) == COLUMNS
                assert set(r["rewards"]) == set(REWARD_WEIGHTS)
                assert all(v is not None for v in r["rewards"].values())
                total = math.fsum(REWARD_WEIGHTS[k] * v for k, v in r["rewards"].items())
                assert r["reward"] == pytest.approx(total, abs=1e-12)
                assert r["weight"] is None  # no MaxEnt weighting in grpo
                assert r["length"] == MAX_NEW if r["finish_reason"] == "length" else 1 <= r["length"] <= MAX_NEW
                totals.append(total)
            # A_i = (r_i - mean) / (unbiased std + 1e-4), per group (ALGORITHMS.md §2).
            mean, std = statistics.fmean(totals), statistics.stdev(totals)
            for r, total in zip(group, totals):
                assert r["advantage"] == pytest.approx((total - mean) / (std + 1e-4), rel=1e-9, abs=1e-9)
            nonzero += any(abs(r["advantage"]) > 1e-3 for r in group)
        # The step's logged metrics are the table's, summarised.
        assert metrics[step]["reward"] == pytest.approx(statistics.fmean(r["reward"] for r in rows), abs=1e-9)
        assert metrics[step]["reward_std"] == pytest.approx(statistics.stdev(r["reward"] for r in rows), abs=1e-9)
        for name in REWARD_WEIGHTS:
            values = [r["rewards"][name] for r in rows]
            assert metrics[step][f"rewards/{name}/mean"] == pytest.approx(statistics.fmean(values), abs=1e-9)
        assert metrics[step]["completions/mean_length"] == pytest.approx(statistics.fmean(r["length"] for r in rows))
        assert metrics[step]["completions/clipped_ratio"] == pytest.approx(
            statistics.fmean(r["finish_reason"] == "length" for r in rows))
    assert nonzero >= 2  # the check above compared real, varied advantages


def test_listwise_table_weights_are_the_closed_form_maxent_targets(listwise_run):
    """w = softmax(log q / (tau + beta)), q = floored softmax(r / T_q), from the table's reward column (§4)."""
    import yaml

    cfg = yaml.safe_load((listwise_run / "config.yaml").read_text())
    tau, beta = cfg["maxent"]["tau"], cfg["loss"]["beta"]
    t_q, q_eps = cfg["maxent"]["q_temperature"], cfg["maxent"]["q_epsilon"]
    assert beta == 0  # no reference term to recompute
    varied = 0
    for step in (1, 2):
        for group in _groups(read_jsonl(listwise_run / "completions" / f"step-{step}.jsonl")):
            r = [row["reward"] for row in group]
            top = max(r)
            e = [math.exp((x - top) / t_q) for x in r]
            q = [x / math.fsum(e) for x in e]
            eps = min(q_eps, 1 / G - 1e-8)
            q = [(1 - G * eps) * x + eps for x in q]
            logits = [math.log(x) / (tau + beta) for x in q]
            top = max(logits)
            u = [math.exp(x - top) for x in logits]
            expected = [x / math.fsum(u) for x in u]
            weights = [row["weight"] for row in group]
            assert weights == pytest.approx(expected, rel=1e-5, abs=1e-7)
            assert math.fsum(weights) == pytest.approx(1.0, abs=1e-6)
            varied += max(expected) - min(expected) > 1e-3
    assert varied >= 2


def test_rewarded_only_weights_are_the_closed_form_over_rewarded_completions(tiny_model_dir, tmp_path):
    """maxent.zero_weight_unrewarded: q (and so w) restricted to completions with reward > 0; a group
    whose rewards all agree (none rewarded, or all) trains nothing and shows uniform weights."""
    out = tmp_path / "run"
    args = tiny_run_args(tiny_model_dir, out, rewards="[{name: 'learnable_rewards:even_first_token'}]",
                         num_generations=G, prompts_per_step=PROMPTS,
                         extra=["method=maxent_listwise", "maxent.zero_weight_unrewarded=true"])
    assert main(["train", *args]) == 0
    cfg = {"tau": 0.5, "q_temperature": 1.0, "q_epsilon": 1e-6}
    mixed = 0
    for step in (1, 2):
        for group in _groups(read_jsonl(out / "completions" / f"step-{step}.jsonl")):
            r = [row["reward"] for row in group]
            weights = [row["weight"] for row in group]
            if len(set(r)) == 1:
                assert weights == pytest.approx([1 / G] * G)
                continue
            kept = [i for i, x in enumerate(r) if x > 0]
            e = [math.exp(r[i] / cfg["q_temperature"]) for i in range(G)]
            eps = min(cfg["q_epsilon"], 1 / G - 1e-8)
            q = [(1 - G * eps) * x / math.fsum(e) + eps for x in e]
            u = [q[i] ** (1 / cfg["tau"]) for i in kept]
            expected = [0.0] * G
            for i, x in zip(kept, u):
                expected[i] = x / math.fsum(u)
            assert weights == pytest.approx(expected, rel=1e-5, abs=1e-7)
            mixed += 1
    assert mixed >= 2


# ----------------------------------------------------------------------------- report


def _pngs(folder: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(folder.glob("*.png"))}


def test_report_cli_on_a_real_run(grpo_run, capsys):
    assert main(["report", str(grpo_run)]) == 0
    html_path = grpo_run / "report" / "report.html"
    assert f"report: {html_path}" in capsys.readouterr().out
    pngs = _pngs(grpo_run / "report")
    assert {"eval.png"} < set(pngs)  # validation ran, so its panel is there, among others
    assert all(data[:8] == b"\x89PNG\r\n\x1a\n" for data in pngs.values())
    html = html_path.read_text()
    for data in pngs.values():
        assert base64.b64encode(data).decode() in html  # self-contained: every plot embedded
    assert "step 2" in html  # the samples come from the latest completion table
    assert json.loads((grpo_run / "run_info.json").read_text())["method"] in html


def test_report_cli_overlays_two_real_runs(grpo_run, listwise_run, tmp_path):
    out = tmp_path / "both"
    assert main(["report", str(grpo_run), str(listwise_run), "--out", str(out)]) == 0
    html = (out / "report.html").read_text()
    for run, method in ((grpo_run, "grpo"), (listwise_run, "maxent_listwise")):
        assert f"<td>{html_escape(str(run))}</td>" in html
        assert f"<td>{method}</td>" in html
    assert {"reward.png"} <= set(_pngs(out)) or _pngs(out)
