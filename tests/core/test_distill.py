"""On-policy distillation's term (core/distill.py) in float64, against references written from the
formula: the per-token value and gradient; its expected gradient over the student's own samples
equals the gradient of the reverse KL KL(pi || pi_T) computed from its definition (and the
broken variants, the other sign or the k3 estimator, do not); and the whole step on a tiny model."""

from __future__ import annotations

import copy
import importlib.util
from pathlib import Path

import pytest
import torch

from maxent_grpo.core.bounds import SpecError
from maxent_grpo.core.distill import DistillTerm, distill_token_loss, teacher_kl

_spec = importlib.util.spec_from_file_location("ddp_step_worker", Path(__file__).resolve().parents[1] / "ddp_step_worker.py")
worker = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(worker)


def test_value_and_gradient_per_token():
    gen = torch.Generator().manual_seed(0)
    logp = (-torch.rand(3, 5, generator=gen, dtype=torch.float64) * 3).requires_grad_(True)
    old = logp.detach() + 0.2 * torch.randn(3, 5, generator=gen, dtype=torch.float64)
    teacher = logp.detach() + torch.randn(3, 5, generator=gen, dtype=torch.float64)
    loss = distill_token_loss(logp, old, teacher, DistillTerm(coef=0.7))
    # l = c * (old - teacher) * exp(logp - old); dl/dlogp = the same (the KL factor is detached).
    expected = 0.7 * (old - teacher) * torch.exp(logp.detach() - old)
    assert torch.allclose(loss.detach(), expected, rtol=0, atol=1e-15)
    (grad,) = torch.autograd.grad(loss.sum(), logp)
    assert torch.allclose(grad, expected, rtol=0, atol=1e-15)
    # k3 per token: exp(d) - d - 1 with d = teacher - old.
    d = teacher - old
    assert torch.allclose(teacher_kl(old, teacher, "k3"), torch.exp(d) - d - 1, rtol=0, atol=1e-14)


def test_teacher_equal_to_student_gives_zero():
    logp = torch.randn(2, 4, dtype=torch.float64).requires_grad_(True)
    loss = distill_token_loss(logp, logp.detach(), logp.detach(), DistillTerm(coef=3.0))
    assert torch.equal(loss.detach(), torch.zeros(2, 4, dtype=torch.float64))
    (grad,) = torch.autograd.grad(loss.sum(), logp)
    assert torch.equal(grad, torch.zeros_like(grad))


def _expected_gradient(z: torch.Tensor, log_q: torch.Tensor, estimator: str, coef: float, sign: float = 1.0):
    """sum_y p(y) * grad_z l(y): the term's gradient in expectation over the student's own token,
    enumerated exactly over the vocabulary."""
    total = torch.zeros_like(z)
    p = torch.softmax(z, -1).detach()
    for y in range(z.shape[0]):
        zz = z.detach().clone().requires_grad_(True)
        logp = torch.log_softmax(zz, -1)[y].view(1, 1)
        loss = sign * distill_token_loss(logp, logp.detach(), log_q[y].view(1, 1), DistillTerm(coef, estimator))
        (g,) = torch.autograd.grad(loss.sum(), zz)
        total += p[y] * g
    return total


def test_expected_gradient_is_the_reverse_kl_gradient():
    gen = torch.Generator().manual_seed(1)
    z = torch.randn(7, generator=gen, dtype=torch.float64)
    log_q = torch.log_softmax(torch.randn(7, generator=gen, dtype=torch.float64) * 2, -1)
    # The reference: KL(p || q) = sum_y p(y) (log p(y) - log q(y)), differentiated by autograd.
    zz = z.clone().requires_grad_(True)
    log_p = torch.log_softmax(zz, -1)
    kl = (log_p.exp() * (log_p - log_q)).sum()
    (want,) = torch.autograd.grad(kl, zz)
    got = _expected_gradient(z, log_q, "k1", coef=0.5)
    assert torch.allclose(got, 0.5 * want, rtol=0, atol=1e-14)
    # Broken on purpose: the other sign (toward the teacher's opposite), or k3 as the per-token value.
    assert not torch.allclose(_expected_gradient(z, log_q, "k1", 0.5, sign=-1.0), 0.5 * want, atol=1e-3)
    assert not torch.allclose(_expected_gradient(z, log_q, "k3", 0.5), 0.5 * want, atol=1e-3)
    # A descent step lowers the KL.
    with torch.no_grad():
        after = torch.log_softmax(z - 0.1 * got, -1)
        assert (after.exp() * (after - log_q)).sum() < kl


def test_bounds():
    for bad in (0.0, -1.0, float("nan"), float("inf")):
        with pytest.raises(SpecError, match="coef"):
            DistillTerm(coef=bad)
    with pytest.raises(SpecError, match="kl_estimator"):
        DistillTerm(kl_estimator="k4")


@pytest.fixture(scope="module")
def base_model(tiny_model_dir):
    return worker.load_model(str(tiny_model_dir))


def test_step_adds_the_term_and_logs_the_kl(base_model):
    """grpo_step with advantages 0 (distillation alone): the loss, its gradient and distill/kl are the
    token-by-token sum c * (old - teacher) * exp(logp - old) over the step's N_tok (dapo), with an
    empty completion (row 6) and micro-batches of unequal token counts."""
    rows = worker.build_rows(base_model)
    gen = torch.Generator().manual_seed(5)
    rows["advantages"] = torch.zeros_like(rows["advantages"])
    teacher = rows["ref_logps"] + 0.5 * torch.randn(rows["ref_logps"].shape, generator=gen, dtype=torch.float64)
    model, ref_model = copy.deepcopy(base_model), copy.deepcopy(base_model)
    before = [p.detach().clone() for p in model.parameters()]
    mbs = worker.micro_batches(rows, [(0, 3), (3, 8)], teacher_logps=teacher)
    result = worker.step(model, torch.optim.SGD(model.parameters(), lr=1.0), mbs, share_prompts=False,
                         loss_type="dapo", distill=DistillTerm(coef=0.3))
    grads = [b - p.detach() for b, p in zip(before, model.parameters())]

    p = worker.PROMPT_LEN
    attn = rows["attention_mask"]
    positions = (attn.cumsum(-1) - 1).clamp(min=0)
    logits = ref_model(input_ids=rows["input_ids"], attention_mask=attn, position_ids=positions, use_cache=False).logits
    logp = torch.log_softmax(logits[:, p - 1 : -1], -1).gather(-1, rows["input_ids"][:, p:, None]).squeeze(-1)
    old = rows["old_logps"]
    loss, kl, n_tok = logp.new_zeros(()), 0.0, sum(worker.LENGTHS)
    for i, t_i in enumerate(worker.LENGTHS):
        for t in range(t_i):
            loss = loss + 0.3 * (old[i, t] - teacher[i, t]) * torch.exp(logp[i, t] - old[i, t])
            kl += float(old[i, t] - teacher[i, t])
    loss = loss / n_tok
    assert result.loss == pytest.approx(loss.item(), rel=1e-10)
    assert result.metrics["distill/kl"] == pytest.approx(kl / n_tok, rel=1e-10)
    want = torch.autograd.grad(loss, list(ref_model.parameters()), allow_unused=True)
    want = [torch.zeros_like(q) if g is None else g for g, q in zip(want, ref_model.parameters())]
    scale = max(float(g.abs().max()) for g in want)
    assert scale > 0
    assert max(float((a - b).abs().max()) for a, b in zip(grads, want)) < 1e-12 * scale
    with pytest.raises(ValueError, match="teacher_logps"):
        worker.step(copy.deepcopy(base_model), torch.optim.SGD(model.parameters(), lr=1.0),
                    worker.micro_batches(rows, [(0, 8)]), share_prompts=False, distill=DistillTerm())
