"""Verified mode replay (ALGORITHMS.md §17): the loss, its scale and layout, and the bank,
against the spec's closed forms and a float64 reference written here."""

from __future__ import annotations

import json
import math
import random

import pytest
import torch

from maxent_grpo.core.mode_bank import ModeBank, prompt_key
from maxent_grpo.core.replay import mode_scores, replay_layout, replay_scale, verified_likelihood_loss


def _loss_and_grad(scores, sizes, weights=None):
    s = torch.tensor(scores, dtype=torch.float64, requires_grad=True)
    w = None if weights is None else torch.tensor(weights, dtype=torch.float64)
    out = verified_likelihood_loss(s, sizes, w)
    out.loss.backward()
    return out, s.grad


def test_the_documented_example_and_a_singleton():
    out, grad = _loss_and_grad([-1.0, -3.0, -2.0], [2, 1])
    assert out.loss.dtype == torch.float64
    assert float(out.loss.detach()) == 2.0
    assert grad.tolist() == [-0.25, -0.25, -0.5]
    out, grad = _loss_and_grad([-0.7], [1])
    assert float(out.loss.detach()) == 0.7 and grad.tolist() == [-1.0]


def test_gradients_sum_to_minus_one_and_weights_follow_the_general_form():
    rng = random.Random(0)
    for _ in range(20):
        sizes = [rng.randint(1, 5) for _ in range(rng.randint(1, 4))]
        _, grad = _loss_and_grad([rng.uniform(-5, 0) for _ in range(sum(sizes))], sizes)
        assert float(grad.sum()) == pytest.approx(-1.0, abs=1e-14)
        # -1 / (n_R M_g) on every mode of group g
        expected = [-1.0 / (len(sizes) * m) for m in sizes for _ in range(m)]
        assert grad.tolist() == pytest.approx(expected, abs=1e-15)
    out, _ = _loss_and_grad([-1.0, -2.0], [2], [0.5, 1.5])
    assert float(out.loss.detach()) == pytest.approx((0.5 * 1 + 1.5 * 2) / 2, abs=1e-15)


def test_diagnostics_over_groups_with_two_modes_or_more():
    out, _ = _loss_and_grad([-1.0, -2.0, -4.0, -0.5], [3, 1])
    p = torch.softmax(torch.tensor([-1.0, -2.0, -4.0], dtype=torch.float64), 0)
    assert out.normalized_entropy == pytest.approx(float(-(p * p.log()).sum()) / math.log(3), abs=1e-14)
    assert out.ce_excess == pytest.approx(float(-p.log().mean()) - math.log(3), abs=1e-14)
    assert (out.groups, out.modes) == (2, 4)
    singles, _ = _loss_and_grad([-1.0, -2.0], [1, 1])
    assert (singles.normalized_entropy, singles.ce_excess) == (1.0, 0.0)


def test_the_scale():
    assert replay_scale(0.1, 16) == 0.005859375
    assert replay_scale(0.2, 4) == pytest.approx(0.2 * 3 / 16, abs=1e-17)
    with pytest.raises(ValueError):
        replay_scale(0.0, 16)
    with pytest.raises(ValueError):
        replay_scale(0.1, 1)


@pytest.mark.parametrize("scores,sizes,weights", [
    ([-1.0], [], None),                 # no groups
    ([-1.0], [0, 1], None),             # a group of size 0
    ([-1.0, -2.0], [1], None),          # sizes that do not add up
    ([-1.0, float("nan")], [2], None),  # non-finite score
    ([-1.0, -2.0], [2], [1.0, 0.0]),    # weight <= 0
])
def test_bad_inputs_raise(scores, sizes, weights):
    with pytest.raises(ValueError):
        verified_likelihood_loss(torch.tensor(scores, dtype=torch.float64), sizes,
                                 None if weights is None else torch.tensor(weights, dtype=torch.float64))


def test_an_exemplar_without_a_response_token_raises():
    with pytest.raises(ValueError):
        replay_layout([((1, 2), [(3,), ()])], pad_token_id=0)
    with pytest.raises(ValueError):
        mode_scores(torch.zeros(1, 3, dtype=torch.float64), torch.zeros(1, 3, dtype=torch.bool))


def test_layout_token_gradient_and_padding():
    """Through a float64 toy model's token log-probs: d/d logp = -alpha (G-1) / (G^2 n_R M_g T)
    on exemplar tokens, 0 on padding; a group's rows repeat one left-padded prompt row; the
    padding leaves a score unchanged."""
    groups = [((5, 6, 7), [(1, 2), (3, 4, 2, 9)]), ((8,), [(4,)])]
    layout = replay_layout(groups, pad_token_id=0)
    assert layout.prompt_length == 3
    assert layout.input_ids.tolist() == [[5, 6, 7, 1, 2, 0, 0], [5, 6, 7, 3, 4, 2, 9], [0, 0, 8, 4, 0, 0, 0]]
    assert layout.attention_mask.tolist() == [[1, 1, 1, 1, 1, 0, 0], [1, 1, 1, 1, 1, 1, 1], [0, 0, 1, 1, 0, 0, 0]]
    assert layout.response_mask.int().tolist() == [[1, 1, 0, 0], [1, 1, 1, 1], [1, 0, 0, 0]]
    assert layout.group_sizes == (2, 1)

    def exemplar_logps(layout):
        """log p(token t | token t-1) for every completion position (a bigram toy model)."""
        p = layout.prompt_length
        logits = table[layout.input_ids[:, p - 1 : -1]]
        return torch.log_softmax(logits, -1).gather(-1, layout.input_ids[:, p:, None])[..., 0]

    torch.manual_seed(0)
    table = torch.randn(10, 10, dtype=torch.float64)  # logits of the next token given this one
    token_logps = exemplar_logps(layout).detach().requires_grad_(True)
    alpha, G = 0.1, 8
    loss = replay_scale(alpha, G) * verified_likelihood_loss(mode_scores(token_logps, layout.response_mask),
                                                             layout.group_sizes).loss
    loss.backward()
    n_r = 2
    expected = torch.zeros_like(token_logps)
    for row, (m_g, t) in enumerate([(2, 2), (2, 4), (1, 1)]):
        expected[row][layout.response_mask[row]] = -alpha * (G - 1) / (G**2 * n_r * m_g * t)
    assert torch.allclose(token_logps.grad, expected, rtol=1e-14, atol=0)

    alone = replay_layout([groups[1]], pad_token_id=0)
    assert alone.input_ids.tolist() == [[8, 4]] and alone.prompt_length == 1
    padded = mode_scores(token_logps.detach(), layout.response_mask)[2]
    lone = mode_scores(exemplar_logps(alone), alone.response_mask)[0]
    assert float(padded) == pytest.approx(float(lone), rel=1e-15)


def test_finite_differences_through_the_scores():
    sizes = [3, 2]
    base = torch.tensor([-1.0, -0.2, -3.0, -0.5, -2.5], dtype=torch.float64, requires_grad=True)
    verified_likelihood_loss(base, sizes).loss.backward()
    eps = 1e-6
    for i in range(base.numel()):
        up, down = base.detach().clone(), base.detach().clone()
        up[i] += eps
        down[i] -= eps
        fd = (float(verified_likelihood_loss(up, sizes).loss) - float(verified_likelihood_loss(down, sizes).loss)) / (2 * eps)
        assert fd == pytest.approx(float(base.grad[i]), abs=1e-6)


# ---- the bank ------------------------------------------------------------------------------

P = (11, 12, 13)


def test_the_exemplar_is_the_lexicographically_smallest_not_the_shortest():
    bank = ModeBank(capacity=4)
    bank.admit_group(P, ["a", "a"], [1.0, 1.0], [True, True], [(5, 9), (5, 8, 1)])
    [group] = bank.schedule()
    assert group.exemplars == ((5, 8, 1),)


def test_admission_excludes_disagreements_and_inactive_rows():
    bank = ModeBank(capacity=4)
    stats = bank.admit_group(P, [None, "b", "c", "d"], [1.0, 0.0, 1.0, 1.0], [True, True, False, True],
                             [(1,), (2,), (3,), (4,)])
    assert (stats.admitted_rows, stats.disagreements, stats.new_modes) == (1, 2, 1)
    [group] = bank.schedule()
    assert group.keys == ("d",)


def test_capacity_visits_new_keys_in_order_and_never_replaces():
    bank = ModeBank(capacity=2)
    bank.admit_group(P, ["b", "a", "c"], [1.0] * 3, [True] * 3, [(2,), (1,), (3,)])
    [group] = bank.schedule()
    assert group.keys == ("a", "b") and group.exemplars == ((1,), (2,))
    assert bank.stats()["bank/modes"] == 3 and bank.stats()["bank/capacity_dropped"] == 1
    # a smaller exemplar of a banked key later, and the unstored key c seen again: nothing changes
    bank.admit_group(P, ["a", "c"], [1.0, 1.0], [True, True], [(0,), (0,)])
    [group] = bank.schedule()
    assert group.exemplars == ((1,), (2,))
    assert bank.state_dict()["prompts"][prompt_key(P)]["ledger"] == {"a": 2, "b": 1, "c": 2}


def test_the_schedule_follows_the_cursor_as_the_sorted_list_grows():
    bank = ModeBank(capacity=1, groups_per_step=1)
    prompts = [(i,) for i in range(1, 6)]
    keys = sorted(prompt_key(p) for p in prompts)
    by_key = {prompt_key(p): p for p in prompts}
    cursor, banked = 0, []
    for step, p in enumerate(prompts):
        bank.admit_group(p, ["m"], [1.0], [True], [(1,)])
        banked = sorted(banked + [prompt_key(p)])
        start = cursor % len(banked)
        [group] = bank.schedule()
        assert group.prompt_ids == by_key[banked[start]]
        cursor = (start + 1) % len(banked)
    assert bank.cursor == cursor and keys == banked


def test_more_groups_than_banked_prompts_replays_each_once():
    bank = ModeBank(capacity=2, groups_per_step=3)
    bank.admit_group((1,), ["x"], [1.0], [True], [(1,)])
    bank.admit_group((2,), ["y"], [1.0], [True], [(1,)])
    assert len(bank.schedule()) == 2 and bank.schedule()[0].prompt_ids in ((1,), (2,))


def test_state_round_trip_gives_the_same_schedules_and_refuses_other_settings():
    rng = random.Random(3)
    bank = ModeBank(capacity=3, groups_per_step=2)
    for _ in range(10):
        p = (rng.randint(0, 5), 7)
        n = 4
        bank.admit_group(p, [rng.choice(["a", "b", "c", "d", "e", None]) for _ in range(n)],
                         [rng.choice([0.0, 1.0]) for _ in range(n)], [True] * n,
                         [tuple(rng.randint(0, 9) for _ in range(rng.randint(1, 3))) for _ in range(n)])
    bank.schedule()
    restored = ModeBank(capacity=3, groups_per_step=2)
    restored.load_state_dict(json.loads(json.dumps(bank.state_dict())))
    assert restored.state_dict() == bank.state_dict()
    assert [bank.schedule() for _ in range(5)] == [restored.schedule() for _ in range(5)]
    with pytest.raises(ValueError, match="capacity"):
        ModeBank(capacity=4, groups_per_step=2).load_state_dict(bank.state_dict())
    tampered = json.loads(json.dumps(bank.state_dict()))
    pkey = next(iter(tampered["prompts"]))
    tampered["prompts"][pkey]["prompt_ids"] = [99]
    with pytest.raises(ValueError, match="hash"):
        ModeBank(capacity=3, groups_per_step=2).load_state_dict(tampered)


def test_prompt_key_is_the_sha256_of_the_compact_json_list():
    import hashlib

    assert prompt_key([1, 2, 3]) == hashlib.sha256(b"[1,2,3]").hexdigest()
    with pytest.raises(ValueError):
        prompt_key([])
    with pytest.raises(ValueError):
        prompt_key([1, -2])
