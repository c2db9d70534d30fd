"""SEED-GRPO semantic entropy and advantage scales against a float64 reference (§7)."""

from __future__ import annotations

import math

import pytest
import torch

from maxent_grpo.core.seed_grpo import cluster_ids_from_answers, seed_grpo_scales, semantic_entropy


def ref_entropy(ids, logps, counts, length_normalize=True):
    """Cluster masses by explicit accumulation in a dict, shifted by the max for stability."""
    l = [lp / max(c, 1) if length_normalize else lp for lp, c in zip(logps, counts)]
    m = max(l)
    mass: dict[int, float] = {}
    for cid, li in zip(ids, l):
        mass[cid] = mass.get(cid, 0.0) + math.exp(li - m)
    total = sum(mass.values())
    return -sum((v / total) * math.log(v / total) for v in mass.values())


def random_batch(p, g, seed):
    gen = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, 3, (p, g), generator=gen)
    logps = -torch.rand(p, g, generator=gen, dtype=torch.float64) * 80
    counts = torch.randint(1, 40, (p, g), generator=gen)
    return ids, logps, counts


@pytest.mark.parametrize("length_normalize", [True, False])
def test_semantic_entropy_matches_reference(length_normalize):
    ids, logps, counts = random_batch(6, 5, 0)
    h = semantic_entropy(ids, logps, counts, length_normalize=length_normalize)
    for p in range(6):
        expect = ref_entropy(ids[p].tolist(), logps[p].tolist(), counts[p].tolist(), length_normalize)
        assert float(h[p]) == pytest.approx(expect, abs=1e-9)


@pytest.mark.parametrize("alpha,normalize", [(0.0417, True), (0.3, False), (1.0, True)])
def test_scales_match_reference(alpha, normalize):
    ids, logps, counts = random_batch(5, 4, 1)
    s = seed_grpo_scales(ids, logps, counts, alpha=alpha, normalize_by_max_entropy=normalize)
    for p in range(5):
        h = ref_entropy(ids[p].tolist(), logps[p].tolist(), counts[p].tolist())
        a_eff = alpha / math.log(4) if normalize else alpha
        assert float(s[p]) == pytest.approx(1 / (1 + a_eff * h), abs=1e-9)


def test_one_cluster_gives_scale_one():
    _, logps, counts = random_batch(3, 6, 2)
    ids = torch.full((3, 6), 7)
    s = seed_grpo_scales(ids, logps, counts, alpha=0.5)
    assert torch.allclose(s, torch.ones(3, dtype=torch.float64), atol=1e-12)


def test_equiprobable_singletons_give_one_over_one_plus_alpha():
    g, alpha = 8, 0.0417
    ids = torch.arange(g).repeat(2, 1)
    # per-token log-probs equal, sequence sums and lengths different
    counts = torch.tensor([list(range(1, g + 1)), list(range(3, g + 3))])
    logps = -0.7 * counts.to(torch.float64)
    s = seed_grpo_scales(ids, logps, counts, alpha=alpha)
    assert s.tolist() == pytest.approx([1 / (1 + alpha)] * 2, abs=1e-12)
    # huge negative sums do not underflow (log-sum-exp)
    s_raw = seed_grpo_scales(ids, torch.full((2, g), -5000.0, dtype=torch.float64), None,
                             alpha=alpha, length_normalize=False)
    assert s_raw.tolist() == pytest.approx([1 / (1 + alpha)] * 2, abs=1e-12)


def test_alpha_zero_or_single_generation_gives_one():
    ids, logps, counts = random_batch(3, 5, 3)
    assert torch.equal(seed_grpo_scales(ids, logps, counts, alpha=0.0), torch.ones(3, dtype=torch.float64))
    s = seed_grpo_scales(ids[:, :1], logps[:, :1], counts[:, :1], alpha=0.5)
    assert torch.equal(s, torch.ones(3, dtype=torch.float64))


def test_scales_are_detached():
    ids, logps, counts = random_batch(2, 4, 4)
    logps.requires_grad_(True)
    assert not seed_grpo_scales(ids, logps, counts).requires_grad
    assert not semantic_entropy(ids, logps, counts).requires_grad


def test_entropy_invariant_to_relabelling_and_order_and_other_groups():
    ids, logps, counts = random_batch(2, 6, 5)
    h = semantic_entropy(ids, logps, counts)
    perm = torch.tensor([3, 0, 5, 1, 4, 2])
    relabel = ids * 10 + 3  # a bijection on cluster ids
    other = ids.clone()
    other[1] = ids[0]  # ids colliding with another group's are irrelevant
    assert torch.allclose(semantic_entropy(relabel[:, perm], logps[:, perm], counts[:, perm]), h, atol=1e-12)
    assert torch.allclose(semantic_entropy(other, logps, counts)[0], h[0], atol=1e-12)


def test_length_normalisation_changes_masses():
    ids = torch.tensor([[0, 1]])
    logps = torch.tensor([[-10.0, -20.0]], dtype=torch.float64)
    counts = torch.tensor([[10, 20]])
    # per-token both -1: equal masses
    assert float(semantic_entropy(ids, logps, counts)) == pytest.approx(math.log(2), abs=1e-12)
    raw = float(semantic_entropy(ids, logps, counts, length_normalize=False))
    assert raw == pytest.approx(ref_entropy([0, 1], [-10.0, -20.0], [1, 1], False), abs=1e-12)
    assert raw < 0.01


def test_cluster_ids_from_answers():
    ids = cluster_ids_from_answers([["4", "5", None, "4", None], ["x", "x", "x", "x", "x"]])
    assert ids.dtype == torch.long
    row = ids[0].tolist()
    assert row[0] == row[3] and len({row[0], row[1], row[2], row[4]}) == 4
    assert len(set(ids[1].tolist())) == 1
    with pytest.raises(ValueError, match="ragged"):
        cluster_ids_from_answers([["a", "b"], ["a"]])
    with pytest.raises(ValueError, match="answers"):
        cluster_ids_from_answers([])


def test_seed_rejects_bad_arguments():
    ids, logps, counts = random_batch(2, 3, 6)
    with pytest.raises(ValueError, match="alpha"):
        seed_grpo_scales(ids, logps, counts, alpha=-0.1)
    with pytest.raises(ValueError, match="token_counts"):
        seed_grpo_scales(ids, logps, None)
    with pytest.raises(ValueError, match="cluster_ids"):
        seed_grpo_scales(ids.double(), logps, counts)
    with pytest.raises(ValueError, match="cluster_ids"):
        seed_grpo_scales(ids[:, :2], logps, counts)
    with pytest.raises(ValueError, match="seq_logps"):
        seed_grpo_scales(ids[0], logps[0], counts[0])
