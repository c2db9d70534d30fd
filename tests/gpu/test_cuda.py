"""The GPU tier: ``pytest -m gpu`` on a machine with a CUDA device (skipped elsewhere; CI has none).

What the CPU suite cannot show: the step on CUDA computes what it computes on the CPU,
bf16 compute over float32 master weights lands a small update, and a whole run trains
on the device. Run it on a GPU machine with ``bash scripts/test.sh -m gpu``.
"""

from __future__ import annotations

import copy

import pytest
import torch

import ddp_step_worker as worker

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device here: the GPU tier runs on a GPU machine"),
]


def _update(model, mbs, **loss):
    before = [p.detach().clone() for p in model.parameters()]
    worker.step(model, torch.optim.SGD(model.parameters(), lr=1.0), mbs, share_prompts=False, **loss)
    return [(b - p.detach()).cpu() for b, p in zip(before, model.parameters())]


def test_the_step_on_cuda_equals_the_step_on_the_cpu(tiny_model_dir):
    """float64 on both devices: the same rows give the same SGD update (minus the gradient)."""
    cpu = worker.load_model(str(tiny_model_dir))
    rows = worker.build_rows(cpu)
    bounds = [(0, 4), (4, 8)]
    g_cpu = _update(copy.deepcopy(cpu), worker.micro_batches(rows, bounds), beta=0.05, loss_type="dapo")
    cuda_rows = {k: v.cuda() for k, v in rows.items()}
    g_cuda = _update(copy.deepcopy(cpu).cuda(), worker.micro_batches(cuda_rows, bounds), beta=0.05, loss_type="dapo")
    scale = max(float(g.abs().max()) for g in g_cpu)
    assert max(float((a - b).abs().max()) for a, b in zip(g_cpu, g_cuda)) <= 1e-9 * scale


def test_a_bf16_run_on_cuda_keeps_float32_master_weights_and_moves_them(tiny_model_dir, tmp_path):
    """model.dtype: bfloat16 on CUDA: autocast over float32 weights; at lr 1e-6 nearly every weight moves."""
    from safetensors.torch import load_file

    from maxent_grpo.cli import main
    from tiny_runs import tiny_overrides

    out = tmp_path / "run"
    args = tiny_overrides(tiny_model_dir, out, rewards="[{name: length, kwargs: {max_length: 100}}]", steps=1,
                          extra=["model.dtype=bfloat16", "training.learning_rate=1e-6", "training.warmup_steps=0",
                                 "loss.beta=0.0", "checkpoint.save_steps=1"])
    assert main(["train", *args]) == 0
    start = load_file(tiny_model_dir / "model.safetensors")
    trained = load_file(out / "checkpoints" / "step-1" / "model.safetensors")
    assert {t.dtype for t in trained.values()} == {torch.float32}
    changed = sum(int((trained[k] != start[k].float()).sum()) for k in start)
    assert changed / sum(t.numel() for t in start.values()) >= 0.9
