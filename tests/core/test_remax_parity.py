"""Verified mode replay against remax-rl 0.1.1's own functions (its reference implementation,
installed by scripts/setup.sh without its torch pin): the bank (exemplars, ledger, schedule,
cursor, after a JSON state round trip), the teacher-forcing layout and the loss."""

from __future__ import annotations

import json
import random

import pytest
import torch

from maxent_grpo.core.mode_bank import ModeBank
from maxent_grpo.core.replay import replay_layout, verified_likelihood_loss

MISSING = "remax-rl is not installed (the GPU machine's image; scripts/setup.sh installs it for tests)"
OnlineCanonicalBank = pytest.importorskip("remax.core.bank", reason=MISSING).OnlineCanonicalBank
canonical_replay_uniform_verified_likelihood_loss = pytest.importorskip(
    "remax.core.objectives", reason=MISSING).canonical_replay_uniform_verified_likelihood_loss
materialize_canonical_replay_batch = pytest.importorskip("remax.core.scoring", reason=MISSING).materialize_canonical_replay_batch


@pytest.mark.parametrize("trial", range(12))
def test_bank_schedule_and_layout_match_remax_on_random_streams(trial):
    rng = random.Random(trial)
    capacity, group_size, per_step = rng.randint(1, 4), rng.choice([2, 4, 8]), rng.randint(1, 3)
    theirs = OnlineCanonicalBank(entropy_alpha=0.0, retain_exemplars=True, replay_capacity=capacity,
                                 global_replay_groups_per_step=per_step)
    ours = ModeBank(capacity, per_step)
    prompts = [[rng.randint(0, 50) for _ in range(rng.randint(1, 4))] for _ in range(6)]
    for step in range(12):
        ids, keys, rewards, active, responses = [], [], [], [], []
        for _ in range(rng.randint(1, 3)):
            prompt = rng.choice(prompts)
            for _ in range(group_size):
                ids.append(prompt)
                keys.append(rng.choice([None, "", "a", "b", "c", "d", "e", "f"]))
                rewards.append(rng.choice([0.0, 1.0, 0.5]))
                active.append(rng.random() > 0.1)
                responses.append([rng.randint(0, 9) for _ in range(rng.randint(1, 4))])
        theirs.score_and_update(prompt_token_ids=ids, outcome_keys=keys, task_rewards=rewards, active_mask=active,
                                num_samples=group_size, response_token_ids=responses)
        for s in range(0, len(keys), group_size):
            e = s + group_size
            ours.admit_group(ids[s], keys[s:e], rewards[s:e], active[s:e], responses[s:e])
        if step == 6:
            saved = json.loads(json.dumps(ours.state_dict()))
            ours = ModeBank(capacity, per_step)
            ours.load_state_dict(saved)
        their_groups, our_groups = theirs.scheduled_global_replay_groups(), ours.schedule()
        assert [(tuple(g.prompt_token_ids), g.outcome_keys, tuple(map(tuple, g.response_token_ids)))
                for g in their_groups] == [(g.prompt_ids, g.keys, g.exemplars) for g in our_groups]
        assert theirs._counts == {k: v["ledger"] for k, v in ours.state_dict()["prompts"].items()}
        if our_groups:
            a = materialize_canonical_replay_batch(their_groups, pad_token_id=0, device="cpu")
            b = replay_layout([(g.prompt_ids, g.exemplars) for g in our_groups], 0)
            # The same rows: remax right-pads whole rows, ours left-pads the prompts (one prompt row per group).
            for i in range(a.input_ids.shape[0]):
                assert a.input_ids[i][a.attention_mask[i] == 1].tolist() == b.input_ids[i][b.attention_mask[i] == 1].tolist()
                assert (a.input_ids[i, 1:][a.response_masks[i]].tolist()
                        == b.input_ids[i, b.prompt_length:][b.response_mask[i]].tolist())
            assert a.group_sizes == b.group_sizes


def test_loss_gradient_and_diagnostics_match_remax():
    rng = random.Random(0)
    for trial in range(100):
        sizes = [rng.randint(1, 4) for _ in range(rng.randint(1, 4))]
        scores = torch.tensor([rng.uniform(-6, 0) for _ in range(sum(sizes))], dtype=torch.float64, requires_grad=True)
        weights = torch.rand(sum(sizes), dtype=torch.float64) + 0.1 if trial % 2 else None
        theirs = canonical_replay_uniform_verified_likelihood_loss(scores, sizes, weights)
        (their_grad,) = torch.autograd.grad(theirs.loss, scores)
        ours = verified_likelihood_loss(scores, sizes, weights)
        (our_grad,) = torch.autograd.grad(ours.loss, scores)
        # remax reduces in float32 (ALGORITHMS.md §17): equal to a relative 2e-6
        assert float(ours.loss.detach()) == pytest.approx(float(theirs.loss.detach()), rel=2e-6, abs=1e-7)
        assert torch.allclose(our_grad, their_grad.double(), rtol=2e-6, atol=1e-7)
        assert ours.normalized_entropy == pytest.approx(float(theirs.normalized_entropy), abs=1e-6)
        assert ours.ce_excess == pytest.approx(float(theirs.cross_entropy_excess), abs=1e-5)
        assert (ours.groups, ours.modes) == (theirs.actuator_groups, theirs.actuator_modes)
