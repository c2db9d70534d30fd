"""SEED-GRPO: scale each group's advantages down by its semantic entropy (ALGORITHMS.md §7).

Completions are clustered by their canonical final answer; the cluster masses
come from the behaviour policy's sequence log-probs, so a group whose sampled
answers disagree (high semantic entropy) gets smaller advantages.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch

from maxent_grpo.core.logprobs import per_token_logp

__all__ = ["cluster_ids_from_answers", "semantic_entropy", "seed_grpo_scales"]


def cluster_ids_from_answers(answers: Sequence[Sequence[str | None]]) -> torch.Tensor:
    """``[P, G]`` long cluster ids from canonical answers; ``None`` (no answer) gets a unique id.

    Ids are only meaningful within a group. Answers must already be
    canonicalised: equal strings are the same cluster.
    """
    if len(answers) == 0:
        raise ValueError("answers must hold at least one group")
    g = len(answers[0])
    ids: list[list[int]] = []
    for p, group in enumerate(answers):
        if len(group) != g:
            raise ValueError(f"answers: ragged groups, group 0 has {g} completions but group {p} has {len(group)}")
        seen: dict[str, int] = {}
        row = []
        for i, ans in enumerate(group):
            # No-answer completions get ids G.., which no answered cluster (ids < G) can reach.
            row.append(g + i if ans is None else seen.setdefault(ans, len(seen)))
        ids.append(row)
    return torch.tensor(ids, dtype=torch.long)


def _check_inputs(cluster_ids: torch.Tensor, seq_logps: torch.Tensor, token_counts: torch.Tensor | None,
                  length_normalize: bool) -> None:
    if seq_logps.dim() != 2 or seq_logps.shape[1] < 1:
        raise ValueError(f"seq_logps must be a [P, G] tensor, got shape {tuple(seq_logps.shape)}")
    if cluster_ids.shape != seq_logps.shape:
        raise ValueError(
            f"cluster_ids must have the shape of seq_logps {tuple(seq_logps.shape)}, got {tuple(cluster_ids.shape)}"
        )
    if cluster_ids.is_floating_point() or cluster_ids.dtype == torch.bool:
        raise ValueError(f"cluster_ids must be an integer tensor, got dtype {cluster_ids.dtype}")
    if length_normalize and token_counts is None:
        raise ValueError("token_counts is required when length_normalize=True")
    if token_counts is not None and token_counts.shape != seq_logps.shape:
        raise ValueError(
            f"token_counts must have the shape of seq_logps {tuple(seq_logps.shape)}, got {tuple(token_counts.shape)}"
        )


@torch.no_grad()
def semantic_entropy(
    cluster_ids: torch.Tensor,
    seq_logps: torch.Tensor,
    token_counts: torch.Tensor | None = None,
    *,
    length_normalize: bool = True,
) -> torch.Tensor:
    """Entropy ``H_x = -sum_c p_c log p_c`` of the answer clusters of each group, ``[P]`` (nats).

    ``p_c = sum_{i in c} exp(l_i) / sum_j exp(l_j)`` with ``l_i`` the sequence
    log-prob, divided by its token count (clamped to >= 1) when
    ``length_normalize``. All in log space, so very negative log-probs do not
    underflow.
    """
    _check_inputs(cluster_ids, seq_logps, token_counts, length_normalize)
    l = seq_logps.detach()
    if length_normalize:
        l = per_token_logp(l, token_counts)
    log_total = torch.logsumexp(l, dim=-1, keepdim=True)  # [P, 1]
    same = cluster_ids[:, :, None] == cluster_ids[:, None, :]  # [P, G, G]: j in cluster of i
    in_cluster = torch.where(same, l[:, None, :], torch.full_like(same, float("-inf"), dtype=l.dtype))
    log_mass = torch.logsumexp(in_cluster, dim=-1) - log_total  # [P, G]: log p_{c(i)}
    p = torch.exp(l - log_total)
    # sum_i p_i log p_{c(i)} = sum_c p_c log p_c: each cluster's mass is counted through its members.
    return -(p * log_mass).sum(dim=-1)


@torch.no_grad()
def seed_grpo_scales(
    cluster_ids: torch.Tensor,
    seq_logps: torch.Tensor,
    token_counts: torch.Tensor | None = None,
    *,
    alpha: float = 0.0417,
    normalize_by_max_entropy: bool = True,
    length_normalize: bool = True,
) -> torch.Tensor:
    """Detached per-group advantage scales ``1 / (1 + alpha_eff * H_x)``, ``[P]``.

    ``alpha_eff = alpha / ln G`` when ``normalize_by_max_entropy`` (so G
    equiprobable singleton answers give exactly ``1 / (1 + alpha)``), else
    ``alpha``. One cluster, ``alpha = 0`` or ``G = 1`` give 1.
    """
    _check_inputs(cluster_ids, seq_logps, token_counts, length_normalize)
    if math.isnan(alpha) or alpha < 0 or math.isinf(alpha):
        raise ValueError(f"alpha must be a finite number >= 0, got {alpha}")
    p, g = seq_logps.shape
    dtype = seq_logps.dtype if seq_logps.is_floating_point() else torch.get_default_dtype()
    if g == 1 or alpha == 0.0:
        return torch.ones(p, dtype=dtype, device=seq_logps.device)
    h = semantic_entropy(cluster_ids, seq_logps.to(dtype), token_counts, length_normalize=length_normalize)
    alpha_eff = alpha / math.log(g) if normalize_by_max_entropy else alpha
    return 1.0 / (1.0 + alpha_eff * h)
