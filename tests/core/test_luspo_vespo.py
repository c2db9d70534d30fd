"""TRL 1.16's two newest losses, in float64 against references written from the spec (ALGORITHMS.md §20-§21
of the spec; here §21-§22), with no code shared with the library:

* LUSPO: GSPO's sequence ratio and clip, each sequence's loss summed over its tokens, the mean over the
  step's sequences (``loss_type: luspo``); averaging per token instead must fail.
* VESPO: ``-phi_i A_i logp_t``, ``phi`` the detached gamma weight of the **summed** sequence log-ratio, a
  DAPO mean; the mean in place of the sum must fail.
"""

from __future__ import annotations

import copy
import importlib.util
import math
from pathlib import Path

import pytest
import torch

from maxent_grpo.core.vespo import VespoParams, vespo_weights

_spec = importlib.util.spec_from_file_location("ddp_step_worker", Path(__file__).resolve().parents[1] / "ddp_step_worker.py")
worker = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(worker)

N, L_MAX = len(worker.LENGTHS), worker.COMPLETION_LEN
FOUR = [(0, 2), (2, 4), (4, 6), (6, 8)]
ONE = [(0, N)]


@pytest.fixture(scope="module")
def base_model(tiny_model_dir):
    return worker.load_model(str(tiny_model_dir))


@pytest.fixture(scope="module")
def rows(base_model):
    return worker.build_rows(base_model)


def _ours(model, rows, bounds, **loss):
    before = [p.detach().clone() for p in model.parameters()]
    result = worker.step(model, torch.optim.SGD(model.parameters(), lr=1.0), worker.micro_batches(rows, bounds),
                         share_prompts=False, max_completion_length=L_MAX, **loss)
    return result, torch.cat([(b - p.detach()).reshape(-1) for b, p in zip(before, model.parameters())])


def _close(a, b, rel=1e-10):
    return float((a - b).abs().max()) <= rel * float(b.abs().max())


# ------------------------------------------------------------------ LUSPO

EPS_LOW, EPS_HIGH, BETA = 0.2, 0.28, 0.04


def luspo_reference(model, rows, *, per_token_mean=False):
    """``mean_i T_i * l_i + beta * KL`` summed per sequence, over the step's sequences."""
    logp = worker.reference_logps(model, rows)
    old, ref, adv = rows["old_logps"], rows["ref_logps"], rows["advantages"]
    total, clipped = logp.new_zeros(()), 0
    for i, t_i in enumerate(worker.LENGTHS):
        if not t_i:
            continue
        s = torch.exp(sum(logp[i, t] - old[i, t] for t in range(t_i)) / t_i)
        l_i = -torch.minimum(s * adv[i], s.clamp(1 - EPS_LOW, 1 + EPS_HIGH) * adv[i])
        clipped += int(not (1 - EPS_LOW <= s.item() <= 1 + EPS_HIGH))
        kl = sum(torch.exp(ref[i, t] - logp[i, t]) - (ref[i, t] - logp[i, t]) - 1 for t in range(t_i))
        row = t_i * l_i + BETA * kl
        total = total + (row / t_i if per_token_mean else row)
    return total / N, clipped


@pytest.mark.parametrize("bounds", [ONE, FOUR], ids=["1 micro-batch", "4 micro-batches"])
def test_luspo_matches_the_reference(base_model, rows, bounds):
    theirs = copy.deepcopy(base_model)
    result, grads = _ours(copy.deepcopy(base_model), rows, bounds, loss_type="luspo", beta=BETA,
                          importance_sampling_level="sequence", epsilon=EPS_LOW, epsilon_high=EPS_HIGH)
    loss, clipped = luspo_reference(theirs, rows)
    assert 0 < clipped < sum(t > 0 for t in worker.LENGTHS)  # ratios in and out of the clip range
    expected = worker.flat_grads(theirs, loss)
    assert result.loss == pytest.approx(loss.item(), rel=1e-10)
    assert _close(grads, expected)
    # The mutation: each sequence's loss averaged over its tokens (GSPO's grpo aggregation) is another step.
    wrong_model = copy.deepcopy(base_model)
    wrong = worker.flat_grads(wrong_model, luspo_reference(wrong_model, rows, per_token_mean=True)[0])
    assert not _close(grads, wrong, rel=1e-3)


def test_luspo_is_the_luspo_method_and_trls_loss_type():
    from tiny_runs import compiled

    plan = compiled(overrides=["method=luspo"])
    loss = plan.method.loss
    assert (loss.loss_type, loss.clip.importance_sampling_level, loss.policy_loss) == ("luspo", "sequence",
                                                                                        "clipped_surrogate")
    from maxent_grpo.config.trl import convert

    keys, _ = convert({"model_name_or_path": "m", "dataset_name": "d", "reward_funcs": ["think_format_reward"],
                       "loss_type": "luspo", "importance_sampling_level": "sequence"})
    assert (keys["method"], keys["loss.loss_type"], keys["loss.importance_sampling_level"]) == ("luspo", "luspo",
                                                                                              "sequence")


# ------------------------------------------------------------------ VESPO

P = VespoParams(k_pos=2.0, lambda_pos=3.0, k_neg=3.0, lambda_neg=2.0)


def vespo_reference(model, rows, *, mean_not_sum=False):
    """``sum over the step's tokens of -phi_i A_i logp_t``, over its active tokens."""
    logp = worker.reference_logps(model, rows)
    old, adv = rows["old_logps"], rows["advantages"]
    total, tokens, phis = logp.new_zeros(()), 0, []
    for i, t_i in enumerate(worker.LENGTHS):
        if not t_i:
            phis.append(1.0)  # w = 1 (an empty sum): phi(1) = 1; it counts in the mean over sequences, as TRL's
            continue
        log_ratios = [min(max((logp[i, t] - old[i, t]).item(), -20.0), 20.0) for t in range(t_i)]
        log_w = sum(log_ratios) / (t_i if mean_not_sum else 1)
        log_w = min(max(log_w, math.log(1e-8)), 20.0)
        k, lam = (P.k_pos, P.lambda_pos) if adv[i] >= 0 else (P.k_neg, P.lambda_neg)
        phi = math.exp(lam + k * log_w - lam * math.exp(log_w))
        phis.append(phi)
        for t in range(t_i):
            total = total - phi * adv[i] * logp[i, t]
        tokens += t_i
    return total / tokens, phis


@pytest.mark.parametrize("bounds", [ONE, FOUR], ids=["1 micro-batch", "4 micro-batches"])
def test_vespo_matches_the_reference(base_model, rows, bounds):
    theirs = copy.deepcopy(base_model)
    result, grads = _ours(copy.deepcopy(base_model), rows, bounds, loss_type="dapo", policy_loss="vespo",
                          policy_params=P)
    loss, phis = vespo_reference(theirs, rows)
    assert result.loss == pytest.approx(loss.item(), rel=1e-10)
    assert _close(grads, worker.flat_grads(theirs, loss))
    assert result.metrics["vespo/phi_seq_mean"] == pytest.approx(sum(phis) / N, rel=1e-10)
    assert len({round(p, 6) for p in phis}) == N  # the weights differ: phi is not a constant
    wrong_model = copy.deepcopy(base_model)
    wrong = worker.flat_grads(wrong_model, vespo_reference(wrong_model, rows, mean_not_sum=True)[0])
    assert not _close(grads, wrong, rel=1e-3)


def test_vespo_weight_properties():
    adv = torch.tensor([1.0, -1.0, 0.0, 2.0], dtype=torch.float64)
    mask = torch.ones(4, 3, dtype=torch.float64)
    logp = torch.zeros(4, 3, dtype=torch.float64)
    # On-policy (w = 1): phi = 1 for both signs, so the gradient is REINFORCE's -A per token.
    assert vespo_weights(logp, logp, mask, adv, P).tolist() == [1.0, 1.0, 1.0, 1.0]
    logp_req = logp.clone().requires_grad_(True)
    phi = vespo_weights(logp_req, logp, mask, adv, P)
    (-(phi * adv)[:, None] * logp_req * mask).sum().backward()
    assert logp_req.grad.tolist() == [[-a] * 3 for a in adv.tolist()]
    # The clamps: log w at most 20 (phi underflows to 0), at least log 1e-8; an infinite ratio gives 0.
    old = torch.tensor([[-30.0] * 3, [30.0] * 3, [0.0] * 3, [0.0] * 3], dtype=torch.float64)
    big = torch.zeros(4, 3, dtype=torch.float64)
    big[2, 0], big[3, 0] = float("inf"), -float("inf")
    phi = vespo_weights(big, old, mask, adv, P)
    assert phi[0] == 0.0  # log w = 20 clamped: exp(3 + 40 - 3 e^20) = 0
    expected = math.exp(P.lambda_neg + P.k_neg * math.log(1e-8) - P.lambda_neg * 1e-8)  # log w floored
    assert phi[1].item() == pytest.approx(expected, rel=1e-12)
    assert phi[2] == 0.0 and phi[3] >= 0  # a non-finite ratio: clamped, then any non-finite phi is 0
    # A token-level rollout correction enters log w as a sum of log c_t.
    c = torch.full((4, 3), 0.5, dtype=torch.float64)
    with_c = vespo_weights(logp, logp, mask, adv, P, correction=c)
    log_w = 3 * math.log(0.5)
    assert with_c[0].item() == pytest.approx(math.exp(P.lambda_pos + P.k_pos * log_w - P.lambda_pos * math.exp(log_w)))
    # A sequence-level one (the row's weight on each of its tokens) enters once.
    once = vespo_weights(logp, logp, mask, adv, P, correction=c, correction_level="sequence")
    log_w = math.log(0.5)
    assert once[0].item() == pytest.approx(math.exp(P.lambda_pos + P.k_pos * log_w - P.lambda_pos * math.exp(log_w)))


def test_vespo_is_trls_loss_type_with_its_fields():
    from maxent_grpo.config.trl import convert
    from tiny_runs import compiled

    keys, _ = convert({"model_name_or_path": "m", "dataset_name": "d", "reward_funcs": ["think_format_reward"],
                       "loss_type": "vespo", "vespo_k_pos": 1.5, "vespo_lambda_neg": 4.0})
    assert (keys["method"], keys["loss.loss_type"], keys["vespo.k_pos"], keys["vespo.lambda_neg"]) == (
        "vespo", "dapo", 1.5, 4.0)
    assert "vespo.k_pos" not in convert({"model_name_or_path": "m", "dataset_name": "d", "loss_type": "dapo",
                                         "reward_funcs": ["think_format_reward"], "vespo_k_pos": 1.5})[0]
    plan = compiled(overrides=["method=vespo", "vespo.k_neg=2.5"])
    assert plan.method.loss.policy_loss == "vespo" and plan.method.loss.policy_params == VespoParams(k_neg=2.5)
