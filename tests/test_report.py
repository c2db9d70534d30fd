"""The run report: parsing rules, plots (valid images, overlays), and an HTML page that escapes run text."""

from __future__ import annotations

import base64
import json
import math
import random
import re
from pathlib import Path

import pytest

pytest.importorskip("matplotlib", reason="matplotlib is needed for the report (extra: report)")

from maxent_grpo.report import (  # noqa: E402
    FigureSpec,
    Panel,
    best_and_worst,
    draw_figure,
    draw_step_time,
    figure_specs,
    load_run,
    main_report,
    parse_metrics_lines,
    rolling_mean,
    run_labels,
)

EVIL = "<script>alert('x')</script> & a < b"


def _metrics(num_steps: int, seed: int, *, speed: float = 1.0) -> list[dict]:
    rng = random.Random(seed)
    rows = []
    for step in range(1, num_steps + 1):
        progress = 1 / (1 + math.exp(-(step * speed - num_steps / 2) / (num_steps / 10)))
        accuracy = min(1.0, max(0.0, 0.1 + 0.7 * progress + rng.gauss(0, 0.08)))
        fmt = min(1.0, max(0.0, 0.3 + 0.6 * progress + rng.gauss(0, 0.05)))
        phases = {"generate": 6 + rng.random(), "reward": 0.3, "reference": 1.1, "policy": 3.2, "optimizer": 0.2}
        row = {
            "step": step,
            "reward": accuracy + fmt,
            "reward_std": 0.4 + rng.gauss(0, 0.03),
            "rewards/accuracy/mean": accuracy,
            "rewards/format/mean": fmt,
            "kl": 0.002 * step + abs(rng.gauss(0, 0.01)),
            "entropy": 1.5 - 0.6 * progress + rng.gauss(0, 0.05),
            "weight_entropy": 1.9 - 0.3 * progress,
            "tau": 0.3 * math.exp(-step / num_steps),
            "beta": 0.04,
            "learning_rate": 1e-6 * min(1.0, step / 10),
            "loss": rng.gauss(0, 0.1),
            "grad_norm": abs(rng.gauss(1, 0.3)),
            "completions/mean_length": 180 - 60 * progress + rng.gauss(0, 10),
            "completions/clipped_ratio": max(0.0, 0.2 - 0.15 * progress),
            "clip_ratio/low_mean": abs(rng.gauss(0.002, 0.001)),
            "clip_ratio/high_mean": abs(rng.gauss(0.004, 0.001)),
            "step_time": sum(phases.values()) + 0.5,
            **{f"time/{k}": v for k, v in phases.items()},
        }
        row["clip_ratio/region_mean"] = row["clip_ratio/low_mean"] + row["clip_ratio/high_mean"]
        if step % 25 == 0:
            row.update({"eval/pass@1": 0.1 + 0.6 * progress, "eval/pass@8": 0.3 + 0.6 * progress,
                        "eval/mean@8": 0.1 + 0.6 * progress})
        rows.append(row)
    return rows


def _completion(i: int, reward: float) -> dict:
    return {
        "prompt": f"<|im_start|>user\nWhat is {i} + 1? {EVIL}<|im_end|>",
        "completion": f"<think>{i} plus 1</think> \\boxed{{{i + 1}}} {EVIL}",
        "rewards": {"accuracy": reward, "format": 1.0},
        "reward": reward + 1.0,
        "advantage": reward - 0.5,
        "weight": 0.125,
        "length": 20 + i,
        "finish_reason": "stop",
    }


def make_run(path: Path, *, method="maxent-listwise", steps=120, seed=0, speed=1.0, truncated_tail=True) -> Path:
    path.mkdir(parents=True)
    lines = [json.dumps(r) for r in _metrics(steps, seed, speed=speed)]
    # A resume re-logs steps 40..41 after a crash: the later records must win.
    lines[39:39] = [json.dumps({"step": 40, "reward": -99.0}), json.dumps({"step": 41, "reward": -99.0})]
    text = "\n".join(lines) + "\n"
    if truncated_tail:
        text += '{"step": 999, "rew'  # killed mid-write
    (path / "metrics.jsonl").write_text(text)
    (path / "config.yaml").write_text(f"method: {method}\nbeta: 0.04\nnote: \"{EVIL}\"\n")
    (path / "run_info.json").write_text(json.dumps({"method": method, "family": "maxent", "loss_backend": "listwise"}))
    (path / "completions").mkdir()
    for step in (50, 100):
        rows = [_completion(i, reward=(i % 4) / 3) for i in range(8)]
        (path / "completions" / f"step-{step}.jsonl").write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    return path


# ----------------------------------------------------------------------------- pure parts


def test_rolling_mean_is_a_trailing_window_mean():
    values = [random.Random(3).random() for _ in range(40)]
    for window in (1, 3, 7, 40, 100):
        expected = [sum(values[max(0, i - window + 1) : i + 1]) / len(values[max(0, i - window + 1) : i + 1])
                    for i in range(len(values))]
        assert rolling_mean(values, window) == pytest.approx(expected, rel=1e-12)
    with pytest.raises(ValueError, match="window"):
        rolling_mean(values, 0)


def test_parse_metrics_keeps_the_last_record_of_a_step_and_reports_bad_lines():
    lines = ['{"step": 2, "reward": 1}', '{"step": 1, "reward": 0}', "", '{"reward": 5}', '{"step": 2, "reward": 3}',
             '{"step": 3, "rew']
    records, problems = parse_metrics_lines(lines)
    assert records == [{"step": 1, "reward": 0}, {"step": 2, "reward": 3}]
    assert len(problems) == 2 and "line 4" in problems[0] and "line 6" in problems[1]


def test_run_labels_tell_same_named_runs_apart(tmp_path):
    assert run_labels([tmp_path / "a" / "run", tmp_path / "b" / "run"]) == ["a/run", "b/run"]
    assert run_labels([tmp_path / "grpo", tmp_path / "maxent"]) == ["grpo", "maxent"]
    with pytest.raises(ValueError, match="run_dirs"):
        run_labels([tmp_path / "x", tmp_path / "x"])


def test_best_and_worst_never_repeat_a_row():
    rows = [{"reward": r, "id": i} for i, r in enumerate([0.5, 0.9, 0.1, 0.7, 0.3])]
    best, worst = best_and_worst(rows, 2)
    assert [r["reward"] for r in best] == [0.9, 0.7] and [r["reward"] for r in worst] == [0.1, 0.3]
    best, worst = best_and_worst(rows, 4)
    assert len(best) == 4 and [r["id"] for r in worst] == [2]  # 5 rows: only one left for "worst"


def test_figure_specs_skip_absent_metrics():
    specs = figure_specs({"step", "reward", "eval/pass@1"})
    assert [s.filename for s in specs] == ["reward.png", "eval.png"]
    assert [p.key for p in specs[0].panels] == ["reward"]
    assert figure_specs({"step"}) == []


# ----------------------------------------------------------------------------- the report


def _is_png(path: Path) -> tuple[int, int]:
    from PIL import Image

    with Image.open(path) as image:
        image.verify()
    with Image.open(path) as image:
        assert image.format == "PNG"
        return image.size


def test_report_of_one_run(tmp_path):
    run = make_run(tmp_path / "maxent-run")
    with pytest.warns(UserWarning, match="line 123 is not JSON"):
        html_path = main_report([run])
    out = run / "report"
    assert html_path == out / "report.html"
    pngs = sorted(p.name for p in out.glob("*.png"))
    assert pngs == ["clipping.png", "completions.png", "controllers.png", "eval.png", "kl_entropy.png",
                    "optimization.png", "reward.png", "step_time.png"]
    for name in pngs:
        width, height = _is_png(out / name)
        assert width >= 400 and height >= 300
    html = html_path.read_text()
    for name in pngs:
        assert f'href="{name}"' in html
    embedded = re.findall(r'src="data:image/png;base64,([A-Za-z0-9+/=]+)"', html)
    assert len(embedded) == len(pngs)
    assert {base64.b64decode(e) for e in embedded} == {(out / n).read_bytes() for n in pngs}
    assert "maxent-listwise" in html and "listwise" in html
    # Run text is escaped everywhere: completions, prompts, config.
    assert "<script>" not in html
    assert html.count("&lt;script&gt;alert(&#x27;x&#x27;)&lt;/script&gt; &amp; a &lt; b") >= 7
    assert "step 100" in html  # the latest completions file
    with pytest.warns(UserWarning):
        records = load_run(run, "r").records
    # The steps logged twice keep their later record, and the truncated tail line is dropped.
    assert [r["step"] for r in records] == list(range(1, 121))
    assert all(r["reward"] > -1 and "kl" in r for r in records)


@pytest.mark.slow
def test_report_overlays_runs_with_a_legend(tmp_path):
    runs = [make_run(tmp_path / "a" / "run", method="grpo"),
            make_run(tmp_path / "b" / "run", method="maxent-listwise", seed=1, speed=1.5, steps=80)]
    out = tmp_path / "compare"
    with pytest.warns(UserWarning):
        html = main_report(runs, out).read_text()
    assert "grpo" in html and "maxent-listwise" in html and "a/run" in html and "b/run" in html
    loaded = [load_run(p, label) for p, label in zip(runs, ["a/run", "b/run"])]
    fig = draw_figure(FigureSpec("kl.png", "KL", (Panel("kl", "KL", "nats"), Panel("entropy", "H", "nats"))), loaded)
    first = fig.axes[0]
    assert [t.get_text() for t in fig.legends[0].get_texts()] == ["a/run", "b/run"]
    # Per run: the thin per-step line and the thick rolling mean, over each run's own steps.
    assert len(first.get_lines()) == 4
    assert {len(line.get_xdata()) for line in first.get_lines()} == {120, 80}
    timing = draw_step_time(loaded)
    assert [ax.get_title() for ax in timing.axes if ax.get_visible()] == ["a/run", "b/run"]
    _is_png(out / "step_time.png")


def test_report_with_few_metrics_draws_only_what_is_there(tmp_path):
    run = tmp_path / "bare"
    run.mkdir()
    (run / "metrics.jsonl").write_text("\n".join(json.dumps({"step": s, "reward": s / 10}) for s in range(1, 6)))
    html = main_report([run], tmp_path / "out").read_text()
    assert sorted(p.name for p in (tmp_path / "out").glob("*.png")) == ["reward.png"]
    assert "no config.yaml" in html and "No completions were logged" in html


def test_report_rejects_a_folder_without_metrics(tmp_path):
    with pytest.raises(ValueError, match="run_dirs: .* no metrics.jsonl"):
        main_report([tmp_path], tmp_path / "out")
    with pytest.raises(ValueError, match="run_dirs"):
        main_report([], tmp_path / "out")
