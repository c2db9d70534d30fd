"""training.micro_batch_size: auto. On the CPU a fixed count of whole groups; on CUDA a memory budget
that each step fills with as many whole groups as fit at its own lengths (training/micro_batches.py).

The budget's arithmetic is checked against the numbers written out by hand here (the memory plan's
per-token count, ``6h + 2kv + 4i`` values per layer); the CUDA path that measures free memory runs
in the GPU tier (tests/gpu/test_cuda.py)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from maxent_grpo.config.compile import compile_run
from maxent_grpo.config.load import load_config
from maxent_grpo.errors import ConfigError
from maxent_grpo.training.micro_batches import MARGIN, MicroBatchBudget, auto_rows, size_budget, trained_bytes
from maxent_grpo.training.model_shape import Shape
from maxent_grpo.training.precision import Machine

CPU = Machine(fast_bf16=False, cuda=False)
GPU = Machine(fast_bf16=True, cuda=True)
SHAPE = Shape(hidden=8, intermediate=16, layers=3, heads=2, kv_heads=1, vocab=50, tied=True, qkv_bias=False)


@pytest.mark.parametrize("total, g, rows", [
    (32, 8, 8),    # the default: 4 prompts of 8
    (16, 4, 8),    # two groups of 4
    (32, 16, 16),  # a group larger than 8 is still whole
    (12, 3, 6),    # 4 groups of 3: two per micro-batch (3 would not divide 4)
    (24, 8, 8),
    (10, 2, 2),    # 5 groups of 2: 4 would not divide, and 5 groups exceed 8 rows
    (6, 6, 6),
])
def test_auto_rows_are_whole_groups_that_divide_the_step(total, g, rows):
    assert auto_rows(total, g) == rows
    assert total % rows == 0 and rows % g == 0


def _budget(groups_that_fit: float, *, seq=20, comp=12, g=4) -> MicroBatchBudget:
    token_bytes, logit_bytes = 100, 7
    row = seq * token_bytes + comp * logit_bytes
    return MicroBatchBudget(budget_bytes=int(groups_that_fit * g * row), token_bytes=token_bytes,
                            logit_bytes=logit_bytes, num_generations=g)


@pytest.mark.parametrize("fit, total, rows", [
    (6, 24, 24),      # 6 groups fit, the step has 6: one micro-batch
    (5.99, 24, 12),   # one byte short of 6 groups: the next divisor of 6 groups is 3
    (4, 24, 12),      # 4 groups fit but do not divide 6: 3
    (2, 24, 8),
    (1, 24, 4),
    (0.5, 24, 4),     # not even one group fits: one group, the smallest micro-batch there is
    (100, 8, 8),
])
def test_a_budget_fills_each_micro_batch_with_the_most_whole_groups_that_fit_and_divide(fit, total, rows):
    budget = _budget(fit)
    assert budget.rows(total, 20, 12) == rows


def test_a_longer_step_gets_smaller_micro_batches_under_the_same_budget():
    budget = _budget(4, seq=20, comp=12)  # 4 groups of 4 at 20 positions, 12 of them completion
    assert budget.rows(32, 20, 12) == 16
    assert budget.rows(32, 40, 24) == 8    # twice as long: half the rows
    assert budget.rows(32, 80, 48) == 4
    assert budget.rows(32, 10, 6) == 32    # half as long: 8 groups fit, the whole step


@pytest.mark.parametrize("checkpointing", [False, True])
def test_the_budget_is_free_memory_less_gradients_adamw_and_the_margin(checkpointing):
    h, kv, i, layers = 8, 4, 16, 3  # SHAPE: kv_dim = 1 head x (8 / 2)
    per_layer = 6 * h + 2 * kv + 4 * i
    values = layers * h + per_layer if checkpointing else layers * per_layer
    gib = 2**30
    budget = size_budget(free_bytes=20 * gib, device_bytes=80 * gib, trained=2 * gib, shape=SHAPE, compute_bytes=2,
                         gradient_checkpointing=checkpointing, num_generations=8)
    assert budget.budget_bytes == int(20 * gib - 3 * 2 * gib - MARGIN * 80 * gib)  # 10 GiB
    assert budget.token_bytes == 2 * values
    assert budget.logit_bytes == 4 * 50
    assert budget.row_bytes(30, 10) == 30 * 2 * values + 10 * 200
    with pytest.raises(ValueError, match="no memory left for a micro-batch"):
        size_budget(free_bytes=9 * gib, device_bytes=80 * gib, trained=2 * gib, shape=SHAPE, compute_bytes=2,
                    gradient_checkpointing=checkpointing, num_generations=8)


def test_trained_bytes_count_only_what_trains_in_its_own_dtype():
    model = torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.Linear(3, 2, dtype=torch.float64))
    model[0].bias.requires_grad_(False)
    assert trained_bytes(model) == 12 * 4 + (6 + 2) * 8


def test_the_shape_reads_the_saved_values_of_a_real_config_and_refuses_a_non_decoder():
    cfg = json.loads((Path(__file__).resolve().parents[2] / "benchmarks/model_configs/qwen2.5-0.5b.json").read_text())
    shape = Shape.from_config(cfg)
    h, i, layers = cfg["hidden_size"], cfg["intermediate_size"], cfg["num_hidden_layers"]
    kv = cfg["num_key_value_heads"] * h // cfg["num_attention_heads"]
    assert shape.saved_values_per_token(False) == layers * (6 * h + 2 * kv + 4 * i)
    with pytest.raises(ValueError, match="has no hidden_size, intermediate_size"):
        Shape.from_config({"model_type": "t5", "d_model": 512, "num_layers": 6, "num_heads": 8, "vocab_size": 32128})


def test_a_model_folder_auto_cannot_size_is_refused_in_one_line_naming_the_setting(tiny_model_dir, tmp_path):
    shape = Shape.from_pretrained(str(tiny_model_dir), "training.micro_batch_size: auto")
    cfg = json.loads((Path(tiny_model_dir) / "config.json").read_text())
    assert (shape.hidden, shape.layers, shape.vocab) == (cfg["hidden_size"], cfg["num_hidden_layers"], cfg["vocab_size"])
    t5 = tmp_path / "t5"
    t5.mkdir()
    (t5 / "config.json").write_text(json.dumps({"model_type": "t5", "d_model": 64, "num_layers": 2, "num_heads": 2,
                                                "vocab_size": 100}))
    with pytest.raises(ConfigError, match=r"^training\.micro_batch_size: auto cannot size .*t5: model_type 't5' "
                                          r"has no hidden_size, intermediate_size.*; set a number$"):
        Shape.from_pretrained(str(t5), "training.micro_batch_size: auto")


def test_auto_compiles_to_whole_groups_on_the_cpu_and_to_a_budget_on_cuda():
    cfg = load_config(None, ["training.micro_batch_size=auto", "generation.num_generations=4",
                             "training.prompts_per_step=6"])
    assert cfg.training.micro_batch_size == "auto"
    cpu = compile_run(cfg, CPU)
    assert (cpu.micro_batch_size, cpu.micro_batch_from_memory, cpu.scoring.rows_per_pass) == (8, False, 8)
    assert any(n.startswith("training.micro_batch_size auto: 8 (the CPU") for n in cpu.notes)
    gpu = compile_run(cfg, GPU)
    assert (gpu.micro_batch_size, gpu.micro_batch_from_memory) == (8, True)
    assert any("sized at each step from the device memory left" in n for n in gpu.notes)
    assert "whole groups sized from memory" in gpu.global_batch(1)
    fixed = compile_run(load_config(None, ["training.micro_batch_size=6", "generation.num_generations=6",
                                           "training.prompts_per_step=2"]), GPU)
    assert (fixed.micro_batch_size, fixed.micro_batch_from_memory) == (6, False)
    assert not any("micro_batch_size" in n for n in fixed.notes)


@pytest.mark.parametrize("value, problem", [
    ("0", "training.micro_batch_size: must be >= 1 or auto"),
    ("autp", "training.micro_batch_size: expected an integer, got 'autp'"),
    ("2.5", "training.micro_batch_size: expected an integer, got 2.5"),
])
def test_a_bad_micro_batch_size_is_one_line_naming_the_key(value, problem):
    with pytest.raises(ConfigError, match=problem.replace(".", r"\.").replace("(", r"\(")):
        load_config(None, [f"training.micro_batch_size={value}"])


def test_a_cpu_run_with_auto_trains_on_the_rows_it_noted(tiny_model_dir, tmp_path, caplog):
    from maxent_grpo.cli import main
    from tiny_runs import read_jsonl, tiny_overrides

    out = tmp_path / "run"
    args = tiny_overrides(tiny_model_dir, out, rewards="[accuracy]", steps=1, prompts_per_step=2,
                          extra=["training.micro_batch_size=auto"])
    with caplog.at_level("INFO"):
        assert main(["train", *args]) == 0
    assert "training.micro_batch_size auto: 8 (the CPU" in caplog.text
    assert "micro-batches of 8" in caplog.text
    assert [r["micro_batch/rows"] for r in read_jsonl(out / "metrics.jsonl")] == [8.0]
