"""The decoupled off-policy objective of asynchronous rollouts (ALGORITHMS.md §15, its "Float64 tests").

``grpo_step`` with ``old_logps`` (the proximal anchor: the trainer's log-probs at the start of the
step) and ``behaviour_logps`` (the sampler's), on a real tiny model in float64:

1. Identity: with ``behaviour_logps`` bitwise equal to ``old_logps`` the step is the synchronous one,
   bit for bit, for every registered policy loss, every ``loss_type`` and every correction mode
   (``w = trunc(1) = 1`` exactly, and ``x * 1.0 == x`` in IEEE arithmetic).
2. Equivalence: on the first micro-step (``logp == logp_old``) with ``C = inf`` and token weights,
   the decoupled PPO gradient is the bypass REINFORCE-IS gradient ``-A * pi/pi_beh * grad logp``;
   and a batch trained once needs no separate anchor forward (its own detached log-probs are it).
3. A token with ``pi_old / pi_beh = 10`` and ``C = 2`` has weight 2 (truncate) or 0 (mask), and the
   masked token keeps its place in every denominator.
"""

from __future__ import annotations

import copy
import dataclasses
import importlib.util
import math
from pathlib import Path

import pytest
import torch

from maxent_grpo.core.logprobs import Scoring
from maxent_grpo.core.listwise import ListwiseParams
from maxent_grpo.core.losses import LOSS_AGGREGATIONS
from maxent_grpo.core.peer_losses import DppoParams, GmpoParams
from maxent_grpo.core.rollout_correction import ROLLOUT_CORRECTIONS, mismatch_metrics, rollout_correction_weights
from maxent_grpo.core.step import POLICY_LOSSES

_spec = importlib.util.spec_from_file_location("ddp_step_worker", (Path(__file__).resolve().parents[1] / "ddp_step_worker.py"))
worker = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(worker)

N, N_TOK, G, L_MAX = len(worker.LENGTHS), sum(worker.LENGTHS), worker.G, worker.COMPLETION_LEN
TWO = [(0, 4), (4, 8)]  # whole groups: the listwise losses need them
FOUR = [(0, 2), (2, 4), (4, 6), (6, 8)]
LOSS_TYPES = sorted(LOSS_AGGREGATIONS)
CORRECTED = [m for m in ROLLOUT_CORRECTIONS if m != "none"]
# Every registered policy loss with every loss_type it is defined for: a loss added later is covered.
def _params(policy_loss: str):
    """The loss's own settings record at its defaults; the listwise losses with their clipped term on."""
    params = POLICY_LOSSES[policy_loss].params
    if params is ListwiseParams:
        return ListwiseParams(clip_coef=0.5)
    return None if params is None else params()


CASES = [(name, lt) for name, loss in sorted(POLICY_LOSSES.items())
         for lt in LOSS_TYPES if loss.loss_types is None or lt in loss.loss_types]


@pytest.fixture(scope="module")
def base_model(tiny_model_dir):
    return worker.load_model(str(tiny_model_dir))


@pytest.fixture(scope="module")
def rows(base_model):
    """The step's rows; ``old_logps`` 0.4 nats (std) from the current policy, as on a later
    micro-step or a reused batch, so the ratios leave every trust region on some tokens."""
    r = worker.build_rows(base_model)
    gen = torch.Generator().manual_seed(5)
    r["listwise_weights"] = torch.softmax(torch.randn(N // G, G, generator=gen, dtype=torch.float64), -1).reshape(-1)
    return r


@pytest.fixture(scope="module")
def first_rows(base_model, rows):
    """The same rows on the first micro-step: ``old_logps`` recomputed by the trainer without
    gradients (training/loop.py's proximal anchor), and a sampler 0.5 nats (std) away from it."""
    old, _ = Scoring(share_prompts=False).score_rows(base_model, rows["input_ids"], rows["attention_mask"],
                                                     worker.PROMPT_LEN)
    gen = torch.Generator().manual_seed(13)
    beh = old + 0.5 * torch.randn(old.shape, generator=gen, dtype=torch.float64)
    return dict(rows, old_logps=old, behaviour_logps=beh)


def _micro_batches(rows, bounds, **override):
    r = dict(rows, **override)
    mbs = worker.micro_batches(r, bounds)
    # Every group is active for the listwise losses (the others ignore the listwise fields).
    return [dataclasses.replace(mb, listwise_active=torch.ones(mb.input_ids.shape[0] // G, dtype=torch.bool))
            for mb in mbs]


def _step(base_model, mbs, **loss):
    """One grpo_step of a fresh copy with SGD(lr=1): the result and the gradient (= minus the update).
    Prompts are not shared (test_step._step says why)."""
    model = copy.deepcopy(base_model)
    before = [p.detach().clone() for p in model.parameters()]
    result = worker.step(model, torch.optim.SGD(model.parameters(), lr=1.0), mbs, share_prompts=False, **loss)
    return result, [b - p.detach() for b, p in zip(before, model.parameters())]


def _max_abs_diff(a, b):
    return max(float((x - y).abs().max()) for x, y in zip(a, b))


def _scale(grads):
    return max(float(g.abs().max()) for g in grads)


# ------------------------------------------------------------------ 1. identity


@pytest.mark.parametrize(("policy_loss", "loss_type"), CASES)
def test_behaviour_equal_to_old_is_the_synchronous_step_bit_for_bit(base_model, rows, policy_loss, loss_type):
    cfg = dict(policy_loss=policy_loss, policy_params=_params(policy_loss), loss_type=loss_type,
               max_completion_length=L_MAX, beta=0.04, epsilon_high=0.28)
    # Without the behaviour log-probs the step has no correction: the synchronous path.
    sync, g_sync = _step(base_model, _micro_batches({k: v for k, v in rows.items() if k != "behaviour_logps"}, TWO),
                         **cfg)
    assert sync.mismatch is None
    assert _scale(g_sync) > 0
    for mode in ROLLOUT_CORRECTIONS:
        mbs = _micro_batches(rows, TWO, behaviour_logps=rows["old_logps"].clone())
        dec, g_dec = _step(base_model, mbs, rollout_correction=mode, rollout_correction_cap=2.0, **cfg)
        assert dec.loss == sync.loss, mode
        assert all(torch.equal(a, b) for a, b in zip(g_dec, g_sync)), mode
        assert dec.metrics == sync.metrics, mode
        m = mismatch_metrics(dec.mismatch)
        assert m["sampling/sampling_logp_difference/max"] == 0 and m["gen_kl_error"] == 0


def test_identity_holds_on_the_first_micro_step(base_model, first_rows):
    """The anchor the trainer recomputes (``logp == logp_old``), the default loss and the default
    correction (``auto`` -> token_truncate, C = 2), with NeMo-RL's sequence mask on as well
    (``mean_t exp(|d|) = 1`` is below any threshold): still the synchronous step, bit for bit."""
    same = dict(first_rows, behaviour_logps=first_rows["old_logps"].clone())
    sync, g_sync = _step(base_model, _micro_batches({k: v for k, v in same.items() if k != "behaviour_logps"}, FOUR),
                         beta=0.04)
    dec, g_dec = _step(base_model, _micro_batches(same, FOUR), beta=0.04, rollout_correction="token_truncate",
                       seq_logprob_error_threshold=1.0001)
    assert dec.loss == sync.loss
    assert all(torch.equal(a, b) for a, b in zip(g_dec, g_sync))
    assert dec.metrics == sync.metrics


# -------------------------------------------------------------- 2. equivalence


def _reference_logps(model, rows):
    """Completion log-probs of the whole step, from the full-vocabulary log_softmax (no chunking)."""
    p = worker.PROMPT_LEN
    attn = rows["attention_mask"]
    positions = (attn.cumsum(-1) - 1).clamp(min=0)
    logits = model(input_ids=rows["input_ids"], attention_mask=attn, position_ids=positions, use_cache=False).logits
    return torch.log_softmax(logits[:, p - 1 : -1], dim=-1).gather(-1, rows["input_ids"][:, p:, None]).squeeze(-1)


def _reference_aggregate(per_token, loss_type, bounds):
    """``per_token[i][t]`` (lists of scalars over each row's active tokens) aggregated by ``loss_type``
    with the original token counts (§3's table; bnpo per micro-batch of ``bounds``)."""
    sums = [sum(row, torch.zeros((), dtype=torch.float64)) for row in per_token]
    if loss_type == "grpo":
        return sum(s / max(n, 1) for s, n in zip(sums, worker.LENGTHS)) / N
    if loss_type == "dapo":
        return sum(sums) / N_TOK
    if loss_type == "dr_grpo":
        return sum(sums) / (N * L_MAX)
    if loss_type == "luspo":
        return sum(sums) / N
    assert loss_type == "bnpo"
    return sum(sum(sums[a:b]) / max(sum(worker.LENGTHS[a:b]), 1) for a, b in bounds) / len(bounds)


def _reference(model, rows, loss_type, bounds, term):
    """The step loss, token by token: ``term(i, t, logp[i, t])`` on every active token."""
    logp = _reference_logps(model, rows)
    per_token = [[term(i, t, logp[i, t]) for t in range(n)] for i, n in enumerate(worker.LENGTHS)]
    loss = _reference_aggregate(per_token, loss_type, bounds)
    grads = torch.autograd.grad(loss, list(model.parameters()), allow_unused=True)
    return loss, [torch.zeros_like(p) if g is None else g for g, p in zip(grads, model.parameters())]


@pytest.mark.parametrize("loss_type", LOSS_TYPES)
def test_first_micro_step_gradient_is_reinforce_with_the_ratio_to_the_sampler(base_model, first_rows, loss_type):
    beh, adv = first_rows["behaviour_logps"], first_rows["advantages"]
    ratio = torch.exp(first_rows["old_logps"] - beh)
    on = first_rows["completion_mask"] > 0
    assert float(ratio[on].max()) > 2 and float(ratio[on].min()) < 0.5  # far off-policy, beyond any clip
    cfg = dict(loss_type=loss_type, max_completion_length=L_MAX)
    result, grads = _step(base_model, _micro_batches(first_rows, FOUR), rollout_correction="token_truncate",
                          rollout_correction_cap=math.inf, **cfg)
    # -A * pi/pi_beh, whose gradient is -A * exp(logp - logp_beh) * grad logp (prime-rl's rho = pi/mu).
    loss, ref = _reference(copy.deepcopy(base_model), first_rows, loss_type, FOUR,
                           lambda i, t, lp: -adv[i] * torch.exp(lp - beh[i, t]))
    assert _max_abs_diff(grads, ref) < 1e-12 * _scale(ref)
    assert result.loss == pytest.approx(loss.item(), rel=1e-10)
    # The registered bypass loss (DPPO anchored at the sampler, no cap, a trust region that keeps
    # every token: |p - p_beh| <= 1) is the same gradient.
    bypass = DppoParams(anchor="behaviour", delta_low=1.0, delta_high=1.0)
    _, g_bypass = _step(base_model, _micro_batches(first_rows, FOUR), policy_loss="dppo", policy_params=bypass, **cfg)
    assert _max_abs_diff(g_bypass, ref) < 1e-12 * _scale(ref)


@pytest.mark.parametrize(("policy_loss", "loss_type"), CASES)
def test_one_pass_needs_no_recomputed_anchor(base_model, first_rows, policy_loss, loss_type):
    """training/loop.py gives a batch trained once (``num_iterations: 1``), stale or not, no
    ``old_logps``: the weights move only after the last micro-batch, so each micro-batch's own
    detached log-probs are the anchor. The step equals the one with the anchor recomputed by a
    separate no-grad forward, for every policy loss's trust region, with a sampler far away."""
    cfg = dict(policy_loss=policy_loss, policy_params=_params(policy_loss), loss_type=loss_type,
               max_completion_length=L_MAX, beta=0.04, epsilon_high=0.28,
               rollout_correction="token_truncate", rollout_correction_cap=2.0)
    anchored, g_anchored = _step(base_model, _micro_batches(first_rows, TWO), **cfg)
    own_rows = {k: v for k, v in first_rows.items() if k != "old_logps"}
    own, g_own = _step(base_model, _micro_batches(own_rows, TWO), **cfg)
    assert _scale(g_anchored) > 0
    assert _max_abs_diff(g_own, g_anchored) < 1e-12 * _scale(g_anchored)
    assert own.loss == pytest.approx(anchored.loss, rel=1e-12, abs=1e-15)
    for key, value in anchored.metrics.items():
        assert own.metrics[key] == pytest.approx(value, rel=1e-10, abs=1e-12), key


# --------------------------------------------------- 3. a ratio of 10 against C = 2


def test_weight_of_a_ratio_of_ten_is_the_cap_or_zero():
    old = torch.tensor([[-1.0, -2.0, -0.5], [-3.0, -0.25, -1.5]], dtype=torch.float64)
    beh = old.clone()
    beh[0, 1] = old[0, 1] - math.log(10.0)  # pi_old / pi_beh = 10 on one token
    mask = torch.ones_like(old)
    assert math.exp(float(old[0, 1] - beh[0, 1])) == pytest.approx(10.0, rel=1e-15)
    expect = {"token_truncate": 2.0, "token_mask": 0.0}
    for mode, value in expect.items():
        w = rollout_correction_weights(old, beh, mask, mode, 2.0)
        want = torch.ones_like(old)
        want[0, 1] = value
        assert torch.equal(w, want), mode
    # At sequence level the product of the row's ratios is 10: the whole row.
    for mode, value in {"sequence_truncate": 2.0, "sequence_mask": 0.0}.items():
        w = rollout_correction_weights(old, beh, mask, mode, 2.0)
        assert w[0].tolist() == [value] * 3 and w[1].tolist() == [1.0] * 3, mode


def _reference_weight(mode, i, t, hot, ratio, cap=2.0):
    """The §15 weight with one token ``hot`` at ``ratio`` and every other at ratio 1: the token's
    ratio (token level) or its row's product (sequence level), ``min(r, C)`` (truncate) or
    ``r * 1[r <= C]`` (mask: masked importance sampling keeps the ratio)."""
    level, kind = mode.split("_")
    hit = (i, t) == hot if level == "token" else i == hot[0]
    r = ratio if hit else 1.0
    return min(r, cap) if kind == "truncate" else (r if r <= cap else 0.0)


@pytest.mark.parametrize("ratio", [10.0, 1.5])
@pytest.mark.parametrize("loss_type", LOSS_TYPES)
@pytest.mark.parametrize("mode", CORRECTED)
def test_a_ratio_of_ten_is_capped_or_masked_and_keeps_its_denominator(base_model, first_rows, mode, loss_type,
                                                                     ratio):
    """The step against a token-by-token PPO reference whose denominators count every active token:
    a masked token (or row) that left the denominator would change the loss by 1 / N_tok and more.
    On the first micro-step (the anchor just recomputed) no token is clipped, so the weighted token
    moves the gradient. A ratio of 1.5 is below C = 2: every mode weights it by 1.5 (the mask keeps
    the ratio, and at sequence level the row's product on every token of the row)."""
    hot = (2, 1)  # row 2 (5 tokens, A != 0), its second token
    old, adv = first_rows["old_logps"], first_rows["advantages"]
    beh = old.clone()
    beh[hot] = old[hot] - math.log(ratio)
    rows = dict(first_rows, behaviour_logps=beh)
    result, grads = _step(base_model, _micro_batches(rows, FOUR), loss_type=loss_type,
                          max_completion_length=L_MAX, rollout_correction=mode, rollout_correction_cap=2.0)

    def ppo(i, t, lp):
        c = torch.exp(lp - old[i, t])
        return -_reference_weight(mode, i, t, hot, ratio) * torch.minimum(c * adv[i], c.clamp(0.8, 1.2) * adv[i])

    loss, ref = _reference(copy.deepcopy(base_model), rows, loss_type, FOUR, ppo)
    assert _max_abs_diff(grads, ref) < 1e-12 * _scale(ref)
    assert result.loss == pytest.approx(loss.item(), rel=1e-10)
    # The weight changed the step: it differs from the uncorrected one.
    _, plain = _step(base_model, _micro_batches(rows, FOUR), loss_type=loss_type,
                     max_completion_length=L_MAX)
    assert _max_abs_diff(grads, plain) > 1e-6 * _scale(plain)


# ------------------------------------------- GMPO: the correction of a sequence-level loss (§12)


def _mis_or_tis(kind, r, cap):
    return min(r, cap) if kind == "truncate" else (r if r <= cap else 0.0)


@pytest.mark.parametrize("mode", CORRECTED)
def test_gmpo_weights_each_row_by_the_geometric_mean_of_its_token_weights(base_model, first_rows, mode):
    """§12 (verl ``geo_mean``): GMPO's sequence loss ``l_i = -Abar_i rho_i`` is weighted by
    ``W_i = exp(sum_t m log(w_t + 1e-10) / (L_i + 1e-8))`` under a token-level correction and by the
    row's own weight under a sequence-level one; the loss is ``(1/B) sum_i W_i l_i``. Row 0's first
    three tokens have weights (2, 0.5, 4): arithmetic mean 2.167, geometric 1.587; row 1 has a
    ratio of 8 that ``token_mask`` drops (its geometric mean goes to ~0, the arithmetic one to 2/3).
    A float64 reference written from the formula, rows of both signs of A, step split in four."""
    cap = 4.0
    old, adv = first_rows["old_logps"], first_rows["advantages"]
    beh = first_rows["behaviour_logps"].clone()
    beh[0, :3] = old[0, :3] - torch.tensor([2.0, 0.5, 4.0], dtype=torch.float64).log()
    beh[1, 0] = old[1, 0] - math.log(8.0)
    rows = dict(first_rows, behaviour_logps=beh)
    signs = {math.copysign(1.0, float(a)) for a, n in zip(adv, worker.LENGTHS) if n > 0}
    assert signs == {1.0, -1.0}
    result, grads = _step(base_model, _micro_batches(rows, FOUR), policy_loss="gmpo", policy_params=GmpoParams(),
                          loss_type="grpo", rollout_correction=mode, rollout_correction_cap=cap)

    level, kind = mode.split("_")

    def reference(log_weight):
        """The §12 loss ``(1/B) sum_i -Abar_i rho_i W_i`` token by token, ``log_weight`` the guarded log."""
        model = copy.deepcopy(base_model)
        logp = _reference_logps(model, rows)
        loss = torch.zeros((), dtype=torch.float64)
        for i, n in enumerate(worker.LENGTHS):
            if n == 0:
                continue  # rho = 1, Abar = 0: adds 0 and counts in the mean over B
            d = [float(old[i, t] - beh[i, t]) for t in range(n)]
            if level == "token":
                w = [_mis_or_tis(kind, math.exp(x), cap) for x in d]
                weight = math.exp(sum(log_weight(x) for x in w) / (n + 1e-8))
            else:
                weight = _mis_or_tis(kind, math.exp(sum(d)), cap)
            a = float(adv[i])
            s = [logp[i, t] - old[i, t] for t in range(n)]
            s_tilde = [x.clamp(max=0.4) if a > 0 else x.clamp(min=-0.4) for x in s]
            rho = torch.exp(sum(s_tilde) / (n + 1e-8))
            loss = loss - a * n / (n + 1e-8) * rho * weight
        loss = loss / N
        grads = torch.autograd.grad(loss, list(model.parameters()), allow_unused=True)
        return loss.item(), [torch.zeros_like(p) if g is None else g for g, p in zip(grads, model.parameters())]

    # The spec's guard, verl's log(w + 1e-10): a relative 1e-10 / w_t per token from the code's floor
    # log(max(w, 1e-10)) (which keeps w = 1 at W = 1 exactly, §15), some 1e-8 of the gradient after
    # the rows' cancellation; with the floor the reference agrees to rounding.
    spec_loss, spec_ref = reference(lambda x: math.log(x + 1e-10))
    assert result.loss == pytest.approx(spec_loss, rel=1e-9)
    assert _max_abs_diff(grads, spec_ref) < 1e-7 * _scale(spec_ref)
    floor_loss, floor_ref = reference(lambda x: math.log(max(x, 1e-10)))
    assert result.loss == pytest.approx(floor_loss, rel=1e-12)
    assert _max_abs_diff(grads, floor_ref) < 1e-12 * _scale(floor_ref)
