"""The importance-weighted KL term (ALGORITHMS.md §19 of the spec; DeepSeek-V3.2; TRL 1.16's default
``use_bias_correction_kl``): ``beta * rho * k3`` per token, rho = pi / pi_old carrying gradient, token or
sequence level. Checked in float64 against a token-by-token reference written from the spec (no code shared
with the library): value and gradient, rho = 1 (on-policy) and rho != 1, both levels, every aggregation,
beta 0; and the mutations the spec names fail it (rho detached; the plain term)."""

from __future__ import annotations

import copy
import dataclasses
import importlib.util
from pathlib import Path

import pytest
import torch

_spec = importlib.util.spec_from_file_location("ddp_step_worker", Path(__file__).resolve().parents[1] / "ddp_step_worker.py")
worker = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(worker)

N, L_MAX = len(worker.LENGTHS), worker.COMPLETION_LEN
FOUR = [(0, 2), (2, 4), (4, 6), (6, 8)]
BETA = 0.3


@pytest.fixture(scope="module")
def base_model(tiny_model_dir):
    return worker.load_model(str(tiny_model_dir))


@pytest.fixture(scope="module")
def rows(base_model):
    out = worker.build_rows(base_model)
    out["advantages"] = torch.zeros_like(out["advantages"])  # the policy term is 0 with its gradient: KL alone
    return out


def reference_loss(model, rows, *, loss_type, level, on_policy, weighted=True, detach_rho=False):
    """The step's loss, token by token, from the spec."""
    logp = worker.reference_logps(model, rows)
    old = logp.detach() if on_policy else rows["old_logps"]
    ref = rows["ref_logps"]
    row_sums, lengths = [], []
    for i, t_i in enumerate(worker.LENGTHS):
        if level == "sequence" and t_i:  # a row with no completion tokens adds nothing
            seq_rho = torch.exp(sum(logp[i, t] - old[i, t] for t in range(t_i)) / t_i)
        s = logp.new_zeros(())
        for t in range(t_i):
            d = ref[i, t] - logp[i, t]
            kl = torch.exp(d) - d - 1
            rho = seq_rho if level == "sequence" else torch.exp(logp[i, t] - old[i, t])
            if detach_rho:
                rho = rho.detach()
            s = s + BETA * kl * (rho if weighted else 1.0)
        row_sums.append(s)
        lengths.append(t_i)
    if loss_type == "dapo":
        return sum(row_sums) / sum(lengths)
    if loss_type == "dr_grpo":
        return sum(row_sums) / (N * L_MAX)
    if loss_type == "grpo":
        return sum(s / max(t, 1) for s, t in zip(row_sums, lengths)) / N
    return sum(sum(row_sums[a:b]) / max(sum(lengths[a:b]), 1) for a, b in FOUR) / len(FOUR)  # bnpo


def _ours(model, rows, *, loss_type, level, on_policy, weighted=True, beta=BETA):
    mbs = worker.micro_batches(rows, FOUR)
    if on_policy:
        mbs = [dataclasses.replace(mb, old_logps=None) for mb in mbs]  # the anchor is logp.detach()
    before = [p.detach().clone() for p in model.parameters()]
    result = worker.step(model, torch.optim.SGD(model.parameters(), lr=1.0), mbs, share_prompts=False,
                         loss_type=loss_type, beta=beta, max_completion_length=L_MAX, importance_sampling_level=level,
                         kl_importance_weighted=weighted)
    return result, torch.cat([(b - p.detach()).reshape(-1) for b, p in zip(before, model.parameters())])


@pytest.mark.parametrize("on_policy", [True, False], ids=["rho=1", "rho!=1"])
@pytest.mark.parametrize("level", ["token", "sequence"])
@pytest.mark.parametrize("loss_type", ["dapo", "dr_grpo", "grpo", "bnpo"])
def test_value_and_gradient_match_the_reference(base_model, rows, loss_type, level, on_policy):
    theirs = copy.deepcopy(base_model)
    result, grads = _ours(copy.deepcopy(base_model), rows, loss_type=loss_type, level=level, on_policy=on_policy)
    loss = reference_loss(theirs, rows, loss_type=loss_type, level=level, on_policy=on_policy)
    expected = worker.flat_grads(theirs, loss)
    assert result.loss == pytest.approx(loss.item(), rel=1e-10)
    assert float((grads - expected).abs().max()) < 1e-10 * float(expected.abs().max())
    # The mutations the spec names: rho detached (its gradient dropped), and the plain k3 term.
    for mutant in (dict(detach_rho=True), dict(weighted=False)):
        wrong = worker.flat_grads(copy.deepcopy(base_model), reference_loss(
            copy.deepcopy(base_model), rows, loss_type=loss_type, level=level, on_policy=on_policy, **mutant))
        assert float((grads - wrong).abs().max()) > 1e-3 * float(expected.abs().max()), mutant


def test_on_policy_the_value_is_the_plain_terms_and_the_gradient_is_not(base_model, rows):
    weighted, g_weighted = _ours(copy.deepcopy(base_model), rows, loss_type="dapo", level="token", on_policy=True)
    plain, g_plain = _ours(copy.deepcopy(base_model), rows, loss_type="dapo", level="token", on_policy=True,
                           weighted=False)
    assert weighted.loss == pytest.approx(plain.loss, rel=1e-12)  # rho = 1 in value
    assert weighted.metrics["kl"] == pytest.approx(plain.metrics["kl"], rel=1e-12)  # kl logs the plain k3
    assert float((g_weighted - g_plain).norm()) > 1e-3 * float(g_plain.norm())  # d(rho kl) = d kl + kl d logp


def test_beta_zero_has_no_term(base_model, rows):
    result, grads = _ours(copy.deepcopy(base_model), rows, loss_type="dapo", level="token", on_policy=False, beta=0.0)
    assert result.loss == 0.0 and float(grads.abs().max()) == 0.0
