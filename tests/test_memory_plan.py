"""benchmarks/memory_plan.py: the parameter count it plans from is transformers' own, and the
plan moves the way the settings say (FSDP2 shards, checkpointing keeps less, an engine adds its share)."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import torch

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))  # benchmarks/ is not part of the package

from benchmarks.memory_plan import Shape, main, plan  # noqa: E402
from maxent_grpo.config.load import load_config  # noqa: E402

CONFIGS = sorted((REPO / "benchmarks" / "model_configs").glob("*.json"))


@pytest.mark.parametrize("path", CONFIGS, ids=[p.stem for p in CONFIGS])
def test_the_parameter_count_is_transformers_own(path):
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.for_model(**json.loads(path.read_text()))
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    assert Shape.from_config(json.loads(path.read_text())).params() == sum(p.numel() for p in model.parameters())


def _rows(sets, gpus=1):
    shape = Shape.from_config(json.loads((REPO / "benchmarks/model_configs/qwen2.5-1.5b.json").read_text()))
    return dict((what, gib) for what, gib, _ in plan(load_config(None, sets), shape, gpus, 80.0, 256))


def test_fsdp2_shards_the_trained_state_and_checkpointing_keeps_less():
    ddp, fsdp2 = _rows([], 8), _rows(["training.strategy=fsdp2"], 8)
    for what in ("policy weights", "gradients (float32)", "AdamW state (float32)"):
        assert fsdp2[what] == pytest.approx(ddp[what] / 8)
    assert "FSDP2 gathered layers" in fsdp2 and "FSDP2 gathered layers" not in ddp
    # 1.54B float32 master weights: 5.7 GiB whole, AdamW twice that.
    assert ddp["policy weights"] == pytest.approx(1.54e9 * 4 / 2**30, rel=0.01)
    assert ddp["AdamW state (float32)"] == pytest.approx(2 * ddp["policy weights"])
    plain = _rows(["training.share_prompts=false"])
    checkpointed = _rows(["training.share_prompts=false", "training.gradient_checkpointing=true"])
    assert checkpointed["activations (one micro-batch)"] < plain["activations (one micro-batch)"] / 5


def test_a_reference_an_engine_and_lora_appear_when_the_config_asks():
    assert "reference model" not in _rows(["loss.beta=0.0"])
    assert "reference model" in _rows(["loss.beta=0.04"])
    engine = _rows(["generation.backend=vllm", "generation.vllm.gpu_memory_utilization=0.3"])
    assert engine["vLLM engine (generation)"] == pytest.approx(24.0)
    lora = _rows(["model.lora.enabled=true", "model.dtype=bfloat16", "generation.dtype=null"])
    assert lora["gradients (float32)"] < _rows([])["gradients (float32)"] / 50


def test_the_command_prints_the_plan(capsys):
    recipe = REPO / "recipes" / "qwen2.5-1.5b-gsm8k-fsdp2.yaml"
    assert main(["--config", str(recipe), "--model-config", str(CONFIGS[1]), "--gpus", "8"]) == 0
    out = capsys.readouterr().out
    assert out.startswith("memory plan per GPU: strategy fsdp2, 8 GPU(s)") and "training phase:" in out


GPU_RECIPES = sorted(p for p in (REPO / "recipes").glob("*.yaml") if p.stem.endswith(("-1gpu", "-fsdp2")))


@pytest.mark.parametrize("recipe", GPU_RECIPES, ids=[p.stem for p in GPU_RECIPES])
def test_a_gpu_recipe_quotes_its_current_memory_plan(recipe, capsys):
    """The plan in a GPU recipe's header is what memory_plan.py prints for it today (the command
    is quoted above the plan), and it fits; the recipe trains float32 weights with bf16 compute and
    activation checkpointing."""
    header = [line[2:] for line in recipe.read_text().splitlines() if line.startswith("# ")]
    start = next(i for i, line in enumerate(header) if "python benchmarks/memory_plan.py" in line)
    command = (header[start].split("python benchmarks/memory_plan.py", 1)[1] + " " + header[start + 1]).rstrip("):")
    assert main(command.split()) == 0
    plan_lines = [line for line in capsys.readouterr().out.splitlines()[2:] if line]
    assert all(line in header for line in plan_lines), "the header's plan is out of date: paste the new one"
    assert "(fits, " in plan_lines[-1]
    cfg = load_config(recipe)
    t = cfg.training
    assert cfg.model.dtype == "bfloat16" and t.autocast_bf16 in (True, "auto")
    assert t.gradient_checkpointing and not t.share_prompts
    assert cfg.generation.backend == "vllm" and cfg.generation.vllm.enable_sleep_mode
    assert (t.prompts_per_step * cfg.generation.num_generations) % t.micro_batch_size == 0


def test_hf_generation_holds_its_kv_cache_and_one_steps_logits_never_beside_the_update():
    """HF generation's rows: the KV cache of every row and three [rows, V] float32 logits (one step,
    not all of them: 64 x 256 steps x 151936 would be 9.3 GiB); the peak counts the larger of the
    generation's and the update's transients on top of what is always held."""
    from benchmarks.memory_plan import peak_gib

    sets = ["training.prompts_per_step=8", "generation.num_generations=8", "generation.max_new_tokens=256"]
    cfg = load_config(None, sets)
    shape = Shape.from_config(json.loads((REPO / "benchmarks/model_configs/qwen2.5-1.5b.json").read_text()))
    rows = plan(cfg, shape, 1, 80.0, 256)
    gib = {what: g for what, g, _ in rows}
    assert gib["HF generation: one step's logits (float32)"] == pytest.approx(3 * 4 * 64 * 151936 / 2**30)
    # 28 layers, 2 KV heads of 128: kv_dim 256; bf16 sampling copy (auto on a GPU).
    assert gib["HF generation: KV cache"] == pytest.approx(2 * 64 * 512 * 28 * 2 * 256 / 2**30)
    update = gib["activations (one micro-batch)"] + gib["LM head logits (float32)"]
    generation = gib["HF generation: KV cache"] + gib["HF generation: one step's logits (float32)"]
    held = sum(gib.values()) - update - generation
    assert peak_gib(rows, cfg)[0] == pytest.approx(held + max(update, generation))
    assert "HF generation: KV cache" not in _rows(["generation.backend=vllm"])


def test_a_teacher_is_counted_from_its_own_shape_and_sharded_like_the_reference():
    sets = ["teacher.name_or_path=Qwen/Qwen2.5-7B-Instruct", "teacher.dtype=bfloat16"]
    seven = Shape.from_config(json.loads((REPO / "benchmarks/model_configs/qwen2.5-7b.json").read_text()))
    student = Shape.from_config(json.loads((REPO / "benchmarks/model_configs/qwen2.5-1.5b.json").read_text()))
    rows = dict((w, g) for w, g, _ in plan(load_config(None, sets), student, 1, 80.0, 256, seven))
    assert rows["teacher model"] == pytest.approx(seven.params() * 2 / 2**30)
    sharded = dict((w, g) for w, g, _ in plan(load_config(None, [*sets, "training.strategy=fsdp2"]), student, 8,
                                              80.0, 256, seven))
    assert sharded["teacher model"] == pytest.approx(rows["teacher model"] / 8)
    assert "teacher model" not in _rows([])
    with pytest.raises(ValueError, match="teacher"):
        plan(load_config(None, sets), student, 1, 80.0, 256)
