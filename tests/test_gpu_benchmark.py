"""benchmarks/gpu.py without a GPU: its memory plan, its refusal, the random models it trains, and
both sides' phase metering run on the CPU (the GPU check measures them on CUDA)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

REPO_ROOT = Path(__file__).resolve().parents[1]
# benchmarks/ is a top-level folder of the repo, not part of the installed package.
sys.path.insert(0, str(REPO_ROOT))

from benchmarks.ours import ours_available  # noqa: E402
from benchmarks.results import prompt_mismatch  # noqa: E402
from benchmarks.settings import PRESETS  # noqa: E402


def test_gpu_benchmark_plan_prints_each_setting_and_its_memory_plan_without_a_gpu():
    from benchmarks.memory_plan import Shape
    from benchmarks.model_paths import MODEL_CONFIGS, random_model_names

    proc = subprocess.run([sys.executable, str(REPO_ROOT / "benchmarks" / "gpu.py"), "--plan"], cwd=REPO_ROOT,
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = proc.stdout
    assert out.startswith("benchmarks/gpu.py would run ours, trl, trl-static on one GPU of 80 GiB")
    names = random_model_names()
    assert names == ["qwen2.5-0.5b", "qwen2.5-1.5b", "qwen2.5-7b"]
    sections = out.split("\n## ")[1:]
    # 7B's full fine-tuning (~16 B/param) does not fit one GPU: it runs with LoRA (--lora-r, 16).
    assert [s.split(":")[0] for s in sections] == ["gpu-qwen2.5-0.5b", "gpu-qwen2.5-1.5b", "gpu-qwen2.5-7b-lora16"]
    for name, section in zip(names, sections):
        shape = Shape.from_config(json.loads((MODEL_CONFIGS / f"{name}.json").read_text()))
        assert f"({shape.params() / 1e9:.2f}B parameters, V={shape.vocab})" in section
        assert "P=8 G=8 max_new_tokens=256 micro=8, bf16 compute over float32 master weights" in section
        assert section.rstrip().endswith("runs")
    for section in sections[:2]:  # the float32 master weights of full fine-tuning
        shape = Shape.from_config(json.loads((MODEL_CONFIGS / f"{section.split(':')[0][4:]}.json").read_text()))
        assert f"| policy weights | {4 * shape.params() / 2**30:.2f} |" in section and "full fine-tuning" in section
    shape = Shape.from_config(json.loads((MODEL_CONFIGS / "qwen2.5-7b.json").read_text()))
    assert f"| policy weights | {2 * shape.params() / 2**30:.2f} |" in sections[2]  # a frozen bf16 base
    assert "LoRA r=16 on q_proj" in sections[2] and "| LoRA adapters (float32) |" in sections[2]
    skipped = subprocess.run([sys.executable, str(REPO_ROOT / "benchmarks" / "gpu.py"), "--plan", "--models",
                              "qwen2.5-7b", "--lora-r", "0"], cwd=REPO_ROOT, capture_output=True, text=True, timeout=300)
    assert skipped.stdout.rstrip().endswith("SKIPPED: our memory plan does not fit one GPU")


@pytest.mark.skipif(__import__("torch").cuda.is_available(), reason="the refusal is for a machine without CUDA")
def test_gpu_benchmark_without_cuda_exits_with_one_line():
    proc = subprocess.run([sys.executable, str(REPO_ROOT / "benchmarks" / "gpu.py"), "--models", "qwen2.5-0.5b"],
                          cwd=REPO_ROOT, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 2 and proc.stdout == ""
    assert len(proc.stderr.strip().splitlines()) == 1
    assert proc.stderr.startswith("benchmarks/gpu.py: no CUDA device here")


@pytest.mark.slow
def test_a_random_model_has_the_kept_shapes_and_a_tokenizer_for_every_id(tmp_path):
    """What benchmarks/gpu.py and the GPU tier train: Qwen2.5-0.5B's shapes, random weights, and
    every one of its 151936 ids decodable (a random model samples any of them)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from benchmarks.memory_plan import Shape
    from benchmarks.model_paths import MODEL_CONFIGS, random_model

    path = random_model("qwen2.5-0.5b", tmp_path / "model")
    model = AutoModelForCausalLM.from_pretrained(path)
    tok = AutoTokenizer.from_pretrained(path)
    shape = Shape.from_config(json.loads((MODEL_CONFIGS / "qwen2.5-0.5b.json").read_text()))
    assert sum(p.numel() for p in model.parameters()) == shape.params()
    assert len(tok) == model.config.vocab_size == shape.vocab
    assert model.lm_head.weight is model.model.embed_tokens.weight
    assert model.config.eos_token_id == model.generation_config.eos_token_id == tok.eos_token_id
    last = tok.decode([shape.vocab - 1])
    assert last.startswith("<|r") and tok.convert_tokens_to_ids(last) == shape.vocab - 1
    assert float(model.model.layers[0].mlp.up_proj.weight.std()) == pytest.approx(0.02, rel=0.05)


@pytest.mark.slow
@pytest.mark.parametrize("lora_r", [0, 4])
def test_gpu_side_meters_three_phases_per_step_on_both_sides_with_the_same_prompts(tmp_path, monkeypatch, lora_r):
    """benchmarks/gpu_side.py's wiring, run on the CPU: each side's phase functions are found and
    metered once per optimizer step, TRL's nested phases are told apart, both train on the same
    prompts, and gpu.py's table reads the result. CUDA's memory counters are absent here: a
    stand-in gives each phase a peak of its own, which must reach that phase's column."""
    import types

    from benchmarks.gpu import table
    from benchmarks.gpu_side import PHASES, PhaseMeter, run_ours, run_trl
    from benchmarks.model_paths import resolve_model

    from trl import GRPOTrainer

    from maxent_grpo.training import loop, pipeline, rollout_queue

    if ours_available() is not None:
        pytest.skip(ours_available())
    # The meter replaces these for good (a side runs alone in its process): put them back after the test.
    for owner, name in ((rollout_queue, "produce_rollouts"), (pipeline, "produce_rollouts"),
                        (pipeline, "score_batch"), (loop, "_update_and_log"),
                        (GRPOTrainer, "_generate"), (GRPOTrainer, "_generate_and_score_completions")):
        monkeypatch.setattr(owner, name, getattr(owner, name))
    # gpu.py's digest reward: every group has signal, so both sides take real steps.
    # lora_r: how gpu.py trains 7B on one GPU, LoRA on both sides.
    setting = PRESETS["tiny"].replace(steps=3, max_new_tokens=8, digest_reward=True, lora_r=lora_r)
    model = resolve_model("tiny", tmp_path / "models")
    runs = {}
    for side, runner in (("ours", run_ours), ("trl", run_trl)):
        peaks = {"generate": 3 * 2**30, "score": 2**30, "update": 2 * 2**30}
        counters = types.SimpleNamespace(synchronize=lambda: None, reset_peak_memory_stats=lambda: None)
        meter = PhaseMeter(counters)
        # The innermost running phase's own peak.
        counters.max_memory_allocated = lambda: peaks[meter._stack[-1]]
        (tmp_path / side).mkdir()
        result = runner(setting, model, tmp_path / side, meter)
        assert len(meter.steps) == setting.steps
        for step in meter.steps:
            assert step["generate"]["seconds"] > 0 and step["update"]["seconds"] > 0
            assert {p: step[p]["peak_bytes"] for p in PHASES} == peaks
        result.extra = {"phases": meter.steps, "gpu": "a stand-in"}
        runs[side] = result
    assert prompt_mismatch({side: [r] for side, r in runs.items()}) is None
    lines = table(setting, runs, 1e6, 989.0).splitlines()
    rows = [line for line in lines if line.startswith("| ours") or line.startswith("| trl")]
    assert [line.split(" | ")[0] for line in rows] == ["| ours", "| trl"]
    assert all(line.endswith("| 3.0 | 1.0 | 2.0 |") for line in rows)
    assert lines[-1].startswith("ours/TRL tokens/s: ")
    static = table(setting, {**runs, "trl-static": runs["trl"]}, 1e6, 989.0).splitlines()
    assert static[-2].endswith("x against trl-static") and static[-1].startswith("* trl-static trains bfloat16")
    # No final checkpoint on our side: the benchmark times steps, TRL's side writes none either.
    assert not (tmp_path / "ours" / "out" / "checkpoints").exists() or not any((tmp_path / "ours" / "out" / "checkpoints").iterdir())

