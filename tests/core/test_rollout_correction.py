"""Sampler/trainer mismatch metrics and the rollout correction against float64 references written token by token."""

from __future__ import annotations

import copy
import importlib.util
import math
from pathlib import Path

import pytest
import torch

from maxent_grpo.core.rollout_correction import (
    combine_mismatch_sums,
    mismatch_metrics,
    rollout_correction_weights,
    rollout_mismatch_sums,
    seq_error_weights,
    seq_mult_prob_error,
)

_spec = importlib.util.spec_from_file_location("ddp_step_worker", (Path(__file__).resolve().parents[1] / "ddp_step_worker.py"))
worker = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(worker)

G = 4
N = len(worker.LENGTHS)
MODES = ["token_truncate", "token_mask", "sequence_truncate", "sequence_mask"]


def _toy(seed=0, b=5, t=6):
    gen = torch.Generator().manual_seed(seed)
    old = -torch.rand(b, t, generator=gen, dtype=torch.float64) * 3
    behaviour = old + 0.5 * torch.randn(b, t, generator=gen, dtype=torch.float64)
    lengths = [6, 3, 0, 1, 5][:b]
    mask = torch.zeros(b, t, dtype=torch.float64)
    for i, n in enumerate(lengths):
        mask[i, :n] = 1
    return old, behaviour, mask, lengths


def _reference_weight(old, behaviour, lengths, mode, cap, i, t):
    level, kind = mode.split("_")
    if level == "token":
        log_r = old[i, t].item() - behaviour[i, t].item()
    else:
        log_r = sum(old[i, s].item() - behaviour[i, s].item() for s in range(lengths[i]))
    r = math.exp(log_r)
    if kind == "truncate":
        return min(r, cap)
    return r if r <= cap else 0.0  # masked IS: the ratio where kept (TRL's masked_fill of the ratio)


@pytest.mark.parametrize("mode", MODES)
def test_weights_match_reference(mode):
    old, behaviour, mask, lengths = _toy(seed=1)  # sequence ratios 3.75, 2.68, 0.97, 0.55: both sides of 2
    cap = 2.0
    w = rollout_correction_weights(old, behaviour, mask, mode, cap)
    for i, n in enumerate(lengths):
        for t in range(old.shape[1]):
            expected = _reference_weight(old, behaviour, lengths, mode, cap, i, t) if t < n else 1.0
            assert w[i, t].item() == pytest.approx(expected, rel=1e-12), (i, t)
    # the data exercises both sides of the cap
    assert (w[mask > 0] == (cap if mode.endswith("truncate") else 0.0)).any()
    assert ((w[mask > 0] < cap) & (w[mask > 0] > 0)).any()


def test_mask_keeps_the_ratio_below_the_cap_closed_form():
    """Masked importance sampling (§9, §15): ``w = rho * 1[rho <= C]``, the ratio where it is kept
    (TRL's ``masked_fill(ratio > C, 0)`` of the ratio), not 1. ``sequence_mask`` keeps the row's
    ratio, the product of its token ratios, on every token (the sequence-level weight §12 and §15
    name), not each token's own ratio. Dyadic ratios; C = 2, then C = inf (no truncation: the
    plain ratio, not "no correction")."""
    ratios = [[1.5, 0.5, 2.5, 1.0], [0.75, 4.0, 1.0, 0.5], [1.5, 1.25, 1.25, 1.0], [10.0, 1.0, 1.0, 1.0]]
    lengths = [3, 4, 3, 3]
    old = torch.tensor([[-0.5, -1.25, -2.0, -0.75], [-1.0, -0.25, -3.0, -1.5], [-2.5, -0.125, -1.0, -0.5],
                        [-1.0, -2.0, -0.5, -1.0]], dtype=torch.float64)
    beh = old - torch.tensor(ratios, dtype=torch.float64).log()
    mask = torch.tensor([[1.0] * n + [0.0] * (4 - n) for n in lengths], dtype=torch.float64)

    def reference(mode, cap):
        level, _ = mode.split("_")
        out = []
        for i, n in enumerate(lengths):
            row_ratio = math.prod(ratios[i][:n])  # 1.875, 1.5, 2.34375, 10: both sides of C = 2
            row = []
            for t in range(4):
                r = ratios[i][t] if level == "token" else row_ratio
                row.append((r if r <= cap else 0.0) if t < n else 1.0)
            out.append(row)
        return out

    want = {
        ("token_mask", 2.0): [[1.5, 0.5, 0.0, 1.0], [0.75, 0.0, 1.0, 0.5], [1.5, 1.25, 1.25, 1.0], [0.0, 1.0, 1.0, 1.0]],
        ("sequence_mask", 2.0): [[1.875] * 3 + [1.0], [1.5] * 4, [0.0] * 3 + [1.0], [0.0] * 3 + [1.0]],
        ("token_mask", math.inf): [row[:n] + [1.0] * (4 - n) for row, n in zip(ratios, lengths)],
        ("sequence_mask", math.inf): [[1.875] * 3 + [1.0], [1.5] * 4, [2.34375] * 3 + [1.0], [10.0] * 3 + [1.0]],
    }
    for (mode, cap), hand in want.items():
        assert reference(mode, cap) == hand, (mode, cap)  # the reference is the spec's closed form
        w = rollout_correction_weights(old, beh, mask, mode, cap)
        for i, (got, row) in enumerate(zip(w.tolist(), hand)):
            assert got == pytest.approx(row, rel=1e-12), (mode, cap, i)


def test_no_correction_and_equal_policies_are_neutral():
    old, behaviour, mask, _ = _toy()
    assert torch.equal(rollout_correction_weights(old, behaviour, mask, "none", 3.0), torch.ones_like(old))
    for mode in MODES:
        assert torch.equal(rollout_correction_weights(old, old, mask, mode, 3.0), torch.ones_like(old))
    m = mismatch_metrics(rollout_mismatch_sums(old, old, mask))
    assert m["sampling/sampling_logp_difference/max"] == 0
    assert m["token_mult_prob_error"] == 1 and m["gen_kl_error"] == 0
    assert m["sampling/importance_sampling_ratio/min"] == m["sampling/importance_sampling_ratio/max"] == 1


def test_long_sequence_ratio_does_not_overflow():
    old = torch.zeros(1, 2000, dtype=torch.float64)
    behaviour = old - 1.0  # log-ratio 2000: exp overflows
    mask = torch.ones_like(old)
    assert torch.all(rollout_correction_weights(old, behaviour, mask, "sequence_truncate", 3.0) == 3.0)
    assert torch.all(rollout_correction_weights(old, behaviour, mask, "sequence_mask", 3.0) == 0.0)


def test_bad_arguments():
    old, behaviour, mask, _ = _toy()
    with pytest.raises(ValueError, match="rollout_correction"):
        rollout_correction_weights(old, behaviour, mask, "token", 3.0)
    with pytest.raises(ValueError, match="cap"):
        rollout_correction_weights(old, behaviour, mask, "token_mask", 0.5)
    with pytest.raises(ValueError, match="must match"):
        rollout_correction_weights(old, behaviour[:, :2], mask, "token_mask", 3.0)


@pytest.mark.parametrize("level", ["token", "sequence"])
def test_mismatch_metrics_match_reference_and_combine(level):
    old, behaviour, mask, lengths = _toy()
    diffs = [[old[i, t].item() - behaviour[i, t].item() for t in range(n)] for i, n in enumerate(lengths)]
    flat = [d for row in diffs for d in row]
    # NeMo-RL's per-sequence error: the token mean of exp(|d|), not exp of the mean |d|.
    seq_err = [sum(math.exp(abs(d)) for d in row) / len(row) for row in diffs if row]
    ratios = [math.exp(d) for d in flat] if level == "token" else [math.exp(sum(row)) for row in diffs if row]
    # Split the batch in two and combine: the same as the whole batch.
    cap = sorted(ratios)[len(ratios) // 2]  # some ratios above it, some not
    parts = [rollout_mismatch_sums(old[a:b], behaviour[a:b], mask[a:b], level=level, cap=cap) for a, b in ((0, 2), (2, 5))]
    for sums in (rollout_mismatch_sums(old, behaviour, mask, level=level, cap=cap), combine_mismatch_sums(parts)):
        m = mismatch_metrics(sums)
        assert m["sampling/sampling_logp_difference/mean"] == pytest.approx(sum(map(abs, flat)) / len(flat), rel=1e-12)
        assert m["sampling/sampling_logp_difference/max"] == pytest.approx(max(map(abs, flat)), rel=1e-12)
        assert m["token_mult_prob_error"] == pytest.approx(sum(math.exp(abs(d)) for d in flat) / len(flat), rel=1e-12)
        assert m["gen_kl_error"] == pytest.approx(sum(math.exp(d) - d - 1 for d in flat) / len(flat), rel=1e-12)
        assert m["seq_mult_prob_error/mean"] == pytest.approx(sum(seq_err) / len(seq_err), rel=1e-12)
        assert m["seq_mult_prob_error/max"] == pytest.approx(max(seq_err), rel=1e-12)
        assert m["sampling/importance_sampling_ratio/min"] == pytest.approx(min(ratios), rel=1e-12)
        assert m["sampling/importance_sampling_ratio/mean"] == pytest.approx(sum(ratios) / len(ratios), rel=1e-12)
        assert m["sampling/importance_sampling_ratio/max"] == pytest.approx(max(ratios), rel=1e-12)
        above = sum(r > cap for r in ratios) / len(ratios)
        assert 0 < above < 1 and m["sampling/importance_sampling_ratio/above_cap_frac"] == pytest.approx(above, rel=1e-12)


# ------------------------------------------------------------ the corrected step


@pytest.fixture(scope="module")
def base_model(tiny_model_dir):
    return worker.load_model(str(tiny_model_dir))


@pytest.fixture(scope="module")
def rows(base_model):
    r = worker.build_rows(base_model)
    gen = torch.Generator().manual_seed(11)
    # A sampler a little off the trainer's old policy (as a bf16 engine would be).
    r["behaviour_logps"] = r["old_logps"] + 0.3 * torch.randn(r["old_logps"].shape, generator=gen, dtype=torch.float64)
    return r


def _reference_loss(model, rows, mode, cap, eps=0.2, beta=0.04):
    """DAPO loss of the whole step, token by token, with the correction weight on the policy term only."""
    p = worker.PROMPT_LEN
    attn = rows["attention_mask"]
    positions = (attn.cumsum(-1) - 1).clamp(min=0)
    logits = model(input_ids=rows["input_ids"], attention_mask=attn, position_ids=positions, use_cache=False).logits
    logp = torch.log_softmax(logits[:, p - 1 : -1], dim=-1).gather(-1, rows["input_ids"][:, p:, None]).squeeze(-1)
    old, ref, adv, beh = rows["old_logps"], rows["ref_logps"], rows["advantages"], rows["behaviour_logps"]
    total = logp.new_zeros(())
    for i, n in enumerate(worker.LENGTHS):
        for t in range(n):
            c = torch.exp(logp[i, t] - old[i, t])
            surrogate = -torch.minimum(c * adv[i], c.clamp(1 - eps, 1 + eps) * adv[i])
            w = _reference_weight(old, beh, worker.LENGTHS, mode, cap, i, t) if mode != "none" else 1.0
            d = ref[i, t] - logp[i, t]
            total = total + w * surrogate + beta * (torch.exp(d) - d - 1)
    return total / sum(worker.LENGTHS)


def _step(model, mbs, cfg):
    before = [p.detach().clone() for p in model.parameters()]
    result = worker.step(model, torch.optim.SGD(model.parameters(), lr=1.0), mbs,
                         **{"loss_type": "dapo", "beta": 0.04, "share_prompts": False, **cfg})
    return result, [b - p.detach() for b, p in zip(before, model.parameters())]


@pytest.mark.parametrize("mode", ["none", *MODES])
def test_corrected_gradient_matches_float64_reference(base_model, rows, mode):
    cap = 1.3  # low enough that the data hits it at both levels
    cfg = dict(rollout_correction=mode, rollout_correction_cap=cap)
    ref_model = copy.deepcopy(base_model)
    result, grads = _step(copy.deepcopy(base_model), worker.micro_batches(rows, [(0, 2), (2, 4), (4, 6), (6, 8)]), cfg)
    loss = _reference_loss(ref_model, rows, mode, cap)
    ref_grads = torch.autograd.grad(loss, list(ref_model.parameters()), allow_unused=True)
    ref_grads = [torch.zeros_like(p) if g is None else g for g, p in zip(ref_grads, ref_model.parameters())]
    scale = max(float(g.abs().max()) for g in ref_grads)
    assert max(float((a - b).abs().max()) for a, b in zip(grads, ref_grads)) < 1e-12 * scale
    assert result.loss == pytest.approx(loss.item(), rel=1e-10)
    # the mismatch is measured whatever the mode
    m = mismatch_metrics(result.mismatch)
    assert m["sampling/sampling_logp_difference/max"] > 0.1


def test_correction_changes_the_gradient(base_model, rows):
    mbs = worker.micro_batches(rows, [(0, N)])
    _, g_none = _step(copy.deepcopy(base_model), mbs, dict())
    _, g_tok = _step(copy.deepcopy(base_model), mbs, dict(rollout_correction="token_mask", rollout_correction_cap=1.3))
    assert max(float((a - b).abs().max()) for a, b in zip(g_none, g_tok)) > 1e-4 * max(float(g.abs().max()) for g in g_none)


def test_correction_without_behaviour_logps_is_an_error(base_model, rows):
    plain = {k: v for k, v in rows.items() if k != "behaviour_logps"}
    with pytest.raises(ValueError, match="behaviour_logps is required"):
        _step(copy.deepcopy(base_model), worker.micro_batches(plain, [(0, N)]), dict(rollout_correction="token_truncate"))


# ------------------------------------------------------- seq_logprob_error_threshold (NeMo-RL)


def test_seq_error_matches_reference_and_masks_above_the_threshold():
    old, behaviour, mask, lengths = _toy(seed=2)
    errors = seq_mult_prob_error(old, behaviour, mask)
    for i, n in enumerate(lengths):
        expected = sum(math.exp(abs(old[i, t].item() - behaviour[i, t].item())) for t in range(n)) / n if n else 1.0
        assert errors[i].item() == pytest.approx(expected, rel=1e-12)
    # The boundary: a sequence exactly at the threshold is kept.
    threshold = float(sorted(errors.tolist())[-2])
    w = seq_error_weights(old, behaviour, mask, threshold)
    keep = [e <= threshold for e in errors.tolist()]
    assert w.tolist() == [[1.0 if k else 0.0] * old.shape[1] for k in keep]
    assert keep.count(False) == 1
    sums = rollout_mismatch_sums(old, behaviour, mask, seq_error_threshold=threshold)
    assert mismatch_metrics(sums)["seq_mult_prob_error/masked"] == 1.0
    with pytest.raises(ValueError, match="seq_logprob_error_threshold"):
        seq_error_weights(old, behaviour, mask, 1.0)


def test_a_masked_sequence_trains_like_one_with_no_advantage(base_model, rows):
    """Left out of the policy term, its tokens still count in the dapo normaliser (ALGORITHMS.md §15):
    the gradient equals the step in which that sequence's advantage is 0."""
    mbs = lambda r: worker.micro_batches(r, [(0, 4), (4, 8)])  # noqa: E731
    _, g_plain = _step(copy.deepcopy(base_model), mbs(rows), dict(beta=0.0))
    scale = max(float(g.abs().max()) for g in g_plain)

    def without_advantage(j):
        zeroed = dict(rows, advantages=rows["advantages"].clone())
        zeroed["advantages"][j] = 0.0
        return _step(copy.deepcopy(base_model), mbs(zeroed), dict(beta=0.0))[1]

    # A sequence whose policy term moves the weights (some are clipped away entirely) ...
    j, g_zero = next((j, g) for j in range(N) if worker.LENGTHS[j] > 0
                     for g in [without_advantage(j)]
                     if max(float((a - b).abs().max()) for a, b in zip(g, g_plain)) > 1e-6 * scale)
    # ... made the one sequence far from its sampler.
    errors = seq_mult_prob_error(rows["old_logps"], rows["behaviour_logps"], rows["completion_mask"])
    off = dict(rows, behaviour_logps=rows["behaviour_logps"].clone())
    off["behaviour_logps"][j] = rows["old_logps"][j] - 3.0
    threshold = float(errors.max()) + 1.0  # above every other sequence's error, below exp(3)
    result, g_masked = _step(copy.deepcopy(base_model), mbs(off), dict(seq_logprob_error_threshold=threshold, beta=0.0))
    assert max(float((a - b).abs().max()) for a, b in zip(g_masked, g_zero)) < 1e-12 * scale
    assert mismatch_metrics(result.mismatch)["seq_mult_prob_error/masked"] == 1.0
