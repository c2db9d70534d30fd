"""Evaluation: ``evaluate_prompts`` bookkeeping, ``maxent-grpo eval`` on a model and on a
training checkpoint, and in-loop validation (files, metrics, an unchanged training trajectory)."""

from __future__ import annotations

import json
import math
import random
import re

import pytest
import torch

# The GPU machine's image has no datasets: `pytest -m gpu` from the root must still collect.
Dataset = pytest.importorskip("datasets", reason="datasets is not installed (the GPU machine's image)").Dataset

from maxent_grpo.cli import main
from maxent_grpo.eval_command import fresh_task_rows, select_eval_rows
from maxent_grpo.evaluate import CORRECT_THRESHOLD, EvalSampling, evaluate_prompts
from maxent_grpo.models import load_tokenizer
from maxent_grpo.rewards.registry import build_reward_spec
from maxent_grpo.rollout.backend import Completion, PromptGroup, SamplingParams
from maxent_grpo.config.load import load_config
from maxent_grpo.data.datasets import load_prompt_dataset, split_train_eval
from maxent_grpo.data.prompts import format_prompt
from maxent_grpo.training.metrics import read_metrics
from tiny_runs import compiled, read_jsonl
from tiny_runs import tiny_overrides as tiny_run_args

# ----------------------------------------------------------------------------- reward functions
# Imported by the config as 'test_evaluate:<name>' (pytest puts tests/ on sys.path).


def digit_score(prompts, completions, answer, **kwargs):
    """A checkable accuracy stand-in that a random tiny model sometimes passes: 1 when the
    completion holds the answer's last digit, 0.25 when it holds only other digits, 0 when
    it holds no digit, None (not applicable) when the answer is 'n/a'."""
    out = []
    for completion, gold in zip(completions, answer):
        text = completion if isinstance(completion, str) else completion[-1]["content"]
        if gold == "n/a":
            out.append(None)
        elif gold[-1] in text:
            out.append(1.0)
        else:
            out.append(0.25 if re.search(r"\d", text) else 0.0)
    return out


def boxed_in_valid(prompts, completions, valid, **kwargs):
    """1 when the last \\boxed{} number is one of the row's valid answers (compared as
    floats), 0.1 for another boxed number, None when nothing is boxed."""
    out = []
    for text, ok in zip(completions, valid):
        found = re.findall(r"\\boxed\{([^{}]*)\}", text)
        if not found:
            out.append(None)
            continue
        out.append(1.0 if float(found[-1]) in {float(v) for v in ok} else 0.1)
    return out


# ----------------------------------------------------------------------------- helpers


# The first reward decides correctness in evaluation; the second is recorded beside it.
REWARDS = ("[{name: 'test_evaluate:digit_score'}, "
           "{name: length, weight: 0.5, kwargs: {max_length: 32, direction: favour}}]")


def tiny_overrides(model_dir, out, *, steps=2, extra=()):
    return tiny_run_args(model_dir, out, rewards=REWARDS, steps=steps, extra=extra)


def comb_pass_at_k(n: int, c: int, k: int) -> float:
    """The unbiased estimator with exact binomials (the library uses a product form)."""
    return 1.0 - math.comb(n - c, k) / math.comb(n, k)


def check_summary_against_records(summary: dict, records: list[dict], k: int) -> None:
    """Recompute every summary metric from the per-completion records."""
    sampled = [r for r in records if r["mode"] == "sampled"]
    greedy = {r["prompt_index"]: r for r in records if r["mode"] == "greedy"}
    by_prompt: dict[int, list[dict]] = {}
    for r in sampled:
        by_prompt.setdefault(r["prompt_index"], []).append(r)
    assert summary["num_prompts"] == len(by_prompt)
    assert all(len(v) == k for v in by_prompt.values())
    for r in records:
        assert r["correct"] == (r["score"] is not None and r["score"] >= CORRECT_THRESHOLD)
        assert r["score"] == r["rewards"][next(iter(r["rewards"]))]  # the first reward decides
    for j in sorted({1, k}):
        expect_pass, expect_mean, expect_distinct = [], [], []
        for group in by_prompt.values():
            c = sum(r["correct"] for r in group)
            expect_pass.append(comb_pass_at_k(k, c, j))
            expect_mean.append(sum(r["score"] or 0.0 for r in group) / k)
            if j == k:  # all samples: simply the number of distinct correct answers
                expect_distinct.append(len({r["answer"] for r in group if r["correct"] and r["answer"] is not None}))
            else:  # j = 1: each correct answer a shows up with probability m_a / k
                expect_distinct.append(sum(1 for r in group if r["correct"] and r["answer"] is not None) / k)
        assert summary[f"pass@{j}"] == pytest.approx(sum(expect_pass) / len(expect_pass), abs=1e-12)
        assert summary[f"mean@{j}"] == pytest.approx(sum(expect_mean) / len(expect_mean), abs=1e-12)
        assert summary[f"distinct@{j}"] == pytest.approx(sum(expect_distinct) / len(expect_distinct), abs=1e-12)
    assert set(greedy) == set(by_prompt)
    assert summary["greedy_pass@1"] == pytest.approx(sum(g["correct"] for g in greedy.values()) / len(greedy))
    assert summary["pass@1"] <= summary[f"pass@{k}"]


# ----------------------------------------------------------------------------- evaluate_prompts


class ScriptedBackend:
    """A GenerationBackend that answers from a script ``{question: (sampled texts, greedy text)}``;
    questions in ``short`` come back one completion short, every time."""

    def __init__(self, tokenizer, script, short=()):
        self.tokenizer, self.script, self.short = tokenizer, script, set(short)
        self.calls = []

    def generate(self, prompts, num_generations, params):
        self.calls.append((list(prompts), num_generations, params))
        groups = []
        for prompt in prompts:
            question = next(q for q in self.script if q in prompt)
            sampled, greedy = self.script[question]
            texts = sampled[:num_generations] if params.do_sample else [greedy]
            if question in self.short:
                texts = texts[:-1]
            ids = lambda t: self.tokenizer.encode(t, add_special_tokens=False) + [self.tokenizer.eos_token_id]  # noqa: E731
            groups.append(PromptGroup(
                prompt=prompt, prompt_ids=self.tokenizer.encode(prompt, add_special_tokens=False),
                completions=[Completion(token_ids=ids(t), text=t, finish_reason="stop") for t in texts],
            ))
        return groups

    def sync_weights(self, policy):
        pass


SCRIPT = {
    "Name a number whose square is 4.": (
        ["\\boxed{2}", "so \\boxed{2.0}", "\\boxed{-2}", "\\boxed{3}", "no idea"], "\\boxed{-2}"),
    "Name a number whose cube is 8.": (["\\boxed{2}"] * 5, "\\boxed{2}"),
    "Name a prime between 4 and 6.": (
        ["\\boxed{4}", "\\boxed{6}", "\\boxed{9}", "x", "\\boxed{5}"], "\\boxed{4}"),
    "Name an even prime.": (["\\boxed{1}"] * 5, "\\boxed{2}"),
}
ROWS = [
    {"prompt": "Name a number whose square is 4.", "valid": ["2", "-2"]},
    {"prompt": "Name a number whose cube is 8.", "valid": ["2"]},  # comes back short: dropped
    {"prompt": "Name a prime between 4 and 6.", "valid": ["5"]},
    {"prompt": "Name an even prime.", "valid": ["2"]},
]


def test_evaluate_prompts_metrics_from_a_scripted_generator(tiny_model_dir):
    tokenizer = load_tokenizer(tiny_model_dir)
    backend = ScriptedBackend(tokenizer, SCRIPT, short={"Name a number whose cube is 8."})
    spec = build_reward_spec([{"name": "test_evaluate:boxed_in_valid"}, {"name": "length"}])
    sampling = SamplingParams(max_new_tokens=16, temperature=0.7)
    summary, records = evaluate_prompts(
        backend, tokenizer, ROWS, spec, EvalSampling(k=5, sampling=sampling, system_prompt="Be brief.")
    )
    # Scores by hand: first prompt 1, 1, 1, 0.1, None; third 0.1, 0.1, 0.1, None, 1; fourth 0.1 x 5.
    expected = {
        "pass@1": (3 / 5 + 1 / 5 + 0) / 3,
        "pass@5": (1 + 1 + 0) / 3,
        "mean@1": ((3 + 0.1) / 5 + (0.3 + 1) / 5 + 0.1) / 3,
        "mean@5": ((3 + 0.1) / 5 + (0.3 + 1) / 5 + 0.1) / 3,
        # "2" and "2.0" are one answer; "-2" another.
        "distinct@1": (3 / 5 + 1 / 5 + 0) / 3,
        "distinct@5": (2 + 1 + 0) / 3,
        "greedy_pass@1": (1 + 0 + 1) / 3,
        "num_prompts": 3,
    }
    assert set(summary) == set(expected)
    for key, value in expected.items():
        assert summary[key] == pytest.approx(value, abs=1e-12), key
    check_summary_against_records(summary, records, 5)
    # prompt_index refers to the rows given, around the dropped one.
    assert sorted({r["prompt_index"] for r in records}) == [0, 2, 3]
    first = [r for r in records if r["prompt_index"] == 0 and r["mode"] == "sampled"]
    assert [r["answer"] for r in first] == ["2", "2", "-2", "3", None]
    assert [r["score"] for r in first] == [1.0, 1.0, 1.0, 0.1, None]
    assert first[0]["rewards"] == {"test_evaluate:boxed_in_valid": 1.0, "length": first[0]["rewards"]["length"]}
    assert all(r["length"] == len(tokenizer.encode(r["completion"], add_special_tokens=False)) + 1 for r in records)
    # What the generator was asked: chat-templated prompts with the system prompt; greedy last.
    asked, g, params = backend.calls[0]
    assert g == 5 and params == sampling
    assert asked[0] == format_prompt(tokenizer, ROWS[0]["prompt"], system_prompt="Be brief.")
    greedy_call = backend.calls[-1]
    assert greedy_call[1] == 1 and greedy_call[2].do_sample is False
    assert len(greedy_call[0]) == 3  # the dropped prompt is not asked again for its greedy answer


def test_evaluate_prompts_k1_and_bad_arguments(tiny_model_dir):
    tokenizer = load_tokenizer(tiny_model_dir)
    spec = build_reward_spec([{"name": "test_evaluate:boxed_in_valid"}])
    sampling = SamplingParams(max_new_tokens=16)
    rows = [ROWS[0], ROWS[3]]
    summary, records = evaluate_prompts(
        ScriptedBackend(tokenizer, SCRIPT), tokenizer, rows, spec, EvalSampling(k=1, sampling=sampling, greedy=False)
    )
    assert summary == {"pass@1": 0.5, "mean@1": pytest.approx(0.55), "distinct@1": 0.5, "num_prompts": 2}
    assert [r["mode"] for r in records] == ["sampled", "sampled"]
    for bad in (0, -1, True, 2.0):
        with pytest.raises(ValueError, match="k must"):
            evaluate_prompts(ScriptedBackend(tokenizer, SCRIPT), tokenizer, rows, spec, EvalSampling(k=bad, sampling=sampling))
    with pytest.raises(ValueError, match="rows"):
        evaluate_prompts(ScriptedBackend(tokenizer, SCRIPT), tokenizer, [], spec, EvalSampling(k=1, sampling=sampling))
    with pytest.raises(RuntimeError, match="no prompt"):
        evaluate_prompts(
            ScriptedBackend(tokenizer, SCRIPT, short=SCRIPT), tokenizer, rows, spec, EvalSampling(k=2, sampling=sampling)
        )


def test_select_eval_rows_is_the_held_out_prefix_or_the_first_rows():
    ds = Dataset.from_list([{"prompt": f"question {i}", "answer": str(i)} for i in range(20)])
    _, held_out = split_train_eval(ds, 6, 3)
    assert select_eval_rows(ds, 6, 4, 3) == list(held_out)[:4]
    assert select_eval_rows(ds, 6, 50, 3) == list(held_out)  # never more than the held-out split
    assert select_eval_rows(ds, 0, 5, 3) == [dict(ds[i]) for i in range(5)]
    with pytest.raises(ValueError, match="num_prompts"):
        select_eval_rows(ds, 0, 0, 3)


def test_fresh_task_rows_are_problems_the_run_did_not_train_on_while_there_are_any(caplog):
    d = compiled(None, ["data.task_kwargs={min_terms: 1, max_terms: 1, max_digits: 1}"]).data  # 10 problems
    task = sorted(set(load_prompt_dataset(d.source, size=64, seed=1, instruction=d.instruction,
                                          task_kwargs=d.task_kwargs)["prompt"]))
    assert len(task) == 10
    untrained = fresh_task_rows(d, set(), 4)
    assert len({r["prompt"] for r in untrained}) == 4  # distinct problems
    with caplog.at_level("WARNING", logger="maxent_grpo"):
        assert [r["prompt"] for r in fresh_task_rows(d, set(task[2:]), 4)] in (task[:2], task[1::-1])
        assert "has 2 problem(s) the run did not train on, fewer than the 4 asked for" in caplog.text
        caplog.clear()
        # Every problem trained on: those (eval_rows' overlap warning says so).
        assert [r["prompt"] for r in fresh_task_rows(d, set(task), 4)] == [r["prompt"] for r in untrained]
        assert caplog.text == ""


# ----------------------------------------------------------------------------- the eval command


@pytest.fixture(scope="module")
def digits_data(tmp_path_factory):
    path = tmp_path_factory.mktemp("data") / "digits.jsonl"
    rows = [{"prompt": f"What is {i} + 3?", "answer": str(i + 3)} for i in range(7)]
    rows[2]["answer"] = "n/a"  # the deciding reward returns None here
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def _eval_args(model, out, data, *extra):
    return [
        "eval", str(model), "--output", str(out),
        "--set", f"data.source={data}", "--set", "data.size=null",
        "--set", "generation.max_new_tokens=8",
        "--set", "rewards=[{name: 'test_evaluate:digit_score'}, {name: 'learnable_rewards:shortness'}]",
        *extra,
    ]


def test_eval_cli_on_the_tiny_model(tiny_model_dir, digits_data, tmp_path, capsys):
    out = tmp_path / "eval"
    assert main(_eval_args(tiny_model_dir, out, digits_data, "-k", "6", "--num-prompts", "5")) == 0
    summary = json.loads((out / "summary.json").read_text())
    assert json.loads(capsys.readouterr().out) == summary
    assert summary["model"] == str(tiny_model_dir)
    assert summary["deciding_reward"] == "test_evaluate:digit_score"
    for key in ("pass@1", "pass@6", "mean@1", "mean@6", "distinct@1", "distinct@6", "greedy_pass@1"):
        assert 0.0 <= summary[key] <= 6.0, key
    records = read_jsonl(out / "completions.jsonl")
    assert len(records) == 5 * 6 + 5
    check_summary_against_records(summary, records, 6)
    # The first five rows of the file, in order (no held-out split configured).
    assert [r["prompt_index"] for r in records if r["mode"] == "greedy"] == [0, 1, 2, 3, 4]
    assert all(f"What is {r['prompt_index']} + 3?" in r["prompt"] for r in records)
    for r in records:
        assert r["rewards"]["learnable_rewards:shortness"] == pytest.approx(max(0.0, 1 - r["length"] / 16))
        assert r["length"] == 8 if r["finish_reason"] == "length" else 1 <= r["length"] <= 8
        assert r["score"] == digit_score(None, [r["completion"]], ["n/a" if r["prompt_index"] == 2 else str(r["prompt_index"] + 3)])[0]
    assert all(r["score"] is None and not r["correct"] for r in records if r["prompt_index"] == 2)
    # The random model passes sometimes and fails sometimes, so pass@k is a real comparison.
    sampled = [r for r in records if r["mode"] == "sampled"]
    assert 0 < sum(r["correct"] for r in sampled) < len(sampled)
    assert summary["pass@1"] < summary["pass@6"]
    # Seeded: the same command gives the same numbers.
    again = tmp_path / "again"
    assert main(_eval_args(tiny_model_dir, again, digits_data, "-k", "6", "--num-prompts", "5")) == 0
    assert json.loads((again / "summary.json").read_text()) == summary


@pytest.mark.parametrize("flag, value", [("-k", "0"), ("--num-prompts", "0")])
def test_eval_cli_rejects_bad_counts(flag, value, tiny_model_dir, digits_data, tmp_path, capsys):
    assert main(_eval_args(tiny_model_dir, tmp_path / "o", digits_data, flag, value)) == 2  # a usage error, like a bad config key
    err = capsys.readouterr().err
    assert flag in err and len(err.strip().splitlines()) == 1
    assert not (tmp_path / "o").exists()


# ----------------------------------------------------------------------------- in-loop validation


@pytest.fixture(scope="module")
def trained_runs(tiny_model_dir, tmp_path_factory):
    """Two 4-step grpo runs with the same held-out split: one validating every 2 steps, one never."""
    root = tmp_path_factory.mktemp("runs")
    common = ["method=grpo", "data.eval_size=4", "eval.num_prompts=3", "eval.k=3", "training.learning_rate=0.001"]
    runs = {}
    for name, every in (("with_eval", 2), ("without_eval", 0)):
        out = root / name
        args = tiny_overrides(tiny_model_dir, out, steps=4, extra=[*common, f"eval.every_steps={every}"])
        assert main(["train", *args]) == 0
        runs[name] = out
    return runs


def _training_view(row: dict) -> dict:
    return {k: v for k, v in row.items() if not k.startswith(("eval/", "time/")) and not k.endswith("_time")}


@pytest.mark.slow
def test_validation_leaves_the_training_trajectory_unchanged(trained_runs):
    with_eval = read_metrics(trained_runs["with_eval"] / "metrics.jsonl")
    without = read_metrics(trained_runs["without_eval"] / "metrics.jsonl")
    assert [r["step"] for r in with_eval] == [1, 2, 3, 4]
    assert [_training_view(r) for r in with_eval] == [_training_view(r) for r in without]
    assert any(r["grad_norm"] > 0 for r in without)  # the policy did move: the comparison means something
    for step in (1, 2, 3, 4):
        a = read_jsonl(trained_runs["with_eval"] / "completions" / f"step-{step}.jsonl")
        b = read_jsonl(trained_runs["without_eval"] / "completions" / f"step-{step}.jsonl")
        assert a == b
    assert not (trained_runs["without_eval"] / "eval").exists()
    assert not any(k.startswith("eval/") for r in without for k in r)


@pytest.mark.slow
def test_validation_writes_summaries_and_eval_metrics_at_its_steps(trained_runs):
    out = trained_runs["with_eval"]
    rows = {r["step"]: r for r in read_metrics(out / "metrics.jsonl")}
    assert sorted(p.name for p in (out / "eval").iterdir()) == ["step-2", "step-4"]
    for step in (1, 3):
        assert not any(k.startswith("eval/") for k in rows[step])
    # The held-out rows, the same ones `maxent-grpo eval` picks from the run's config.
    cfg = load_config(out / "config.yaml", [])
    ds = load_prompt_dataset(cfg.data.source, size=cfg.data.size, seed=cfg.training.seed)
    held_out = select_eval_rows(ds, cfg.data.eval_size, cfg.eval.num_prompts, cfg.training.seed)
    tokenizer = load_tokenizer(out / "checkpoints" / "step-4")
    for step in (2, 4):
        summary = json.loads((out / "eval" / f"step-{step}" / "summary.json").read_text())
        records = read_jsonl(out / "eval" / f"step-{step}" / "completions.jsonl")
        assert summary["num_prompts"] == 3 and len(records) == 3 * 3 + 3
        check_summary_against_records(summary, records, 3)
        for key in ("pass@1", "pass@3", "mean@1", "mean@3", "distinct@1", "distinct@3", "greedy_pass@1", "num_prompts"):
            assert rows[step][f"eval/{key}"] == summary[key], key
        greedy = sorted((r for r in records if r["mode"] == "greedy"), key=lambda r: r["prompt_index"])
        assert [r["prompt"] for r in greedy] == [
            format_prompt(tokenizer, row["prompt"], system_prompt=cfg.data.system_prompt, few_shot=cfg.data.few_shot)
            for row in held_out
        ]
    # Never validated on a prompt it trained on.
    trained_prompts = {r["prompt"] for s in (1, 2, 3, 4) for r in read_jsonl(out / "completions" / f"step-{s}.jsonl")}
    assert not trained_prompts & {r["prompt"] for r in read_jsonl(out / "eval" / "step-4" / "completions.jsonl")}


@pytest.mark.slow
def test_eval_cli_on_a_checkpoint_reproduces_in_loop_validation(trained_runs, tmp_path):
    """``maxent-grpo eval checkpoints/step-4 --config RUN/config.yaml`` evaluates the prompts the run
    validated on, with the weights and the seed it had: the very same completions and numbers."""
    run = trained_runs["with_eval"]
    out = tmp_path / "ckpt-eval"
    ckpt = run / "checkpoints" / "step-4"
    assert main(["eval", str(ckpt), "--config", str(run / "config.yaml"), "--output", str(out)]) == 0
    summary = json.loads((out / "summary.json").read_text())
    records = read_jsonl(out / "completions.jsonl")
    check_summary_against_records(summary, records, 3)
    assert records == read_jsonl(run / "eval" / "step-4" / "completions.jsonl")
    in_loop = json.loads((run / "eval" / "step-4" / "summary.json").read_text())
    assert summary == {**in_loop, "model": str(ckpt), "deciding_reward": "test_evaluate:digit_score"}
    # The step-2 weights sample other completions from the same seed.
    assert records != read_jsonl(run / "eval" / "step-2" / "completions.jsonl")


@pytest.mark.slow
def test_validate_restores_the_rng_and_uses_its_own_seed(tiny_model_dir, tmp_path):
    from maxent_grpo.training.setup import build_run
    from maxent_grpo.training.validation import validate

    args = tiny_overrides(tiny_model_dir, tmp_path / "run", extra=["data.eval_size=3", "eval.k=2", "eval.num_prompts=3"])
    overrides = [args[i + 1] for i in range(len(args)) if args[i] == "--set"]
    run = build_run(compiled(None, [*overrides, f"logging.output_dir={tmp_path / 'run'}"]))
    try:
        torch.manual_seed(1234)
        random.seed(99)
        torch_state, py_state = torch.get_rng_state(), random.getstate()
        first = validate(run, 2)
        assert torch.equal(torch.get_rng_state(), torch_state) and random.getstate() == py_state
        torch.manual_seed(4321)  # the caller's RNG does not matter
        assert validate(run, 3) == first
        # Same weights, same seed at every step (common random numbers): the same completions.
        assert read_jsonl(tmp_path / "run" / "eval" / "step-2" / "completions.jsonl") == read_jsonl(
            tmp_path / "run" / "eval" / "step-3" / "completions.jsonl")
        assert set(first) == {f"eval/{k}" for k in ("pass@1", "pass@2", "mean@1", "mean@2", "distinct@1",
                                                    "distinct@2", "greedy_pass@1", "num_prompts")}
    finally:
        run.finish()


@pytest.mark.slow
def test_eval_and_train_print_the_same_sampling_line(tiny_model_dir, tmp_path, caplog):
    """Both commands build the sampler from the same compiled plan (training/sampler.py): for the same
    config they print the same sampling line; train also prints the global batch it derives."""
    run = tmp_path / "run"
    args = tiny_overrides(tiny_model_dir, run, steps=1, extra=["generation.temperature=0.7", "generation.top_k=5",
                                                              "checkpoint.save_final=false"])

    def said(prefix: str) -> list[str]:
        return [r.getMessage() for r in caplog.records if r.getMessage().startswith(prefix)]

    with caplog.at_level("INFO", logger="maxent_grpo"):
        assert main(["train", *args]) == 0
        trained, batch = said("sampling:"), said("global batch:")
        caplog.clear()
        assert main(["eval", str(tiny_model_dir), "--config", str(run / "config.yaml"), "--output",
                     str(tmp_path / "eval"), "--num-prompts", "2", "-k", "2"]) == 0
        evaluated = said("sampling:")
    assert trained == evaluated == [
        "sampling: hf from the policy itself, temperature 0.7, top_p 1, top_k 5, max_new_tokens 8, stop []"]
    assert batch == ["global batch: 2 prompts x 1 process(es) x 4 completions = 8 completions per optimizer step "
                     "(micro-batches of 4, 1 pass(es))"]
