"""The GPU tier: ``pytest -m gpu`` on a machine with a CUDA device (skipped elsewhere; CI has none).

What the CPU suite cannot show: the step on CUDA computes what it computes on the CPU,
bf16 compute over float32 master weights lands a small update (at the tiny size and at
Qwen2.5-0.5B's, random weights from benchmarks/model_configs), DDP and FSDP2 agree at bf16
accuracy, the fused LM head holds at a 151936-token vocabulary, and a whole run trains on
the device. Run it on a GPU machine with ``bash scripts/test.sh -m gpu``.
"""

from __future__ import annotations

import copy
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import ddp_step_worker as worker

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # benchmarks/ is not part of the package

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


@pytest.fixture(scope="module")
def qwen_05b(tmp_path_factory):
    """Qwen2.5-0.5B's shapes (benchmarks/model_configs) with random weights: nothing downloaded."""
    from benchmarks.model_paths import random_model

    return random_model("qwen2.5-0.5b", tmp_path_factory.mktemp("qwen") / "qwen2.5-0.5b", device="cuda")


@pytest.mark.parametrize("model", ["tiny", "qwen2.5-0.5b"])
def test_a_bf16_run_on_cuda_keeps_float32_master_weights_and_moves_them(model, request, tmp_path):
    """model.dtype: bfloat16 on CUDA: autocast over float32 weights; at lr 1e-6 nearly every weight moves
    (issue 21: bf16 weights under AdamW moved 2% of them), at the tiny size and at 0.5B (V = 151936)."""
    from maxent_grpo.cli import main
    from maxent_grpo.training.checkpoint import read_full_weights
    from tiny_runs import tiny_overrides

    model_dir = request.getfixturevalue("tiny_model_dir" if model == "tiny" else "qwen_05b")
    out = tmp_path / "run"
    # Rewards that differ within a group even when no completion ends early (a random 150k-token
    # model never samples its end of sequence): the length in characters, never clipped.
    args = tiny_overrides(model_dir, out, rewards="[{name: length, kwargs: {max_length: 100000}}]", steps=1,
                          extra=["model.dtype=bfloat16", "training.autocast_bf16=true", "training.learning_rate=1e-6",
                                 "training.warmup_steps=0", "loss.beta=0.0", "checkpoint.save_steps=1"])
    assert main(["train", *args]) == 0
    start = read_full_weights(model_dir)
    trained = read_full_weights(out / "checkpoints" / "step-1")
    assert trained.keys() == start.keys()
    assert {t.dtype for t in trained.values()} == {torch.float32}
    changed = sum(int((trained[k] != start[k].float()).sum()) for k in start) / sum(t.numel() for t in start.values())
    print(f"{model}: {changed:.1%} of the parameters changed in one bf16-compute step at lr 1e-6")
    assert changed >= 0.9, f"{model}: only {changed:.1%} of the parameters changed"


def test_ddp_and_fsdp2_give_the_same_bf16_gradients(tiny_model_dir, tmp_path):
    """DDP (autocast over float32 weights) and FSDP2 (bf16 gathers, float32 reduction, autocast) on the
    same rows: the same update to bf16 accuracy, float32 master weights on both. Two processes with two
    GPUs; with one, FSDP2 over one process (it still gathers in bf16)."""
    out = tmp_path / "rank0.pt"
    procs = min(2, torch.cuda.device_count())
    worker_file = Path(worker.__file__).with_name("bf16_parallel_worker.py")
    proc = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node",
                           str(procs), str(worker_file), str(tiny_model_dir), str(out)],
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    got = torch.load(out)
    ddp, fsdp2 = got["ddp"], got["fsdp2"]
    assert got["world_size"] == procs and got["param_dtypes"] == ["torch.float32"]
    assert ddp.keys() == fsdp2.keys()
    norm = sum(float(g.double().norm()) ** 2 for g in ddp.values()) ** 0.5
    diff = sum(float((ddp[k] - fsdp2[k]).double().norm()) ** 2 for k in ddp) ** 0.5
    assert norm > 1e-3
    # bf16 rounds to 2**-9 relative; on two gloo CPU processes the two updates differ by 0.7% (1.3%
    # for the worst tensor).
    assert diff <= 0.03 * norm
    for k in ddp:
        assert float((ddp[k] - fsdp2[k]).norm()) <= 0.05 * float(ddp[k].norm()), k


def test_the_fused_lm_head_matches_log_softmax_at_the_qwen_vocabulary():
    """V = 151936 (Qwen2.5), 2048 rows: float32 log-probs, entropies and gradients equal float64
    log_softmax's; under bf16 autocast, the float64 answer for the bf16-rounded inputs to bf16 accuracy;
    and the head's extra memory is a fraction of what the full logits take."""
    from maxent_grpo.core.fused_lm_head import lm_head_logps

    n, hidden_size, vocab = 2048, 896, 151936
    g = torch.Generator(device="cuda").manual_seed(0)
    hidden = torch.randn(n, hidden_size, device="cuda", generator=g).requires_grad_()
    weight = (0.05 * torch.randn(vocab, hidden_size, device="cuda", generator=g)).requires_grad_()
    targets = torch.randint(0, vocab, (n,), device="cuda", generator=g)
    coefs = torch.randn(2, n, device="cuda", generator=g, dtype=torch.float64)

    def reference(h, w):
        logsm = torch.log_softmax(h.double() @ w.double().t(), dim=-1)
        return logsm.gather(-1, targets[:, None])[:, 0], -(logsm.exp() * logsm).sum(-1)

    def grads(lp, ent):
        return torch.autograd.grad((coefs[0] * lp + coefs[1] * ent).sum(), [hidden, weight])

    def peak_extra(fn) -> int:
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
        grads(*fn())
        torch.cuda.synchronize()
        return torch.cuda.max_memory_allocated() - base

    lp, ent = lm_head_logps(hidden, weight, None, targets, with_entropy=True)
    ref_lp, ref_ent = reference(hidden, weight)
    torch.testing.assert_close(lp.double(), ref_lp, atol=1e-4, rtol=0)
    torch.testing.assert_close(ent.double(), ref_ent, atol=1e-4, rtol=0)
    for ours, theirs in zip(grads(lp, ent), grads(ref_lp, ref_ent)):
        assert float((ours.double() - theirs).norm()) <= 1e-4 * float(theirs.norm())

    with torch.autocast("cuda", dtype=torch.bfloat16):
        lp16, ent16 = lm_head_logps(hidden, weight, None, targets, with_entropy=True)
    ref_lp16, ref_ent16 = reference(hidden.bfloat16(), weight.bfloat16())
    torch.testing.assert_close(lp16.double(), ref_lp16, atol=0.1, rtol=0)
    torch.testing.assert_close(ent16.double(), ref_ent16, atol=0.1, rtol=0)

    del lp, ent, ref_lp, ref_ent, lp16, ent16, ref_lp16, ref_ent16
    fused = peak_extra(lambda: lm_head_logps(hidden, weight, None, targets, with_entropy=True))

    def plain():
        logsm = torch.log_softmax(hidden @ weight.t(), dim=-1)
        return logsm.gather(-1, targets[:, None])[:, 0], -(logsm.exp() * logsm).sum(-1)

    full = peak_extra(plain)
    logits_bytes = 4 * n * vocab
    print(f"fused head: {fused / 2**30:.2f} GiB extra, plain log_softmax: {full / 2**30:.2f} GiB "
          f"(logits alone {logits_bytes / 2**30:.2f} GiB)")
    # Both hold the weight's gradient (V x H float32); the fused head adds a few chunks of rows.
    assert fused < full / 2
