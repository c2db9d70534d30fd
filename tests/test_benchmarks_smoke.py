"""The benchmark harness: its pieces (fast) and one end-to-end run on the tiny model (slow)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO_ROOT = Path(__file__).resolve().parents[1]
# benchmarks/ is a top-level folder of the repo, not part of the installed package.
sys.path.insert(0, str(REPO_ROOT))

from benchmarks.children import ChildFailed, child_env, run_child  # noqa: E402
from benchmarks.common_rewards import REWARD_NAMES, boxed_accuracy, boxed_format  # noqa: E402
from benchmarks.ours import ours_available, ours_config, write_config  # noqa: E402
from benchmarks.results import RunResult, prompt_mismatch, summarize  # noqa: E402
from benchmarks.sample_eval import summarize_samples  # noqa: E402
from benchmarks.settings import PRESETS, BenchSetting  # noqa: E402
from benchmarks.tasks import rows_for_step, setting_rows, step_prompt_hash, task_rows  # noqa: E402
from maxent_grpo.run_files import prompt_ids_hash  # noqa: E402


# ------------------------------------------------------------------ pass@k


def test_summarize_samples_counts_distinct_correct_answers_after_canonicalisation():
    scores = [[1.0, 1.0, 1.0, 0.0], [0.0, 0.0, 0.0, 0.0]]
    answers = [["4", "4.0", " 2+2", "5"], ["1", None, "2", "3"]]
    mean, pass_at, distinct = summarize_samples(scores, answers, ks=[1, 4])
    assert mean == pytest.approx(3 / 8)
    assert pass_at[1] == pytest.approx((3 / 4 + 0) / 2)
    assert pass_at[4] == pytest.approx((1 + 0) / 2)
    # "4" and "4.0" are one answer, "2+2" another; the wrong "5" does not count.
    assert distinct == pytest.approx((2 + 0) / 2)


# ------------------------------------------------------------------ prompts and rewards


@pytest.mark.slow  # importing datasets takes seconds
def test_task_rows_are_the_prompts_our_trainer_builds():
    from maxent_grpo.data.datasets import load_prompt_dataset

    ours = load_prompt_dataset("reasoning_gym:chain_sum", size=6, seed=3)
    rows = task_rows("chain_sum", 6, 3)
    assert [r["prompt"] for r in rows] == [[{"role": "user", "content": p}] for p in ours["prompt"]]
    assert [r["answer"] for r in rows] == list(ours["answer"])
    assert [json.loads(r["rg_entry"]) for r in rows] == [json.loads(e) for e in ours["rg_entry"]]


@pytest.mark.slow  # importing datasets takes seconds
def test_default_task_rows_show_every_side_the_prompt_our_trainer_formats(tiny_model_dir, tmp_path):
    """The default task's options and example, pinned in the setting: TRL and the floor template the
    rows' messages; ours formats its source with data.few_shot from the benchmark config. Both must
    give the same text and the same problems."""
    from maxent_grpo.models import load_model_and_tokenizer
    from maxent_grpo.config.load import load_config
    from maxent_grpo.data.datasets import load_prompt_dataset
    from maxent_grpo.data.prompts import format_prompt

    setting = PRESETS["smollm2-default"].replace(dataset_size=5)
    cfg = load_config(write_config(setting, tiny_model_dir, tmp_path / "c.yaml"))
    ours = load_prompt_dataset(cfg.data.source, size=5, seed=setting.seed, task_kwargs=cfg.data.task_kwargs)
    rows = setting_rows(setting)
    _, tok = load_model_and_tokenizer(tiny_model_dir)
    theirs = [tok.apply_chat_template(r["prompt"], tokenize=False, add_generation_prompt=True) for r in rows]
    assert theirs == [format_prompt(tok, p, few_shot=cfg.data.few_shot) for p in ours["prompt"]]
    assert len(rows[0]["prompt"]) == 3  # example question, example answer, the problem
    assert all(json.loads(r["rg_entry"])["metadata"]["num_terms"] == 2 for r in rows)  # the default's a + b


def test_a_plain_setting_gives_our_trainer_no_default_task_options_or_example(tmp_path):
    """Our trainer's own defaults (the default task's a + b and solved example) must not reach a
    benchmark run: the setting's (here empty) options and examples are written out."""
    from maxent_grpo.config.load import load_config

    setting = PRESETS["tiny"]
    assert setting.task_kwargs == {} and setting.few_shot == ()
    cfg = load_config(write_config(setting, tmp_path / "model", tmp_path / "c.yaml"))
    assert cfg.data.source == "reasoning_gym:chain_sum"  # the default run's source, yet not its options
    assert cfg.data.task_kwargs == {} and cfg.data.few_shot == []
    pinned = PRESETS["smollm2-default"]
    cfg = load_config(write_config(pinned, tmp_path / "model", tmp_path / "d.yaml"))
    assert cfg.data.task_kwargs == pinned.task_kwargs
    assert [(ex.prompt, ex.completion) for ex in cfg.data.few_shot] == list(pinned.few_shot)


def test_setting_json_round_trip_keeps_the_pinned_prompts(tmp_path):
    setting = PRESETS["smollm2-default"]
    setting.to_json(tmp_path / "s.json")
    assert BenchSetting.from_json(tmp_path / "s.json") == setting


def test_pair_sum_rows_reach_our_trainer_as_the_other_sides_see_them(tiny_model_dir, tmp_path):
    """pair_sum is read by our trainer from the JSONL that write_config writes: the same
    messages (example turn included) and the same rg_entry the rewards score."""
    from maxent_grpo.models import load_model_and_tokenizer
    from maxent_grpo.config.load import load_config
    from maxent_grpo.data.datasets import load_prompt_dataset
    from maxent_grpo.data.prompts import format_prompt

    setting = PRESETS["smollm2-pair-sum"].replace(dataset_size=6)
    cfg = load_config(write_config(setting, tiny_model_dir, tmp_path / "c.yaml"))
    ours = load_prompt_dataset(cfg.data.source, instruction=cfg.data.instruction)
    rows = task_rows("pair_sum", 6, setting.seed)
    _, tok = load_model_and_tokenizer(tiny_model_dir)
    theirs = [tok.apply_chat_template(r["prompt"], tokenize=False, add_generation_prompt=True) for r in rows]
    assert theirs == [format_prompt(tok, p) for p in ours["prompt"]]
    assert list(ours["rg_entry"]) == [r["rg_entry"] for r in rows]
    assert len(rows[0]["prompt"]) == 3 and "3 + 4" in rows[0]["prompt"][1]["content"]


def test_pair_sum_scores_every_correct_pair_and_only_those():
    from benchmarks.pair_sum import WELL_FORMED_SCORE
    from maxent_grpo.tasks.answers import canonical_answer

    row = next(r for r in task_rows("pair_sum", 20, 0) if json.loads(r["rg_entry"])["metadata"]["target"] >= 8)
    n = json.loads(row["rg_entry"])["metadata"]["target"]
    correct = [f"\\boxed{{{a} + {n - a}}}" for a in range(1, n)]
    wrong = [f"\\boxed{{{n}}}", f"\\boxed{{0 + {n}}}", f"\\boxed{{2 + {n}}}", f"\\boxed{{{n - 3} - 3}}", "no answer"]
    scores = boxed_accuracy([row["prompt"]] * (n - 1 + 5), correct + wrong, rg_entry=[row["rg_entry"]] * (n - 1 + 5))
    assert scores == [1.0] * (n - 1) + [0.0, 0.0, WELL_FORMED_SCORE, 0.0, 0.0]
    assert len({canonical_answer(c) for c in correct}) == n - 1  # n - 1 distinct correct answers


def test_rows_for_step_takes_rows_in_order_and_cycles():
    rows = list(range(5))
    assert rows_for_step(rows, 0, 2) == [0, 1]
    assert rows_for_step(rows, 2, 2) == [4, 0]


def test_boxed_rewards_score_with_the_task_scorer():
    rows = task_rows("chain_sum", 2, 0)
    gold = rows[0]["answer"]
    wrong = str(int(gold) + 1)
    completions = [
        f"So the sum is \\boxed{{{gold}}}.",
        [{"role": "assistant", "content": f"\\boxed{{{wrong}}}"}],  # TRL's conversational form
        f"The answer is {gold}",  # right number, no final-answer form
    ]
    entries = [rows[0]["rg_entry"]] * 3
    prompts = [rows[0]["prompt"]] * 3
    assert boxed_accuracy(prompts, completions, rg_entry=entries) == [1.0, 0.0, 0.0]
    assert boxed_format(prompts, completions) == [1.0, 1.0, 0.0]
    with pytest.raises(ValueError, match="rg_entry"):
        boxed_accuracy(prompts, completions, rg_entry=entries[:2])


# ------------------------------------------------------------------ our config mapping


def test_ours_config_loads_in_our_config_and_keeps_every_shared_value(tmp_path):
    from maxent_grpo.config.load import load_config

    setting = PRESETS["smollm2-64"].replace(beta=0.04, loss_type="grpo", bf16=True, seed=7, learning_rate=3e-6)
    cfg = load_config(write_config(setting, tmp_path / "model", tmp_path / "c.yaml"))
    assert cfg.model.name_or_path == str(tmp_path / "model") and cfg.model.dtype == "bfloat16"
    assert cfg.data.source == "reasoning_gym:chain_sum" and cfg.data.size == setting.dataset_size
    assert cfg.data.shuffle is False and cfg.data.system_prompt is None
    assert [(r.name, r.weight) for r in cfg.rewards] == [(REWARD_NAMES[0], 1.0), (REWARD_NAMES[1], 0.5)]
    g, t, lo = cfg.generation, cfg.training, cfg.loss
    assert (g.num_generations, g.max_new_tokens, g.temperature, g.top_p, g.top_k) == (8, 64, 1.0, 1.0, 0)
    assert (t.prompts_per_step, t.micro_batch_size, t.max_steps, t.seed) == (4, 8, setting.steps, 7)
    assert (t.learning_rate, t.lr_scheduler, t.weight_decay, t.adam_beta2, t.max_grad_norm) == (
        3e-6, "constant", 0.0, 0.999, 1.0
    )
    assert (lo.loss_type, lo.beta, lo.epsilon, lo.epsilon_high, lo.scale_rewards) == ("grpo", 0.04, 0.2, None, "group")
    assert lo.dynamic_sampling is False  # TRL does not resample groups
    assert cfg.method == "grpo"


def test_ours_config_extra_sections_merge_into_the_defaults(tmp_path):
    config = ours_config(PRESETS["tiny"], tmp_path, extra={"loss": {"scale_rewards": "none"}, "maxent": {"tau": 0.3}})
    assert config["loss"]["scale_rewards"] == "none" and config["loss"]["beta"] == 0.0
    assert config["maxent"] == {"tau": 0.3}


def test_trl_keeps_float32_master_weights_on_a_gpu_except_with_a_static_cache(tmp_path):
    """TRL's weights on a GPU: float32 under bf16 autocast, as ours; bfloat16 on the CPU, with LoRA, and
    with cache_implementation static (transformers 5.17 cannot write autocast's keys into a float32 cache)."""
    from benchmarks.trl_runner import grpo_config_kwargs

    gpu = PRESETS["tiny"].replace(device="cuda", bf16=True)
    dtype = {name: grpo_config_kwargs(s, str(tmp_path))["model_init_kwargs"]["dtype"] for name, s in (
        ("gpu", gpu), ("gpu-static", gpu.replace(trl_cache="static")), ("gpu-lora", gpu.replace(lora_r=4)),
        ("cpu", PRESETS["tiny"].replace(bf16=True)))}
    assert dtype == {"gpu": "float32", "gpu-static": "bfloat16", "gpu-lora": "bfloat16", "cpu": "bfloat16"}
    assert grpo_config_kwargs(gpu.replace(trl_cache="static"), str(tmp_path))["cache_implementation"] == "static"


def test_bench_setting_rejects_bad_values_by_name():
    with pytest.raises(ValueError, match="micro_batch_size"):
        BenchSetting(name="x", model="tiny", prompts_per_step=2, num_generations=4, micro_batch_size=3)
    with pytest.raises(ValueError, match="loss_type"):
        BenchSetting(name="x", model="tiny", loss_type="ppo")
    with pytest.raises(ValueError, match="num_generations"):
        BenchSetting(name="x", model="tiny", num_generations=1, micro_batch_size=1)


# ------------------------------------------------------------------ same prompts on every side


def test_prompt_ids_hash_names_the_multiset_of_prompts():
    h = prompt_ids_hash([[1, 2, 3], [4]])
    assert h == prompt_ids_hash([[4], [1, 2, 3]])  # the order of the prompts does not count
    assert h != prompt_ids_hash([[1, 2], [3, 4]]) and h != prompt_ids_hash([[1, 2, 3], [4], [4]])
    assert 0 <= h < 2**52 and float(h) == h  # exact as a float (the trackers)
    # One row per completion, G consecutive rows per prompt: each prompt counted once.
    assert step_prompt_hash([[4], [4], [1, 2, 3], [1, 2, 3]], 2) == h
    with pytest.raises(ValueError, match="different prompts"):
        step_prompt_hash([[4], [5], [1, 2, 3], [1, 2, 3]], 2)


def _run(side: str, hashes: list[int]) -> RunResult:
    return RunResult(side, [1.0] * len(hashes), [None] * len(hashes), [None] * len(hashes), prompt_hashes=hashes)


def test_prompt_mismatch_names_the_rep_step_and_sides():
    same = {"ours": [_run("ours", [1, 2]), _run("ours", [1, 2])], "trl": [_run("trl", [1, 2]), _run("trl", [1, 2])],
            "floor": [_run("floor", [1, 2]), _run("floor", [1, 2])]}
    assert prompt_mismatch(same) is None
    differ = {**same, "trl": [_run("trl", [1, 2]), _run("trl", [1, 3])]}
    assert prompt_mismatch(differ) == (
        "rep 2 step 2: ours and trl trained on different prompt token ids (prompt hash 0000000000002 vs 0000000000003)"
    )
    assert prompt_mismatch({**same, "floor": [_run("floor", [1, 2]), _run("floor", [])]}) == "rep 2: ours ran 2 steps, floor 0"
    assert prompt_mismatch({**same, "floor": [_run("floor", [1, 2]), RunResult("floor", [1.0], [None], [None])]}) == (
        "rep 2: floor recorded 0 prompt hashes for 1 steps"
    )


def test_run_fails_with_one_line_when_the_sides_saw_different_prompts(monkeypatch, capsys, tmp_path):
    import benchmarks.run as run

    runs = {"trl": [_run("trl", [7, 8])], "floor": [_run("floor", [7, 9])]}
    monkeypatch.setattr(run, "compare", lambda *args, **kwargs: runs)
    code = run.main(["--setting", "tiny", "--sides", "trl,floor", "--reps", "1", "--work-dir", str(tmp_path)])
    err = capsys.readouterr()
    assert code == 1 and "| side |" not in err.out
    (line,) = [ln for ln in err.err.splitlines() if "FAILED" in ln]
    assert "rep 1 step 2: trl and floor trained on different prompt token ids" in line


# ------------------------------------------------------------------ measurement


def test_summarize_drops_each_runs_warmup_step_and_pools_the_rest():
    runs = [
        RunResult("trl", [9.0, 1.0, 3.0], [0.1, 0.2, 0.3], [10, 20, 30], [5.0, 0.5, 1.5], [8.0, 1.0, 2.0], 100),
        RunResult("trl", [7.0, 2.0, 4.0], [0.0, 0.0, 0.0], [10, 20, 20], [4.0, 1.0, 1.0], [6.0, 2.0, 4.0], 300),
    ]
    s = summarize("trl", runs)
    assert (s.median_s, s.min_s, s.max_s, s.steps_timed) == (2.5, 1.0, 4.0, 4)
    assert s.tokens_per_s == pytest.approx((20 + 30 + 20 + 20) / (1 + 3 + 2 + 4))
    assert s.generate_share == pytest.approx((0.5 + 1.5 + 1 + 1) / 10)
    assert s.cpu_median_s == pytest.approx(2.0)
    assert s.peak_rss_bytes == 200 and s.warmup_dropped


def test_run_child_reports_each_childs_own_peak_rss(tmp_path):
    env = child_env(threads=None)
    big = run_child([sys.executable, "-c", "b = bytearray(400 * 2**20); b[::4096] = b'x' * len(b[::4096])"],
                    tmp_path / "big.log", env)
    small = run_child([sys.executable, "-c", "pass"], tmp_path / "small.log", env)
    assert big.peak_rss_bytes > 400 * 2**20
    # A cumulative measure (RUSAGE_CHILDREN) would report the big child's peak again.
    assert small.peak_rss_bytes < 100 * 2**20


def test_run_child_raises_with_the_log_tail(tmp_path):
    with pytest.raises(ChildFailed, match="boom"):
        run_child([sys.executable, "-c", "raise SystemExit('boom')"], tmp_path / "x.log", child_env(None))


# ------------------------------------------------------------------ end to end


@pytest.mark.slow
def test_harness_prints_the_table_for_every_side(tmp_path):
    pytest.importorskip("trl")
    out = tmp_path / "bench.json"
    cmd = [
        sys.executable, str(REPO_ROOT / "benchmarks" / "run.py"), "--setting", "tiny", "--steps", "2", "--reps", "1",
        "--max-new-tokens", "8", "--threads", "1", "--work-dir", str(tmp_path / "work"), "--json-out", str(out), "--timeout", "240",
    ]
    env = {**os.environ, "MAXENT_GRPO_BENCH_CACHE": str(tmp_path / "models")}
    proc = subprocess.run(cmd, cwd=REPO_ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-4000:]
    table = proc.stdout
    assert "| side | s/step median |" in table
    expected = ["trl", "floor"] + (["ours"] if ours_available() is None else [])
    for side in expected:
        assert f"\n| {side} |" in table, table
    if ours_available() is not None:
        assert "ours skipped:" in table
    payload = json.loads(out.read_text())
    assert sorted(payload["runs"]) == sorted(expected)
    for side in expected:
        (run,) = payload["runs"][side]
        assert len(run["step_times"]) == 2 and all(t > 0 for t in run["step_times"])
        assert run["peak_rss_bytes"] > 50 * 2**20  # a Python process with torch loaded
        # every completion of a step is generated: P*G sequences of at most max_new_tokens
        assert all(0 < n <= 2 * 4 * 8 for n in run["completion_tokens"] if n is not None)
    # Every side trained on the same prompt token ids at each step (run.py would have failed),
    # and the two steps took different prompts.
    hashes = {side: payload["runs"][side][0]["prompt_hashes"] for side in expected}
    assert all(h == hashes["trl"] for h in hashes.values()) and len(set(hashes["trl"])) == 2, hashes
    summary = payload["summaries"]["trl"]
    assert summary["steps_timed"] == 1 and summary["warmup_dropped"] is True
    assert summary["median_s"] == pytest.approx(payload["runs"]["trl"][0]["step_times"][1])


@pytest.mark.slow
def test_every_side_trains_on_the_pinned_few_shot_prompts(tmp_path):
    """--default-task: the default task's options and solved example on every side. Each side's
    per-step prompt hash is the hash of the rows' templated token ids, step by step."""
    pytest.importorskip("trl")
    from transformers import AutoTokenizer

    from benchmarks.model_paths import resolve_model
    from benchmarks.settings import default_task_fields

    out, steps = tmp_path / "bench.json", 2
    cmd = [
        sys.executable, str(REPO_ROOT / "benchmarks" / "run.py"), "--setting", "tiny", "--default-task",
        "--steps", str(steps), "--reps", "1", "--max-new-tokens", "4", "--threads", "1",
        "--work-dir", str(tmp_path / "work"), "--json-out", str(out), "--timeout", "240",
    ]
    env = {**os.environ, "MAXENT_GRPO_BENCH_CACHE": str(tmp_path / "models")}
    proc = subprocess.run(cmd, cwd=REPO_ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-4000:]
    setting = PRESETS["tiny"].replace(steps=steps, max_new_tokens=4, **default_task_fields("chain_sum"))
    tok = AutoTokenizer.from_pretrained(resolve_model("tiny", tmp_path / "models"))
    rows = setting_rows(setting)
    expected = []
    for step in range(steps):
        texts = [tok.apply_chat_template(r["prompt"], add_generation_prompt=True, tokenize=False)
                 for r in rows_for_step(rows, step, setting.prompts_per_step)]
        expected.append(prompt_ids_hash(tok(texts, add_special_tokens=False)["input_ids"]))
    runs = json.loads(out.read_text())["runs"]
    assert len(rows[0]["prompt"]) == 3 and len(set(expected)) == steps
    assert {side: runs[side][0]["prompt_hashes"] for side in runs} == {side: expected for side in runs}


@pytest.mark.slow
def test_methods_comparison_trains_each_method_and_scores_the_start_model(tmp_path):
    if ours_available() is not None:
        pytest.skip(ours_available())
    out = tmp_path / "methods.json"
    cmd = [
        sys.executable, str(REPO_ROOT / "benchmarks" / "methods.py"), "--setting", "tiny", "--task", "pair_sum",
        "--steps", "2", "--window", "1", "--methods", "grpo,maxent_listwise", "--eval-prompts", "2",
        "--eval-samples", "2", "--threads", "1", "--work-dir", str(tmp_path / "work"), "--json-out", str(out),
    ]
    env = {**os.environ, "MAXENT_GRPO_BENCH_CACHE": str(tmp_path / "models")}
    proc = subprocess.run(cmd, cwd=REPO_ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-4000:]
    assert "| method | seed | reward first 1 |" in proc.stdout
    runs = json.loads(out.read_text())["runs"]
    assert [r["method"] for r in runs] == ["start model", "grpo", "maxent_listwise"]
    for run in runs:
        assert run["eval"]["task"] == "pair_sum" and run["eval"]["prompts"] == 2
    for run in runs[1:]:
        assert len(run["rewards"]) == 2 and len(run["step_times"]) == 2
        assert (tmp_path / "work" / "seed0" / run["method"] / "config.rows.jsonl").is_file()


# ------------------------------------------------------------------ backend_learning.py


def test_backend_learning_reads_first_and_last_fifth_and_parses_settings():
    import argparse

    from benchmarks.backend_learning import _setting, fifths

    rows = [{"reward": float(i)} for i in range(10)] + [{"reward": None}, {}]
    # 10 values: a fifth is 2 of them; rows without the key (None, missing) are not zeros.
    assert fifths(rows, "reward") == (0.5, 8.5)
    assert fifths(rows, "sampling/sampling_logp_difference/mean") is None  # a metric no row has
    assert fifths([{"reward": 3.0}], "reward") == (3.0, 3.0)
    assert _setting("vllm_server:1") == ("vllm_server", 1)
    assert _setting("hf") == ("hf", 0)
    with pytest.raises(argparse.ArgumentTypeError, match="trl"):
        _setting("trl:0")


def test_backend_learning_row_names_the_lowest_step_reward():
    from benchmarks.backend_learning import table_cells

    rows = [{"step": i + 1, "reward": r, "entropy": 0.5, "completions/mean_length": 10.0}
            for i, r in enumerate([0.6, 0.1, 0.9, 0.8, 0.7])]
    cells = table_cells(rows).split(" | ")
    assert cells[0] == "0.6 -> 0.7"  # five steps: a fifth is one step
    assert cells[3] == "-"  # no log-prob gap logged
    assert cells[-1] == "0.1 (2)"


def test_backend_learning_fisher_exact_matches_the_tea_tasting_table():
    from benchmarks.backend_learning import fisher_exact

    # Fisher's lady tasting tea: 8 cups, 4 of each, 3 of her 4 "milk first" right. Margins 4/4/4/4:
    # P(k) = C(4,k) C(4,4-k) / C(8,4) = (1, 16, 36, 16, 1) / 70; two-sided: the tables no likelier than k=3.
    assert fisher_exact(3, 1, 1, 3) == pytest.approx(34 / 70, rel=1e-12)
    assert fisher_exact(4, 0, 0, 4) == pytest.approx(2 / 70, rel=1e-12)
    assert fisher_exact(2, 2, 2, 2) == pytest.approx(1.0)
    # 3 dips of 6 against 0 of 6: P = C(3,k)C(9,6-k)/C(12,6) = (84, 378, 378, 84)/924 for k = 0..3.
    assert fisher_exact(3, 3, 0, 6) == pytest.approx(168 / 924, rel=1e-12)
    assert fisher_exact(0, 6, 0, 6) == 1.0


def test_backend_learning_counts_bare_zero_reward_answers_and_dips(tmp_path):
    from benchmarks.backend_learning import bare_answers, comparison

    run = tmp_path / "run"
    (run / "completions").mkdir(parents=True)
    rows = [{"reward": 0.0, "length": 2}, {"reward": 0.0, "length": 3}, {"reward": 0.0, "length": 4},
            {"reward": 0.5, "length": 2}]
    (run / "completions" / "step-1.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    # step 2 has no file: (0, 0); only zero-reward answers of at most 3 tokens count.
    assert bare_answers(run, 2) == [(2, 4), (0, 0)]
    low = [{"step": 1, "reward": 0.5}, {"step": 2, "reward": 0.1}]
    high = [{"step": 1, "reward": 0.5}, {"step": 2, "reward": 0.9}]
    table = [("hf", 0, 0, high, [(0, 32)]), ("hf", 0, 1, high, [(1, 32)]),
             ("vllm", 0, 0, low, [(3, 32)]), ("vllm", 0, 1, high, [(2, 32)]), ("vllm", 1, 0, low, [(0, 32)])]
    lines = comparison(table, 0.2)
    assert lines[0] == "hf:0: 0/2 runs dip below 0.2; step-1 bare answers 1/64"
    assert lines[1].startswith("vllm:0: 1/2 runs dip below 0.2; step-1 bare answers 5/64 (hf: 0/2, Fisher p 1;")
    assert lines[2] == "vllm:1: 1/1 runs dip below 0.2; step-1 bare answers 0/32"  # no hf run at max_staleness 1


def test_optimizer_table_counts_each_state(tiny_model_dir, capsys):
    """benchmarks/optimizers.py on the tiny model: AdamW's state is 8 bytes a parameter (two float32
    moments), the 8-bit one's about a quarter of that (tensors under 4096 elements stay 32-bit)."""
    from benchmarks.optimizers import main as optimizers_main

    assert optimizers_main(["--model", str(tiny_model_dir), "--rounds", "2"]) == 0
    rows = {line.split("|")[1].strip(): line.split("|")[2:5] for line in capsys.readouterr().out.splitlines()
            if line.startswith("| adamw")}
    assert set(rows) == {"adamw", "adamw_fused", "adamw_8bit"}
    per_param = {name: float(cells[1]) for name, cells in rows.items()}
    assert per_param["adamw"] == per_param["adamw_fused"] == 8.0
    assert 2.0 <= per_param["adamw_8bit"] < 4.0


@pytest.mark.slow
def test_head_gap_measures_both_heads_on_the_tiny_model(tiny_model_dir, tmp_path, capsys):
    """benchmarks/head_gap.py: two bf16 runs (autocast trainer, bf16 sampling copy), the head in bf16 and in
    float32, and one table of their gaps (BENCHMARKS.md §14 on the default model)."""
    from benchmarks import head_gap

    keys = [f"model.name_or_path={tiny_model_dir}", "data.size=16", "data.task_kwargs={}", "generation.num_generations=4",
            "generation.max_new_tokens=6", "training.prompts_per_step=2", "training.micro_batch_size=4",
            "data.few_shot=[]"]
    assert head_gap.main(["--steps", "1", "--out", str(tmp_path), "--", *[a for k in keys for a in ("--set", k)]]) == 0
    out = capsys.readouterr().out
    rows = [line for line in out.splitlines() if line.startswith(("| bf16 | 1 |", "| float32 | 1 |"))]
    assert len(rows) == 2
    config = (tmp_path / "float32" / "config.yaml").read_text()
    assert "lm_head_fp32: true" in config and "dtype: bfloat16" in config
    gaps = [float(r.split("|")[4]) for r in rows]  # rms d: a bf16 copy never samples exactly as the trainer scores
    assert all(g > 0 for g in gaps)
