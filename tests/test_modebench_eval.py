"""ModeBench's evaluation protocol (ALGORITHMS.md §18) through ``evaluate_prompts``: draws of ``k``
per prompt, the reportable threshold, the failure policy, one verifier call per completion, the
``eval:`` settings, and the package's own ``evaluate`` on the same responses."""

from __future__ import annotations

import json
import math

import pytest

modebench = pytest.importorskip("modebench", reason="modebench is not installed (the GPU machine's image)")
pytest.importorskip("datasets", reason="datasets is not installed (the GPU machine's image)")

import modebench.api  # noqa: E402
import modebench.evaluation  # noqa: E402
from modebench.evaluation import evaluate as package_evaluate  # noqa: E402

from maxent_grpo.errors import ConfigError  # noqa: E402
from maxent_grpo.evaluate import EvalSampling, evaluate_prompts, modebench_summary, per_prompt_metrics, per_task_means  # noqa: E402
from maxent_grpo.models import load_tokenizer  # noqa: E402
from maxent_grpo.rewards.registry import build_reward_spec  # noqa: E402
from maxent_grpo.rollout.backend import SamplingParams  # noqa: E402
from maxent_grpo.tasks.modebench_package import (Unscorable, _countdown_key, _text, _trees, grade_row,  # noqa: E402
                                                 package_rows)
from test_evaluate import ScriptedBackend  # noqa: E402
from tiny_runs import compiled  # noqa: E402


def _problem(row) -> str:
    return json.loads(row["mbp_task"])["problem"]


def _modes(row) -> list[str]:
    """Two or more correct countdown answers of distinct package keys (from an independent enumeration)."""
    answer = json.loads(row["mbp_task"])["answer"]
    keyed = {}
    for tree, value in _trees(tuple(answer["numbers"])):
        if value == answer["target"]:
            keyed.setdefault(_countdown_key(tree), f"\\boxed{{{_text(tree)}}}")
    assert len(keyed) >= 2
    return [keyed[k] for k in sorted(keyed)]


def _broken(row, tag: str) -> dict:
    """A row whose reference the package refuses (``invalid_reference``: an unscorable outcome)."""
    task = json.loads(row["mbp_task"])
    task["problem"] = task["problem"] + f" ({tag})"
    task["answer"] = {"verifier": "countdown", "numbers": [], "target": 3}
    prompt = [dict(m) for m in row["prompt"]]
    prompt[-1]["content"] = task["problem"]
    return {**row, "prompt": prompt, "mbp_task": json.dumps(task, sort_keys=True)}


@pytest.fixture
def counted(monkeypatch):
    """Every call of the package's grader, as (task id, response)."""
    calls = []
    real = modebench.api.grade

    def grade(task, response):
        calls.append((task.id, response))
        return real(task, response)

    monkeypatch.setattr(modebench.api, "grade", grade)
    return calls


def _evaluate(tiny_model_dir, rows, script, *, k, draws=1, **kwargs):
    tokenizer = load_tokenizer(tiny_model_dir)
    backend = ScriptedBackend(tokenizer, script)
    spec = build_reward_spec([{"name": "modebench_pkg"}])
    how = EvalSampling(k=k, sampling=SamplingParams(max_new_tokens=8), draws=draws)
    summary, records = evaluate_prompts(backend, tokenizer, rows, spec, how, **kwargs)
    return backend, summary, records


def test_draws_pooled_pcmd_and_one_verifier_call_per_completion(tiny_model_dir, counted):
    rows = package_rows("countdown", size=2, seed=3)
    a, b = _modes(rows[0])[:2]
    c = _modes(rows[1])[0]
    # Prompt 0: draw 0 = (a, a), draw 1 = (b, b). Prompt 1: draw 0 = (c, wrong), draw 1 = two malformed.
    script = {_problem(rows[0]): ([a, a, b, b], a), _problem(rows[1]): ([c, "\\boxed{1+1}", "no idea", "no idea"], c)}
    backend, summary, records = _evaluate(tiny_model_dir, rows, script, k=2, draws=2, min_defined_prompts=1)
    assert backend.calls[0][1] == 4  # draws * k samples per prompt
    assert [r["draw"] for r in records if r["mode"] == "sampled"] == [0, 0, 1, 1] * 2
    # Per group, then per prompt: accuracy (1, 1) and (1/2, 0); pass (1, 1) and (1, 0); distinct (1, 1) and (1, 0).
    assert summary["mb/accuracy"] == (1.0 + 0.25) / 2
    assert summary["mb/pass@k"] == (1.0 + 0.5) / 2
    assert summary["mb/distinct@k"] == (1.0 + 0.5) / 2
    # Pooled over the draws: prompt 0 holds {a: 2, b: 2}, 1 - (2 + 2) / (4 * 3); prompt 1 one verified answer.
    assert summary["mb/pcmd"] == pytest.approx(1 - 4 / 12, abs=1e-15)
    assert (summary["mb/pcmd_defined"], summary["mb/pcmd_prompts"], summary["mb/pcmd_se"]) == (1, 2, None)
    assert summary["mb/pcmd_reportable"] is True and summary["mb/eval_status"] == "complete"
    # §10's estimator over all n = 4 samples: prompt 1 has c = 1 correct, 1 - C(3, 2) / C(4, 2).
    assert summary["pass@2"] == pytest.approx((1.0 + (1 - math.comb(3, 2) / math.comb(4, 2))) / 2, abs=1e-12)
    # The reward, the mode key and the greedy answers: each distinct (task, completion) graded once.
    distinct = {(json.loads(rows[r["prompt_index"]]["mbp_task"])["id"], r["completion"]) for r in records}
    assert sorted(counted) == sorted(distinct) and len(counted) == 5
    _, strict, _ = _evaluate(tiny_model_dir, rows, script, k=2, draws=2)
    assert strict["mb/pcmd"] == summary["mb/pcmd"] and strict["mb/pcmd_reportable"] is False  # 1 < 30


def test_one_unscorable_completion_voids_every_metric(tiny_model_dir):
    rows = package_rows("countdown", size=2, seed=4)
    broken = _broken(rows[1], "broken")
    a = _modes(rows[0])[0]
    script = {_problem(rows[0]): ([a, a], a), _problem(broken): (["\\boxed{3}", "no idea"], "no idea")}
    _, summary, records = _evaluate(tiny_model_dir, [rows[0], broken], script, k=2)
    assert summary["mb/eval_status"] == "verifier_failure" and summary["mb/pcmd_reportable"] is False
    assert summary["mb/verifier_failures"] == 3  # two sampled and the greedy answer of the broken row
    for name in ("mb/accuracy", "mb/pass@k", "mb/distinct@k", "mb/pcmd", "mb/pcmd_defined", "pass@1", "pass@2",
                 "mean@2", "distinct@2", "coverage@2", "greedy_pass@1"):
        assert summary[name] is None, name
    assert summary["num_prompts"] == 2
    assert [r["unscorable"] for r in records if r["mode"] == "sampled"] == [False, False, True, True]
    assert all(v is None for v in per_task_means(per_prompt_metrics(records, 2)).values())
    # A healthy evaluation of the same first row is complete.
    _, healthy, _ = _evaluate(tiny_model_dir, [rows[0]], script, k=2)
    assert healthy["mb/eval_status"] == "complete" and healthy["mb/accuracy"] == 1.0 and healthy["pass@2"] == 1.0


def _record(task, prompt, key, draw=0, unscorable=False):
    return {"task": task, "prompt_index": prompt, "mode_key": key, "correct": key is not None, "mode": "sampled",
            "keyed": True, "draw": draw, "unscorable": unscorable}


def test_reportable_from_30_defined_prompts():
    defined = lambda p: [_record("t", p, "A"), _record("t", p, "B")]  # noqa: E731  PCMD 1, K = 2
    undefined = lambda p: [_record("t", p, "A"), _record("t", p, None)]  # noqa: E731  K = 1
    twenty_nine = [r for p in range(29) for r in defined(p)] + [r for p in range(29, 40) for r in undefined(p)]
    thirty = twenty_nine + defined(40)
    assert modebench_summary(twenty_nine)["mb/pcmd_defined"] == 29
    assert modebench_summary(twenty_nine)["mb/pcmd_reportable"] is False
    assert modebench_summary(thirty)["mb/pcmd_reportable"] is True and modebench_summary(thirty)["mb/pcmd"] == 1.0
    assert modebench_summary(twenty_nine, min_defined_prompts=29)["mb/pcmd_reportable"] is True
    # One unscorable attempt, in another task: every cell of the evaluation is void.
    two = modebench_summary(thirty + [_record("u", 99, None, unscorable=True)])
    assert two["mb/t/pcmd"] is None and two["mb/t/accuracy"] is None and two["mb/t/pcmd_reportable"] is False
    assert two["mb/eval_status"] == "verifier_failure"


def test_the_packages_evaluate_on_the_same_responses(monkeypatch):
    """modebench's own ``evaluate`` (it grades the responses itself): cell means, PCMD, its support and
    the failure policy equal ours on the same responses."""
    rows = package_rows("countdown", size=4, seed=5)
    responses = []
    for i, row in enumerate(rows):
        modes = _modes(row)
        responses.append([modes[0], modes[i % len(modes)], "no idea", modes[-1]][: 2 + i % 3])

    def package_records(rows, responses):
        out = []
        for row, texts in zip(rows, responses):
            task = json.loads(row["mbp_task"])
            out.append({**{k: task[k] for k in ("id", "level", "domain", "problem", "answer")}, "responses": texts})
        return out

    def ours_records(rows, responses):
        records = []
        for p, (row, texts) in enumerate(zip(rows, responses)):
            for text in texts:
                try:
                    key, unscorable = grade_row(row, text)["canonical_key"], False
                except Unscorable:
                    key, unscorable = None, True
                records.append(_record(f"k{len(texts)}", p, key, unscorable=unscorable))
                records[-1]["correct"] = key is not None
        return records

    for threshold in (1, 2, 30):
        theirs = package_evaluate(package_records(rows, responses), min_defined_prompts=threshold)
        mine = modebench_summary(ours_records(rows, responses), threshold)
        assert len(theirs["cells"]) == len({len(t) for t in responses})
        for cell in theirs["cells"]:
            prefix = f"mb/k{cell['k']}/" if len(theirs["cells"]) > 1 else "mb/"
            for name, key in (("accuracy", "accuracy"), ("pass_at_k", "pass@k"), ("distinct_at_k", "distinct@k")):
                assert mine[prefix + key] == pytest.approx(cell[name], abs=1e-15)
            pcmd = cell["pcmd"]
            assert (mine[prefix + "pcmd"] is None) == (pcmd["d_mode"] is None)
            if pcmd["d_mode"] is not None:
                assert mine[prefix + "pcmd"] == pytest.approx(pcmd["d_mode"], abs=1e-15)
            assert mine[prefix + "pcmd_defined"] == pcmd["defined_prompts"]
            assert mine[prefix + "pcmd_reportable"] == pcmd["reportable"]
    # The failure policy: one attempt whose grading timed out (the package refuses a bad reference before
    # grading, so the outcome is forced on both sides) voids every cell of both.
    real = modebench.evaluation.grade_prepared

    def one_timeout(prompt):
        outcome = real(prompt)
        if prompt["id"] == json.loads(rows[1]["mbp_task"])["id"]:
            outcome["draws"][0]["attempts"][0]["status"] = "timeout"
        return outcome

    monkeypatch.setattr(modebench.evaluation, "grade_prepared", one_timeout)
    theirs = package_evaluate(package_records(rows, responses), min_defined_prompts=1)
    mine = modebench_summary(ours_records(rows, responses) + [_record("other", 1, None, unscorable=True)], 1)
    assert mine["mb/eval_status"] == "verifier_failure"
    for cell in theirs["cells"]:
        prefix = f"mb/k{cell['k']}/"
        assert (cell["accuracy"], cell["pass_at_k"], cell["distinct_at_k"]) == (None, None, None)
        assert cell["pcmd"] == {"d_mode": None, "reportable": False, "reason": "verifier_failure"}
        for name in ("accuracy", "pass@k", "distinct@k", "pcmd"):
            assert mine[prefix + name] is None
        assert mine[prefix + "pcmd_reportable"] is False


def test_the_eval_settings():
    source = ["data.source=modebench_pkg:countdown", "rewards=[{name: modebench_pkg}]"]
    assert (compiled(overrides=source).eval.draws, compiled(overrides=source).eval.k) == (4, 8)
    plan = compiled()
    assert (plan.eval.k, plan.eval.draws, plan.eval.min_defined_prompts) == (4, 1, 30)
    assert compiled(overrides=[*source, "eval.draws=2", "eval.min_defined_prompts=5"]).eval == type(plan.eval)(
        num_prompts=plan.eval.num_prompts, k=8, seed=plan.eval.seed, draws=2, min_defined_prompts=5)
    for setting, value in (("eval.min_defined_prompts", "0"), ("eval.min_defined_prompts", "null"),
                           ("eval.draws", "0"), ("eval.draws", "true"), ("eval.k", "0")):
        with pytest.raises(ConfigError, match=rf"^{setting}: "):  # one line naming the field
            compiled(overrides=[f"{setting}={value}"])


def test_in_loop_validation_draws_four_groups_on_modebench_pkg(tiny_model_dir, tmp_path):
    from maxent_grpo.cli import main
    from maxent_grpo.training.metrics import read_metrics
    from tiny_runs import read_jsonl, tiny_overrides

    out = tmp_path / "run"
    args = tiny_overrides(tiny_model_dir, out, rewards="[{name: modebench_pkg}]", steps=1,
                          source="modebench_pkg:countdown",
                          extra=["data.eval_size=4", "eval.every_steps=1", "eval.num_prompts=2", "eval.k=2"])
    assert main(["train", *args]) == 0
    row = read_metrics(out / "metrics.jsonl")[-1]
    assert row["eval/mb/pcmd_prompts"] == 2 and row["eval/mb/verifier_failures"] == 0
    assert row["eval/mb/pcmd_reportable"] == 0.0  # 2 prompts < 30
    sampled = [r for r in read_jsonl(out / "eval" / "step-1" / "completions.jsonl") if r["mode"] == "sampled"]
    assert sorted((r["prompt_index"], r["draw"], r["sample"]) for r in sampled) == [
        (p, s // 2, s) for p in range(2) for s in range(8)]
    summary = json.loads((out / "eval" / "step-1" / "summary.json").read_text())
    assert summary["mb/eval_status"] == "complete"
