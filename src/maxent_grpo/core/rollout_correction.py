"""Sampler/trainer mismatch: metrics and the truncated or masked importance correction (ALGORITHMS.md §9).

The generator (a vLLM engine, a bf16 sampling copy) is not exactly the policy
being trained, so the completions are drawn from ``pi_gen`` while the loss is
written for ``pi_old``, the trainer's policy at rollout time. Per completion
token, with ``d[i,t] = logp_old[i,t] - logp_gen[i,t]``:

* token ratio ``rho[i,t] = exp(d[i,t])``; sequence ratio ``rho_i = exp(sum_t m*d)``
  (the product of the token ratios, as in TRL); the ``sequence_*`` modes put the
  row's one weight on every token of the row (§12's "sequence-level weight");
* ``*_truncate``: weight ``min(rho, C)`` (truncated IS, TRL's default, cap 3);
  ``*_mask``: weight ``rho * 1[rho <= C]`` (masked IS): the ratio where it is at
  most ``C``, ``0`` above, so an outlier token or sequence is dropped from the
  policy term rather than down-weighted, and a kept one is importance-weighted
  as under truncation (TRL's ``token_mask`` / ``sequence_mask``, which
  ``masked_fill`` the ratio with 0; verl keeps the ratio as the weight and the
  rejection as a separate mask). Only the upper side is bounded; ``C = inf``
  gives the plain ratio in both kinds.

The weights are detached and multiply the per-token *policy* term only (the KL
and entropy terms are not importance-weighted), as TRL and verl do.

Metric definitions follow their sources: TRL's
``sampling/sampling_logp_difference/{mean,max}`` = token mean / max of ``|d|``
(and ``.../rms``, the root of the token mean of ``d**2``, the gap as ScaleRL reports it) and ``sampling/importance_sampling_ratio/{min,mean,max}`` of the raw ratio at
the correction's level (token ratios when correction is off); NeMo-RL's
``token_mult_prob_error`` = token mean of ``exp(|d|)``, ``gen_kl_error`` =
token mean of the k3 estimate ``exp(d) - d - 1`` of ``KL(pi_gen || pi_old)``
(samples come from ``pi_gen``), and per sequence the same mean over that
sequence's tokens, ``mean_t exp(|d|)`` (``seq_mult_prob_error/{mean,max}``; NeMo-RL's
``compute_and_apply_seq_logprob_error_masking``: "the same calculation as
token_mult_prob_error but per-sequence", so its thresholds carry over).

``seq_logprob_error_threshold`` (NeMo-RL's option of that name): a sequence whose
``mean_t exp(|d|)`` exceeds it is left out of the policy term, weight 0 on all its
tokens (:func:`seq_error_weights`). As with the ``*_mask`` corrections the masked
tokens keep their place in the normaliser (ALGORITHMS.md §15); NeMo-RL removes the
sample from its token count instead. ``seq_mult_prob_error/masked`` counts them.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass

import torch

from maxent_grpo.core.bounds import require

ROLLOUT_CORRECTIONS = ("none", "token_truncate", "token_mask", "sequence_truncate", "sequence_mask")


def _check(old_logp: torch.Tensor, behaviour_logp: torch.Tensor, mask: torch.Tensor) -> None:
    if old_logp.dim() != 2:
        raise ValueError(f"old_logp must be [B, T], got shape {tuple(old_logp.shape)}")
    if behaviour_logp.shape != old_logp.shape or mask.shape != old_logp.shape:
        raise ValueError(
            f"behaviour_logp {tuple(behaviour_logp.shape)} and mask {tuple(mask.shape)} "
            f"must match old_logp {tuple(old_logp.shape)}"
        )


def _sequence_log_ratio(d: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    return (d * mask).sum(-1)


def correction_parts(mode: str) -> tuple[str, str]:
    """``(level, kind)`` of a correction mode: ``token`` or ``sequence``, ``truncate`` or ``mask``
    (``("token", "none")`` for ``none``); the one place the compound name is read."""
    if mode == "none":
        return "token", "none"
    level, kind = mode.split("_")
    return level, kind


def check_rollout_correction(mode: str, cap: float) -> None:
    """A known ``mode``, and a cap ``C >= 1`` (so a sampler equal to the trainer, ratio 1, keeps weight 1)."""
    require(mode in ROLLOUT_CORRECTIONS, "rollout_correction",
            f"must be one of {list(ROLLOUT_CORRECTIONS)}, got {mode!r}")
    require(cap >= 1, "rollout_correction_cap", f"must be >= 1, got {cap}")


def rollout_correction_weights(
    old_logp: torch.Tensor, behaviour_logp: torch.Tensor, mask: torch.Tensor, mode: str, cap: float
) -> torch.Tensor:
    """Detached importance weights ``[B, T]`` for the policy term (1 everywhere for ``mode="none"``).

    With ``rho`` the token ratio ``exp(logp_old - logp_gen)`` (``token_*``) or the row's
    ``exp(sum_t m (logp_old - logp_gen))`` on each of its tokens (``sequence_*``):
    ``*_truncate`` -> ``min(rho, C)``, ``*_mask`` -> ``rho * 1[rho <= C]`` (module notes).
    old_logp, behaviour_logp, mask: ``[B, T]``; padding positions get weight 1
    (the aggregators multiply by the mask anyway).
    """
    check_rollout_correction(mode, cap)
    _check(old_logp, behaviour_logp, mask)
    if mode == "none":
        return torch.ones_like(old_logp)
    m = mask.to(old_logp.dtype)
    d = (old_logp.detach() - behaviour_logp.to(old_logp.dtype)) * m
    level, kind = correction_parts(mode)
    log_ratio = d if level == "token" else _sequence_log_ratio(d, m)[:, None].expand_as(d)
    # Compare in log space: exp of a long sequence's log-ratio can overflow to inf.
    over = log_ratio > torch.log(torch.tensor(cap, dtype=log_ratio.dtype, device=log_ratio.device))
    # exp is only selected where log_ratio <= log(C): an overflow to inf is never kept.
    weight = torch.where(over, torch.full_like(d, cap if kind == "truncate" else 0.0), torch.exp(log_ratio))
    return torch.where(m > 0, weight, torch.ones_like(weight)).detach()


def check_seq_logprob_error_threshold(threshold: float | None) -> None:
    require(threshold is None or threshold > 1, "seq_logprob_error_threshold",
            f"must be > 1 (mean_t exp(|d|) is >= 1; null: off), got {threshold}")


def seq_mult_prob_error(old_logp: torch.Tensor, behaviour_logp: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """NeMo-RL's per-sequence error ``mean_t exp(|logp_old - logp_gen|)`` ``[B]`` (1 for an empty completion)."""
    _check(old_logp, behaviour_logp, mask)
    m = mask.detach().to(torch.float64)
    ad = ((old_logp.detach().to(torch.float64) - behaviour_logp.detach().to(torch.float64)) * m).abs()
    lengths = m.sum(-1)
    return torch.where(lengths > 0, (torch.exp(ad) * m).sum(-1) / lengths.clamp(min=1), torch.ones_like(lengths))


def seq_error_weights(
    old_logp: torch.Tensor, behaviour_logp: torch.Tensor, mask: torch.Tensor, threshold: float
) -> torch.Tensor:
    """Weights ``[B, T]`` of the policy term: 0 on every token of a sequence whose
    :func:`seq_mult_prob_error` exceeds ``threshold``, 1 elsewhere."""
    check_seq_logprob_error_threshold(threshold)
    keep = seq_mult_prob_error(old_logp, behaviour_logp, mask) <= threshold
    return keep[:, None].expand_as(old_logp).to(old_logp.dtype)


@dataclass(frozen=True)
class CorrectionPlan:
    """How one step corrects for the sampler -> trainer mismatch, decided once where the step is planned
    (``core/step.py``, from its ``LossSpec``); every term reads it.

    ``mode`` and ``cap``: ``loss.rollout_correction`` and its C. ``in_policy_loss``: the registered policy
    loss applies the weight itself (GMPO, VESPO: ``applies_correction``), so the step does not multiply it
    in again. ``seq_error_threshold``: NeMo-RL's sequence filter (None: off).
    """

    mode: str = "none"
    cap: float = 2.0
    in_policy_loss: bool = False
    seq_error_threshold: float | None = None

    @property
    def level(self) -> str:
        return correction_parts(self.mode)[0]

    def weights(self, old_logp: torch.Tensor, behaviour_logp: torch.Tensor | None,
                mask: torch.Tensor) -> torch.Tensor | None:
        """The detached ``[B, T]`` weight of a micro-batch (None when off or without behaviour log-probs)."""
        if behaviour_logp is None or self.mode == "none":
            return None
        return rollout_correction_weights(old_logp, behaviour_logp, mask, self.mode, self.cap)

    def sequence_filter(self, old_logp: torch.Tensor, behaviour_logp: torch.Tensor,
                        mask: torch.Tensor) -> torch.Tensor | None:
        """The ``[B, T]`` 0/1 weight of the sequence filter (None when off)."""
        if self.seq_error_threshold is None:
            return None
        return seq_error_weights(old_logp, behaviour_logp, mask, self.seq_error_threshold)

    def mismatch(self, old_logp: torch.Tensor, behaviour_logp: torch.Tensor, mask: torch.Tensor) -> MismatchSums:
        """A micro-batch's sampler/trainer mismatch statistics, at this plan's level and cap."""
        return rollout_mismatch_sums(old_logp, behaviour_logp, mask, level=self.level,
                                     seq_error_threshold=self.seq_error_threshold,
                                     cap=None if self.mode == "none" else self.cap)


@dataclass(frozen=True)
class MismatchSums:
    """Additive and extreme statistics of one process's mismatch; combined over ranks before dividing.

    ``ratio_*`` describe the raw ratio at ``level`` (token: over tokens;
    sequence: over sequences with at least one token).
    """

    tokens: float
    sequences: float
    abs_diff_sum: float
    abs_diff_max: float
    mult_prob_error_sum: float
    gen_kl_sum: float
    seq_mult_prob_error_sum: float
    seq_mult_prob_error_max: float
    ratio_count: float
    ratio_sum: float
    ratio_min: float
    ratio_max: float
    seq_masked: float = 0.0  # sequences left out by seq_logprob_error_threshold
    ratio_above_cap: float = 0.0  # ratios above the correction's cap C: truncated or masked (§15)
    sq_diff_sum: float = 0.0  # sum of squared token log-prob differences (the RMS gap)


def rollout_mismatch_sums(
    old_logp: torch.Tensor, behaviour_logp: torch.Tensor, mask: torch.Tensor, *, level: str = "token",
    seq_error_threshold: float | None = None, cap: float | None = None,
) -> MismatchSums:
    """Mismatch statistics of ``[B, T]`` log-probs (module notes), as sums and extremes over this batch;
    ``seq_masked`` counts the non-empty sequences above ``seq_error_threshold``, ``ratio_above_cap``
    the ratios (at ``level``) above the correction's ``cap``."""
    if level not in ("token", "sequence"):
        raise ValueError(f"level must be 'token' or 'sequence', got {level!r}")
    _check(old_logp, behaviour_logp, mask)
    m = mask.detach().to(torch.float64)
    on = m > 0
    d = (old_logp.detach().to(torch.float64) - behaviour_logp.detach().to(torch.float64)) * m
    ad = d.abs()
    lengths = m.sum(-1)
    rows = lengths > 0
    seq_err = seq_mult_prob_error(old_logp, behaviour_logp, mask)[rows]
    masked = 0 if seq_error_threshold is None else int((seq_err > seq_error_threshold).sum())
    if level == "token":
        ratio = torch.exp(d[on])
    else:
        ratio = torch.exp(_sequence_log_ratio(d, m)[rows])

    def ext(t: torch.Tensor, fn, empty: float) -> torch.Tensor:
        return fn(t) if t.numel() else t.new_tensor(empty)

    values = torch.stack([
        m.sum(),
        rows.sum().to(m.dtype),
        ad.sum(),
        ext(ad[on], torch.max, 0.0),  # |d| >= 0
        torch.exp(ad[on]).sum(),
        (torch.expm1(d[on]) - d[on]).sum(),
        seq_err.sum(),
        ext(seq_err, torch.max, 1.0),  # exp(|.|) >= 1
        m.new_tensor(float(ratio.numel())),
        ratio.sum(),
        ext(ratio, torch.min, math.inf),
        ext(ratio, torch.max, 0.0),  # ratios are > 0
    ])
    # One transfer for all twelve (on an accelerator each float() would be a sync).
    above = 0 if cap is None else int((ratio > cap).sum())
    return MismatchSums(*values.tolist(), seq_masked=float(masked), ratio_above_cap=float(above),
                        sq_diff_sum=float(d.square().sum()))


# How each field of MismatchSums combines; the empty batch's values are these operations' identities.
_MAX_FIELDS = ("abs_diff_max", "seq_mult_prob_error_max", "ratio_max")
_MIN_FIELDS = ("ratio_min",)


def combine_mismatch_sums(parts: list[MismatchSums]) -> MismatchSums:
    """Sum the additive fields and take the extremes over ``parts`` (micro-batches or ranks)."""
    if not parts:
        raise ValueError("parts must not be empty")
    out = {}
    for f in dataclasses.fields(MismatchSums):
        values = [getattr(p, f.name) for p in parts]
        out[f.name] = max(values) if f.name in _MAX_FIELDS else min(values) if f.name in _MIN_FIELDS else sum(values)
    return MismatchSums(**out)


def mismatch_metrics(s: MismatchSums) -> dict[str, float]:
    """The logged names (TRL's and NeMo-RL's) from combined sums."""
    tokens, seqs, ratios = max(s.tokens, 1.0), max(s.sequences, 1.0), max(s.ratio_count, 1.0)
    return {
        "sampling/sampling_logp_difference/mean": s.abs_diff_sum / tokens,
        "sampling/sampling_logp_difference/max": s.abs_diff_max,
        "sampling/sampling_logp_difference/rms": math.sqrt(s.sq_diff_sum / tokens),
        "sampling/importance_sampling_ratio/min": s.ratio_min if s.ratio_count else 1.0,
        "sampling/importance_sampling_ratio/mean": s.ratio_sum / ratios if s.ratio_count else 1.0,
        "sampling/importance_sampling_ratio/max": s.ratio_max if s.ratio_count else 1.0,
        "token_mult_prob_error": s.mult_prob_error_sum / tokens if s.tokens else 1.0,
        "gen_kl_error": s.gen_kl_sum / tokens,
        "seq_mult_prob_error/mean": s.seq_mult_prob_error_sum / seqs if s.sequences else 1.0,
        "seq_mult_prob_error/max": s.seq_mult_prob_error_max,
        "seq_mult_prob_error/masked": s.seq_masked,
        # ALGORITHMS.md §15's behave/truncated_frac (or masked_frac, by the correction's kind).
        "sampling/importance_sampling_ratio/above_cap_frac": s.ratio_above_cap / ratios,
    }
