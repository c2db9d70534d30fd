"""Verified mode replay: the likelihood term over banked exemplars (ALGORITHMS.md §17).

Re:Dr (Dr.GRPO + replay) and Re:Max (MaxRL + replay), from remax-rl 0.1.1
(``remax/core/objectives.py``, ``remax/core/scoring.py``). Each replay group is one
prompt's banked exemplars, one per verified mode (``core/mode_bank.py``). Exemplar
``m`` of group ``g`` is teacher-forced as ``[prompt || exemplar]`` and scored by its
length-normalised log-likelihood ``s_{g,m} = (1/T_{g,m}) sum_t log pi(y_t | ...)``;
the term is

    L_replay = (1/n_R) sum_g (sum_m w_m (-s_{g,m})) / (sum_m w_m)       (w = 1 in every recipe)

and the step objective ``L_fresh + alpha (G-1)/G^2 L_replay`` (remax's learner applies
its reward-estimator scale ``(G-1)/G`` and its per-rollout ``1/G`` to ``alpha``). Replay
rows are likelihood only: no advantage, ratio, clip, KL or correction weight, and
they are outside the fresh loss's normalisers.

Unlike remax, the reductions keep the input dtype (no float32 cast), so a float64
model gives float64 values. Unlike remax's right-padded rows, a group's rows share their
prompt, left-padded as the fresh batch's are, so that the scoring runs it once for all its
exemplars (``Scoring.share_prompts``), and one differentiable pass gives both the gradient
and the value (remax runs a no-grad pass for the value first).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from maxent_grpo.core.logprobs import Scoring

__all__ = ["ReplayBatch", "ReplayLayout", "ReplayLoss", "mode_scores", "replay_backward", "replay_layout", "replay_scale",
           "verified_likelihood_loss"]


def replay_scale(coef: float, num_generations: int) -> float:
    """``alpha * (G-1) / G^2``: the replay term's weight beside the fresh loss (0.005859375 at 0.1, 16)."""
    if not math.isfinite(coef) or coef <= 0:
        raise ValueError(f"replay coef must be finite and > 0, got {coef!r}")
    if num_generations < 2:
        raise ValueError(f"replay needs num_generations >= 2, got {num_generations!r}")
    return coef * (num_generations - 1) / num_generations**2


@dataclass(frozen=True)
class ReplayLayout:
    """The teacher-forcing batch of some replay groups, one row per exemplar.

    ``input_ids``/``attention_mask`` ``[M, prompt_length + T]``: the prompt left-padded to
    ``prompt_length`` (the longest prompt), then the exemplar right-padded to ``T`` (the longest
    exemplar), the fresh batch's layout, so the rows of a group repeat one prompt row;
    ``response_mask`` ``[M, T]`` marks the exemplar's tokens (the positions the completion
    log-probs ``[M, T]`` of ``Scoring.logps(..., prompt_length)`` predict); ``group_sizes`` the
    exemplars per group, in order.
    """

    input_ids: torch.Tensor
    attention_mask: torch.Tensor
    response_mask: torch.Tensor
    prompt_length: int
    group_sizes: tuple[int, ...]


def replay_layout(groups: Sequence[tuple[Sequence[int], Sequence[Sequence[int]]]], pad_token_id: int,
                  device: torch.device | str = "cpu") -> ReplayLayout:
    """Rows ``prompt + exemplar`` for ``groups`` = ``[(prompt ids, [exemplar ids, ...]), ...]``.

    The rows of remax's ``materialize_canonical_replay_batch`` with the prompts left-padded and
    the exemplars right-padded with ``pad_token_id`` (the same real tokens, positions and masks).
    """
    if not groups:
        raise ValueError("replay needs at least one group")
    if pad_token_id < 0:
        raise ValueError(f"pad_token_id must be >= 0, got {pad_token_id}")
    rows: list[tuple[tuple[int, ...], tuple[int, ...]]] = []
    sizes = []
    for prompt, exemplars in groups:
        prompt = tuple(int(t) for t in prompt)
        if not prompt or not exemplars or any(len(e) == 0 for e in exemplars):
            raise ValueError("a replay group needs a prompt and at least one exemplar with a response token")
        sizes.append(len(exemplars))
        rows += [(prompt, tuple(int(t) for t in e)) for e in exemplars]
    if any(t < 0 for prompt, exemplar in rows for t in prompt + exemplar):
        raise ValueError("replay token ids must be >= 0")
    prompt_length = max(len(prompt) for prompt, _ in rows)
    width = max(len(exemplar) for _, exemplar in rows)
    input_ids = torch.full((len(rows), prompt_length + width), int(pad_token_id), dtype=torch.long)
    attention_mask = torch.zeros_like(input_ids)
    for i, (prompt, exemplar) in enumerate(rows):
        span = slice(prompt_length - len(prompt), prompt_length + len(exemplar))
        input_ids[i, span] = torch.tensor(prompt + exemplar, dtype=torch.long)
        attention_mask[i, span] = 1
    response_mask = attention_mask[:, prompt_length:].bool()
    return ReplayLayout(input_ids.to(device), attention_mask.to(device), response_mask.to(device), prompt_length,
                        tuple(sizes))


def mode_scores(token_logps: torch.Tensor, response_mask: torch.Tensor) -> torch.Tensor:
    """``s_m = mean of token_logps[m] over response_mask[m]``: ``[M, T]`` x ``[M, T]`` -> ``[M]``.

    Padding and prompt positions contribute nothing (also no NaN from a padded position).
    """
    if token_logps.shape != response_mask.shape:
        raise ValueError(f"token_logps {tuple(token_logps.shape)} and response_mask {tuple(response_mask.shape)} differ")
    counts = response_mask.sum(dim=1)
    if bool((counts == 0).any()):
        raise ValueError("every replay row needs at least one response token")
    kept = torch.where(response_mask, token_logps, torch.zeros_like(token_logps))
    return kept.sum(dim=1) / counts.to(token_logps.dtype)


@dataclass(frozen=True)
class ReplayLoss:
    """``loss``: L_replay (differentiable). The rest are detached diagnostics over the groups
    with at least 2 modes: ``normalized_entropy`` the mean of ``H(softmax s_g) / ln M_g``
    (1.0 when none qualifies) and ``ce_excess`` the mean of ``-mean_m log softmax(s_g)_m - ln M_g``
    (0.0 when none qualifies)."""

    loss: torch.Tensor
    normalized_entropy: float
    ce_excess: float
    groups: int
    modes: int


def verified_likelihood_loss(scores: torch.Tensor, group_sizes: Sequence[int],
                             weights: torch.Tensor | None = None) -> ReplayLoss:
    """L_replay of ``scores`` ``[M]`` (groups consecutive, ``group_sizes`` summing to ``M``).

    ``d L / d s_{g,m} = -w_m / (n_R * sum_{m' in g} w_{m'})``: -1/(n_R M_g) with unit weights;
    the gradients sum to -1 over all modes.
    """
    sizes = tuple(int(s) for s in group_sizes)
    if scores.ndim != 1:
        raise ValueError(f"replay scores must be 1-D, got shape {tuple(scores.shape)}")
    if not sizes or any(s < 1 for s in sizes):
        raise ValueError(f"replay group sizes must be a non-empty list of ints >= 1, got {list(group_sizes)}")
    if sum(sizes) != scores.numel():
        raise ValueError(f"replay group sizes {list(sizes)} do not add up to the {scores.numel()} scores")
    if not bool(torch.isfinite(scores).all()):
        raise ValueError("replay scores must be finite")
    if weights is None:
        weights = torch.ones_like(scores.detach())
    if weights.shape != scores.shape or not bool(torch.isfinite(weights).all()) or bool((weights <= 0).any()):
        raise ValueError("replay weights must be finite, > 0 and one per score")
    weights = weights.to(scores.dtype)
    losses, entropies, excesses = [], [], []
    for group_scores, group_weights in zip(scores.split(sizes), weights.split(sizes)):
        losses.append(-(group_scores * group_weights).sum() / group_weights.sum())
        if group_scores.numel() >= 2:
            log_support = math.log(group_scores.numel())
            logp = torch.log_softmax(group_scores.detach().double(), dim=0)
            entropies.append(float(-(logp.exp() * logp).sum()) / log_support)
            excesses.append(float(-logp.mean()) - log_support)
    return ReplayLoss(
        loss=torch.stack(losses).mean(),
        normalized_entropy=sum(entropies) / len(entropies) if entropies else 1.0,
        ce_excess=sum(excesses) / len(excesses) if excesses else 0.0,
        groups=len(sizes),
        modes=sum(sizes),
    )


@dataclass(frozen=True)
class ReplayBatch:
    """This step's replay work: the layout (on the model's device), the scale
    ``alpha (G-1)/G^2``, ``compute_only`` (the control: the same passes, an exactly zero
    gradient) and the rows per differentiable pass."""

    layout: ReplayLayout
    scale: float
    compute_only: bool = False
    rows_per_pass: int = 8

    def __post_init__(self) -> None:
        if not math.isfinite(self.scale) or self.scale <= 0:
            raise ValueError(f"replay scale must be finite and > 0, got {self.scale}")
        if self.rows_per_pass < 1:
            raise ValueError(f"rows_per_pass must be >= 1, got {self.rows_per_pass}")


def _chunk(layout: ReplayLayout, start: int, stop: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, int]:
    """Rows ``start:stop`` of ``layout`` as ``(input_ids, attention_mask, response_mask, prompt_length)``,
    without the columns that are padding in every one of them."""
    mask = layout.attention_mask[start:stop]
    prompt_real = mask[:, : layout.prompt_length].any(dim=0).nonzero()
    first = int(prompt_real[0]) if prompt_real.numel() else layout.prompt_length
    width = int(layout.response_mask[start:stop].any(dim=0).nonzero()[-1]) + 1
    end = layout.prompt_length + width
    return (layout.input_ids[start:stop, first:end], mask[:, first:end], layout.response_mask[start:stop, :width],
            layout.prompt_length - first)


def _row_coefficients(group_sizes: Sequence[int], dtype: torch.dtype, device) -> torch.Tensor:
    """``dL/ds_m = -c_m``: ``c_m = 1/(n_R M_g)`` for the rows of group ``g`` (unit weights)."""
    return torch.cat([torch.full((m,), 1.0 / (len(group_sizes) * m), dtype=dtype, device=device) for m in group_sizes])


def replay_backward(model, batch: ReplayBatch, scoring: Scoring) -> dict[str, float]:
    """Accumulate ``scale * dL_replay/dtheta`` into the gradients (exact zeros with ``compute_only``)
    and return the ``replay/*`` metrics.

    One differentiable pass, ``rows_per_pass`` rows at a time: L_replay is linear in the scores,
    ``L = -sum_m c_m s_m``, so the chunks' backwards add up to the whole term, and the chunks'
    detached scores give its value and diagnostics. The rows are scored under ``scoring`` (the
    sampling temperature, bf16 autocast, prompt sharing and packing), so the rows of a group in a
    chunk run their prompt once.
    """
    layout = batch.layout
    total = layout.input_ids.shape[0]
    coefficients = _row_coefficients(layout.group_sizes, torch.float64, layout.input_ids.device)
    kept = []
    for start in range(0, total, batch.rows_per_pass):
        input_ids, attention_mask, response_mask, prompt_length = _chunk(layout, start, start + batch.rows_per_pass)
        live, _ = scoring.logps(model, input_ids, attention_mask, prompt_length)
        live_scores = mode_scores(live, response_mask)
        if batch.compute_only:
            (live_scores * torch.zeros_like(live_scores)).sum().backward()
        else:
            (-batch.scale * (coefficients[start : start + live_scores.numel()].to(live_scores.dtype) * live_scores).sum()).backward()
        kept.append(live_scores.detach())
    scores = torch.cat(kept)
    value = verified_likelihood_loss(scores, layout.group_sizes)
    raw = batch.scale * float(value.loss)
    return {
        "replay/loss": float(value.loss),
        "replay/raw_loss": raw,
        "replay/applied_loss": 0.0 if batch.compute_only else raw,
        "replay/groups": float(value.groups),
        "replay/modes": float(value.modes),
        "replay/effective_coef": batch.scale,
        "replay/compute_only": float(batch.compute_only),
        "replay/score_mean": float(scores.mean()),
        "replay/score_min": float(scores.min()),
        "replay/normalized_entropy": value.normalized_entropy,
        "replay/ce_excess": value.ce_excess,
    }
