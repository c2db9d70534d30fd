"""The policy losses the peers converged on (ALGORITHMS.md §11-§14): SAPO, GMPO, DPPO, OPSM (VESPO, §22, is
``core/vespo.py``).

Each is one function registered in ``core.losses.POLICY_LOSSES`` with its own frozen
settings record (verl's ``core_algos`` registry); the methods that train with them are
``methods/sapo.py``, ``gmpo.py``, ``dppo.py`` and ``opsm.py``. ``core.step`` imports this
module, so the losses are registered wherever a step can run.
"""

from __future__ import annotations

import math
from typing import Literal
from dataclasses import dataclass

import torch

from maxent_grpo.core.bounds import require
from maxent_grpo.core.losses import (
    check_advantages,
    clip_metrics,
    LossMetric,
    policy_token_term,
    PolicyInputs,
    PolicyTerm,
    ppo_clip_terms,
    register_policy_loss,
    StepNormalizer,
    SurrogateTerms,
)

# SAPO, GMPO, DPPO and OPSM (ALGORITHMS.md §11-§14): one registered policy loss each, with its
# own frozen settings record. Every mask they add changes only the *numerator*: the step
# aggregates with the original token mask, so masked tokens still count in the denominators.
# Their metrics are token or sequence totals over ``inputs.mask`` (the step divides them by
# the step's active tokens / all its sequences).

# verl clamps logp - logp_old to [-20, 20] before exp (core_algos, SAPO and DPPO); §11, §13.
LOG_RATIO_CLAMP = 20.0
# verl's guards: GMPO's sequence-length denominator (§12), the binary KL's log (§13).
GMPO_LENGTH_EPS = 1e-8
BINARY_KL_EPS = 1e-8
# The floor of a token weight in GMPO's geometric mean of the rollout correction (§12; verl adds 1e-10).
GMPO_WEIGHT_EPS = 1e-10


def _loss_params(inputs: PolicyInputs, cls: type):
    """The loss's settings record: ``inputs.params``, or the defaults when none was passed."""
    if inputs.params is None:
        return cls()
    if not isinstance(inputs.params, cls):
        raise TypeError(f"params must be a {cls.__name__}, got {type(inputs.params).__name__}")
    return inputs.params


def _token_advantages(advantages: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    """``[B]`` (one per sequence, broadcast over tokens) or ``[B, T]`` advantages as ``[B, T]``."""
    if advantages.dim() == 2 and advantages.shape == like.shape:
        return advantages.to(like.dtype)
    check_advantages(advantages, like)
    return advantages.to(like.dtype)[:, None].expand_as(like)


def _clamped_log_ratio(logp: torch.Tensor, anchor_logp: torch.Tensor) -> torch.Tensor:
    return torch.clamp(logp - anchor_logp.to(logp.dtype), -LOG_RATIO_CLAMP, LOG_RATIO_CLAMP)


def _token_total(values: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Sum of ``values`` over the active tokens (detached; inactive positions never leak NaN/inf)."""
    values = values.detach().to(mask.dtype)
    return torch.where(mask > 0, values, torch.zeros_like(values)).sum()


def _ppo_kl(inputs: PolicyInputs) -> LossMetric:
    """verl's ``ppo_kl``: the token mean of ``logp_old - logp`` (k1 of KL(pi_old || pi))."""
    mask = inputs.mask.to(inputs.logp.dtype)
    return LossMetric(_token_total(inputs.old_logp.to(mask.dtype) - inputs.logp, mask), "token")


# ----- SAPO (§11)


@dataclass(frozen=True)
class SapoParams:
    """SAPO's gate temperatures (§11): ``tau_pos`` for ``A > 0`` tokens, ``tau_neg`` for the rest.

    Defaults 1.0 / 1.05 as verl, TRL and AReaL. The paper keeps ``tau_neg > tau_pos`` (tokens
    with a negative advantage are damped faster); that is a recommendation, not a check.
    """

    tau_pos: float = 1.0
    tau_neg: float = 1.05

    def __post_init__(self) -> None:
        require(0 < self.tau_pos < math.inf, "tau_pos",
                f"must be finite and > 0 (the SAPO gate divides by it), got {self.tau_pos}")
        require(0 < self.tau_neg < math.inf, "tau_neg",
                f"must be finite and > 0 (the SAPO gate divides by it), got {self.tau_neg}")


@register_policy_loss("sapo", params=SapoParams)
def sapo_objective(inputs: PolicyInputs, norm: StepNormalizer) -> PolicyTerm:
    """SAPO, Soft Adaptive Policy Optimization (arXiv:2511.20347; ALGORITHMS.md §11).

    Per token, with ``r = exp(clamp(logp - logp_old, -20, 20))`` and ``tau = tau_pos`` if
    ``A > 0`` else ``tau_neg``: gate ``g = (4/tau) * sigmoid(tau * (r - 1))``, loss ``-g * A``.
    No hard clip: ``dl/dlogp = -A * 4 s (1 - s) r`` with ``s = sigmoid(tau (r - 1))``, exactly
    ``-A`` at ``r = 1`` (the loss value there is ``-2A/tau``), decaying smoothly to 0 for
    ``r -> 0`` or ``r -> inf`` (0 exactly once the clamp is active).

    Shapes: ``logp``, ``old_logp``, masks ``[B, T]``; ``advantages`` ``[B]``. Returns the
    unaggregated ``[B, T]`` term (restricted to ``policy_mask``, times the xDr row weights);
    the step multiplies the rollout-correction weight ``w_t`` in and aggregates by any
    ``loss_type`` (``grpo`` matches the paper, verl and TRL). Metrics (token means):
    ``sapo/gate_mean`` (``g``), ``sapo/grad_weight_mean`` (``4 s (1-s) r``), ``ppo_kl``, and
    the ``clip_ratio/*`` keys at 0 (nothing is clipped), so the logged schema is unchanged.
    """
    p: SapoParams = _loss_params(inputs, SapoParams)
    logp = inputs.logp
    check_advantages(inputs.advantages, logp)
    adv = _token_advantages(inputs.advantages, logp)
    r = torch.exp(_clamped_log_ratio(logp, inputs.old_logp))
    tau = torch.where(adv > 0, torch.full_like(adv, p.tau_pos), torch.full_like(adv, p.tau_neg))
    s = torch.sigmoid(tau * (r - 1))
    gate = (4 / tau) * s
    per_token = policy_token_term(-gate * adv, inputs)
    mask = inputs.mask.to(logp.dtype)
    metrics = {
        "sapo/gate_mean": LossMetric(_token_total(gate, mask), "token"),
        "sapo/grad_weight_mean": LossMetric(_token_total(4 * s * (1 - s) * r, mask), "token"),
        "ppo_kl": _ppo_kl(inputs),
        **clip_metrics(None, per_token),
    }
    return PolicyTerm(per_token, per_token.new_zeros(()), metrics)


# ----- GMPO (§12)


@dataclass(frozen=True)
class GmpoParams:
    """GMPO's log-space clip range (§12): ``s = logp - logp_old`` is clipped to ``[-eps_low, eps_high]``
    on the side the advantage pushes. Default 0.4 / 0.4 (ratio range ``(e^-0.4, e^0.4)``; verl's
    GMPO example and the paper), *not* the generic PPO 0.2. MoE training may need less."""

    eps_low: float = 0.4
    eps_high: float = 0.4

    def __post_init__(self) -> None:
        require(self.eps_low > 0, "eps_low", f"must be > 0 (GMPO clips log s below at -eps_low), got {self.eps_low}")
        require(self.eps_high > 0, "eps_high", f"must be > 0 (GMPO clips log s above at eps_high), got {self.eps_high}")


@dataclass(frozen=True)
class GmpoTerms:
    """Output of :func:`gmpo_surrogate`: ``sequence_loss`` / ``rho`` / ``advantage`` ``[B]``; clip masks
    bool ``[B, T]`` (ANDed with the token mask), ``log_ratio`` ``[B, T]`` detached."""

    sequence_loss: torch.Tensor
    rho: torch.Tensor
    advantage: torch.Tensor
    log_ratio: torch.Tensor
    low_clipped: torch.Tensor
    high_clipped: torch.Tensor


def gmpo_surrogate(
    logp: torch.Tensor,
    old_logp: torch.Tensor,
    advantages: torch.Tensor,
    *,
    mask: torch.Tensor,
    eps_low: float = 0.4,
    eps_high: float = 0.4,
    grad_mask: torch.Tensor | None = None,
) -> GmpoTerms:
    """GMPO's per-sequence loss (verl ``geo_mean``; arXiv:2507.20673; ALGORITHMS.md §12).

    ``s_t = logp - logp_old`` (not clamped, as verl); ``s~_t = min(s_t, eps_high)`` for
    ``A_t > 0``, ``max(s_t, -eps_low)`` for ``A_t < 0``, ``0`` for ``A_t = 0`` (PPO's
    pessimistic min in log space); ``rho_i = exp(sum_t m s~ / (L_i + 1e-8))``,
    ``Abar_i = sum_t m A_t / (L_i + 1e-8)``, ``l_i = -Abar_i * rho_i``. A clipped token adds its
    constant bound to ``rho_i`` and gets no gradient; an empty row has ``rho = 1``, ``Abar = 0``.

    ``advantages``: ``[B]`` or ``[B, T]`` (per-token, each token clips by its own sign, as verl).
    ``grad_mask`` (``[B, T]``, optional): tokens outside it keep their value in ``rho_i`` but
    pass no gradient (the top-entropy mask). ``low_clipped`` / ``high_clipped`` count only
    tokens where ``s~ != s``: ``A < 0 & s < -eps_low`` and ``A > 0 & s > eps_high``.
    The bounds of ``eps_low`` / ``eps_high`` are checked by :class:`GmpoParams`.
    """
    dtype = logp.dtype
    on = mask > 0
    m = mask.to(dtype)
    adv = _token_advantages(advantages, logp)
    s = logp - old_logp.to(dtype)
    if grad_mask is not None:
        s = torch.where(grad_mask > 0, s, s.detach())
    raw = s.detach()
    high = on & (adv > 0) & (raw > eps_high)
    low = on & (adv < 0) & (raw < -eps_low)
    zero = torch.zeros_like(s)
    s_tilde = torch.where(high, torch.full_like(s, eps_high), torch.where(low, torch.full_like(s, -eps_low), s))
    s_tilde = torch.where(on & (adv != 0), s_tilde, zero)
    length = m.sum(-1) + GMPO_LENGTH_EPS
    rho = torch.exp(s_tilde.sum(-1) / length)
    abar = torch.where(on, adv, torch.zeros_like(adv)).sum(-1) / length
    return GmpoTerms(-abar * rho, rho, abar, raw, low, high)


def gmpo_correction_weights(weights: torch.Tensor, mask: torch.Tensor, level: str) -> torch.Tensor:
    """The rollout-correction weight ``W_i`` ``[B]`` of GMPO's sequence loss (ALGORITHMS.md §12; verl ``geo_mean``).

    ``level="token"``: the geometric mean of the row's token weights,
    ``W_i = exp(sum_t m log(max(w_t, 1e-10)) / (L_i + 1e-8))``, as GMPO's ``rho_i`` is a
    geometric mean of token ratios. verl writes ``log(w_t + 1e-10)``; the floor differs from
    it by a relative ``1e-10 / w_t`` per token and keeps ``w = 1`` at exactly ``W = 1``, so a
    sampler equal to the trainer leaves the step bit-for-bit synchronous (§15). A dropped
    token (``w_t = 0``, ``token_mask``) pulls its row towards 0, not by ``1/L_i``.
    ``level="sequence"``: the row's own weight (one value on all its active tokens, as
    ``rollout_correction_weights`` gives it), exactly. An empty row gets 1 (its loss is 0).
    weights, mask: ``[B, T]`` (``weights`` detached; its padding is ignored).
    """
    on = mask > 0
    if level == "token":
        log_w = torch.log(torch.clamp(weights, min=GMPO_WEIGHT_EPS))
        length = on.sum(-1).to(weights.dtype) + GMPO_LENGTH_EPS
        return torch.exp(torch.where(on, log_w, torch.zeros_like(log_w)).sum(-1) / length)
    if level == "sequence":
        row = torch.where(on, weights, torch.full_like(weights, math.inf)).amin(-1)
        return torch.where(on.any(-1), row, torch.ones_like(row))
    raise ValueError(f"level must be 'token' or 'sequence', got {level!r}")


@register_policy_loss("gmpo", params=GmpoParams, loss_types=("grpo",), applies_correction=True)
def gmpo_objective(inputs: PolicyInputs, norm: StepNormalizer) -> PolicyTerm:
    """GMPO, Geometric-Mean Policy Optimization (arXiv:2507.20673; ALGORITHMS.md §12).

    The loss is sequence-level, ``(1/B) sum_i l_i`` over all ``B`` rows of the step
    (:func:`gmpo_surrogate`); only ``loss_type="grpo"`` is registered for it. It is returned as
    a per-token term: ``l_i`` (times the row's xDr weight) on every active token of row ``i``,
    so the step's ``grpo`` aggregation ``sum_i (sum_t m l_i / max(L_i, 1)) / num_sequences``
    equals ``sum_i l_i / num_sequences`` exactly, empty rows counting in the mean (verl's
    ``torch.mean``), and the result does not depend on how the step is split.

    Rollout correction: the loss applies it itself (registered ``applies_correction``): ``l_i``
    is multiplied by :func:`gmpo_correction_weights` of ``inputs.correction_weights``, the
    geometric mean ``exp(mean_t log w_t)`` of a token-level correction's weights (verl's
    choice, §12) or the row's weight of a sequence-level one. Multiplying ``w_t`` into the
    per-token form instead would weight the row by the arithmetic mean ``mean_t w_t``.

    ``policy_mask`` (top-entropy) restricts the gradient: the other tokens keep their
    clipped log-ratio in ``rho_i`` but pass no gradient. Shapes: ``[B, T]`` log-probs and
    masks, ``[B]`` advantages. Metrics: ``clip_ratio/low_mean`` (``A<0`` tokens with
    ``s < -eps_low``), ``clip_ratio/high_mean`` (``A>0``, ``s > eps_high``),
    ``clip_ratio/region_mean`` (either) -- only tokens where ``s~ != s``, unlike verl's
    over-counting ``pg_clipfrac`` -- and ``ppo_kl``, all token means.
    """
    p: GmpoParams = _loss_params(inputs, GmpoParams)
    check_advantages(inputs.advantages, inputs.logp)
    terms = gmpo_surrogate(inputs.logp, inputs.old_logp, inputs.advantages, mask=inputs.mask,
                           eps_low=p.eps_low, eps_high=p.eps_high, grad_mask=inputs.policy_mask)
    seq = terms.sequence_loss
    if inputs.correction_weights is not None:
        seq = seq * gmpo_correction_weights(inputs.correction_weights.detach().to(seq.dtype), inputs.mask,
                                            inputs.correction_level)
    if inputs.row_weights is not None:
        seq = seq * inputs.row_weights.detach().to(seq.dtype)
    on = inputs.mask > 0
    per_token = torch.where(on, seq[:, None].expand(on.shape), torch.zeros_like(seq)[:, None])
    clip = SurrogateTerms(per_token, torch.exp(terms.log_ratio), terms.low_clipped, terms.high_clipped,
                          terms.low_clipped | terms.high_clipped)
    return PolicyTerm(per_token, per_token.new_zeros(()), {**clip_metrics(clip, per_token), "ppo_kl": _ppo_kl(inputs)})


# ----- DPPO (§13)

DPPO_DIVERGENCES = ("tv", "binary_kl")
DPPO_ANCHORS = ("old", "behaviour")


@dataclass(frozen=True)
class DppoParams:
    """DPPO's trust-region mask (§13).

    ``divergence``: ``"tv"`` (Binary-TV, ``p - p_a``) or ``"binary_kl"``. ``delta_low`` /
    ``delta_high``: the thresholds for ``A <= 0`` / ``A > 0`` tokens. The defaults 0.15 are the
    spec's (verl example) values for **TV**; for ``divergence="binary_kl"`` the spec's default
    is **0.05**: pass ``delta_low=delta_high=0.05`` (0.15 is a much looser KL region).
    ``anchor``: ``"old"`` (the trainer's ``logp_old``, default) or ``"behaviour"`` (the
    sampler's log-probs: bypass mode, as prime-rl; then leave ``rollout_correction`` off, or
    the sampler mismatch is corrected twice). ``ratio_cap``: ``C`` in ``min(r, C)``; None
    falls back to the §3 ``delta`` (``ClipSettings.delta``), itself None by default: no
    truncation (prime-rl). verl's effective default is 3.0 (``clip_ratio_c``).
    """

    divergence: Literal[DPPO_DIVERGENCES] = "tv"
    delta_low: float = 0.15
    delta_high: float = 0.15
    anchor: Literal[DPPO_ANCHORS] = "old"
    ratio_cap: float | None = None

    def __post_init__(self) -> None:
        require(self.divergence in DPPO_DIVERGENCES, "divergence",
                f"must be one of {list(DPPO_DIVERGENCES)}, got {self.divergence!r}")
        require(self.delta_low > 0, "delta_low",
                f"must be > 0 (the DPPO mask threshold for A <= 0), got {self.delta_low}")
        require(self.delta_high > 0, "delta_high",
                f"must be > 0 (the DPPO mask threshold for A > 0), got {self.delta_high}")
        require(self.anchor in DPPO_ANCHORS, "anchor", f"must be one of {list(DPPO_ANCHORS)}, got {self.anchor!r}")
        require(self.ratio_cap is None or self.ratio_cap > 0, "ratio_cap",
                f"must be > 0 (it caps the detached DPPO ratio weight), got {self.ratio_cap}")


def dppo_trust_region_mask(
    logp: torch.Tensor,
    anchor_logp: torch.Tensor,
    advantages: torch.Tensor,
    *,
    divergence: str = "tv",
    delta_low: float = 0.15,
    delta_high: float = 0.15,
) -> torch.Tensor:
    """DPPO's ``valid`` mask, bool ``[B, T]`` (§13); one-sided by the sign of ``A`` (``[B]`` or ``[B, T]``).

    With ``p = exp(logp)``, ``p_a = exp(anchor_logp)`` (both detached):
    ``tv``: ``p - p_a <= delta_high`` if ``A > 0`` else ``p - p_a >= -delta_low`` (a token on
    the threshold is kept, as verl and prime-rl). ``binary_kl``: with
    ``D = p_a (log p_a - log p) + (1 - p_a) log((1 - p_a + 1e-8) / (1 - p + 1e-8))``,
    ``(D <= delta_high) | (p <= p_a)`` if ``A > 0`` else ``(D <= delta_low) | (p >= p_a)``.
    """
    if divergence not in DPPO_DIVERGENCES:
        raise ValueError(f"divergence must be one of {list(DPPO_DIVERGENCES)}, got {divergence!r}")
    lp = logp.detach()
    la = anchor_logp.detach().to(lp.dtype)
    adv = _token_advantages(advantages, lp)
    p, pa = torch.exp(lp), torch.exp(la)
    pos = adv > 0
    if divergence == "tv":
        diff = p - pa
        return torch.where(pos, diff <= delta_high, diff >= -delta_low)
    d = pa * (la - lp) + (1 - pa) * torch.log((1 - pa + BINARY_KL_EPS) / (1 - p + BINARY_KL_EPS))
    return torch.where(pos, (d <= delta_high) | (p <= pa), (d <= delta_low) | (p >= pa))


@register_policy_loss("dppo", params=DppoParams)
def dppo_objective(inputs: PolicyInputs, norm: StepNormalizer) -> PolicyTerm:
    """DPPO, Divergence PPO (arXiv:2602.04879; ALGORITHMS.md §13): verl ``dppo_tv``/``dppo_kl``, prime-rl.

    Per token, with ``r = exp(clamp(logp - logp_anchor, -20, 20))``:
    ``l = -A * valid * r * sg(min(r, C) / r)``: value ``-A * min(r, C)`` (``-A`` at ``r = 1``,
    as PPO), gradient ``-A * min(r, C) * valid * grad logp`` (verl's; prime-rl's for ``C = inf``
    and the behaviour anchor). The weight is computed as ``sg(min(r, C)) * exp(logp - sg(logp))``,
    whose gradient is that of verl's ``-A * sg(trunc_ratio) * logp``: the clamp only keeps
    ``exp`` finite, and a token past it still gets the gradient ``-A * min(e^(+/-20), C)``,
    not the 0 of the clamped ratio's own derivative. ``valid`` is
    :func:`dppo_trust_region_mask` against the anchor; a masked token has exactly zero
    gradient and still counts in the denominator. No KL term is built in (the step's KL
    options add one).

    The anchor is ``old_logp`` or, with ``anchor="behaviour"``, ``behaviour_logp`` for both the
    mask and the ratio (a ValueError when the sampler's log-probs are missing). Shapes:
    ``[B, T]`` log-probs and masks, ``[B]`` advantages; returns the unaggregated ``[B, T]``
    term (``policy_mask``, xDr row weights), aggregated by any ``loss_type``. Metrics (token
    means): ``dppo/masked_frac`` (``1 - valid``), ``dppo/masked_high_frac`` (masked, ``A > 0``),
    ``dppo/masked_low_frac`` (masked, ``A < 0``, as prime-rl: masked ``A = 0`` tokens count
    only in the total), ``dppo/is_truncated_frac`` (``valid & r > C``, verl's repurposed
    ``pg_clipfrac_lower``; 0 without a cap).
    """
    p: DppoParams = _loss_params(inputs, DppoParams)
    check_advantages(inputs.advantages, inputs.logp)
    logp = inputs.logp
    if p.anchor == "behaviour":
        if inputs.behaviour_logp is None:
            raise ValueError("DPPO with anchor='behaviour' needs the sampler's log-probs (behaviour_logp), "
                             "and this micro-batch has none")
        anchor = inputs.behaviour_logp
    else:
        anchor = inputs.old_logp
    cap = p.ratio_cap if p.ratio_cap is not None else inputs.clip.delta
    valid = dppo_trust_region_mask(logp, anchor, inputs.advantages, divergence=p.divergence,
                                   delta_low=p.delta_low, delta_high=p.delta_high)
    r = torch.exp(_clamped_log_ratio(logp, anchor)).detach()
    truncated_ratio = r if cap is None else torch.clamp(r, max=cap)
    # Value min(r, C) (exp(0) = 1), gradient min(r, C) * grad logp, also past the +/-20 clamp.
    weight = truncated_ratio * torch.exp(logp - logp.detach())
    adv = _token_advantages(inputs.advantages, logp)
    per_token = policy_token_term(-adv * torch.where(valid, weight, torch.zeros_like(weight)), inputs)
    mask = inputs.mask.to(logp.dtype)
    masked = (~valid).to(logp.dtype)
    truncated = torch.zeros_like(masked) if cap is None else (valid & (r > cap)).to(logp.dtype)
    metrics = {
        "dppo/masked_frac": LossMetric(_token_total(masked, mask), "token"),
        "dppo/masked_high_frac": LossMetric(_token_total(masked * (adv > 0), mask), "token"),
        "dppo/masked_low_frac": LossMetric(_token_total(masked * (adv < 0), mask), "token"),
        "dppo/is_truncated_frac": LossMetric(_token_total(truncated, mask), "token"),
        # The trust-region mask is DPPO's clip: the clip_ratio/* keys every run logs carry it (verl's
        # pg_clipfrac is the masked fraction too), low for A < 0, high for A > 0, region either.
        "clip_ratio/low_mean": LossMetric(_token_total(masked * (adv < 0), mask), "token"),
        "clip_ratio/high_mean": LossMetric(_token_total(masked * (adv > 0), mask), "token"),
        "clip_ratio/region_mean": LossMetric(_token_total(masked * (adv != 0), mask), "token"),
    }
    return PolicyTerm(per_token, per_token.new_zeros(()), metrics)


# ----- OPSM (§14)


@dataclass(frozen=True)
class OpsmParams:
    """OPSM's threshold (§14): a sequence with ``A_i < 0`` and mean per-token drift ``KL_i > delta``
    is dropped. Must be finite; 0 is allowed (a negative value would drop on-policy rows,
    ``KL = 0``, with ``A < 0``). Default ``1e-4``, slime's ``--opsm-delta`` (the config's
    ``opsm_delta: None`` means: do not select this loss); TRL's docs suggest e.g. 0.5."""

    delta: float = 1e-4

    def __post_init__(self) -> None:
        require(math.isfinite(self.delta), "delta",
                f"must be finite (OPSM's KL threshold; 0 is allowed), got {self.delta}")


def opsm_sequence_mask(
    logp: torch.Tensor, anchor_logp: torch.Tensor, advantages: torch.Tensor, mask: torch.Tensor, delta: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """OPSM's keep mask ``M`` (bool ``[B]``) and detached ``KL`` (``[B]``) (§14).

    ``KL_i = sum_t m (logp_anchor - sg(logp)) / max(L_i, 1)`` (a k1 estimate: may be negative;
    0 for an empty row); ``M_i = not (A_i < 0 and KL_i > delta)``: ``A = 0`` and ``KL == delta``
    are kept (TRL's ``get_off_policy_mask``, slime's ``compute_opsm_mask``).
    """
    check_advantages(advantages, logp)
    on = mask > 0
    diff = anchor_logp.detach().to(logp.dtype) - logp.detach()
    kl = torch.where(on, diff, torch.zeros_like(diff)).sum(-1) / on.sum(-1).clamp(min=1).to(logp.dtype)
    dropped = (advantages.to(logp.dtype) < 0) & (kl > delta)
    return ~dropped, kl


@register_policy_loss("opsm", params=OpsmParams)
def opsm_objective(inputs: PolicyInputs, norm: StepNormalizer) -> PolicyTerm:
    """OPSM, off-policy sequence masking (DeepSeek-V3.2, arXiv:2512.02556, Eq. 9; ALGORITHMS.md §14).

    The PPO clipped surrogate (§3, ``inputs.clip``, exactly as ``clipped_surrogate``) times the
    sequence mask ``M_i`` of :func:`opsm_sequence_mask`, whose anchor is the sampler's
    ``behaviour_logp`` when given, else ``old_logp`` (TRL, the paper). A dropped row has zero
    gradient and keeps its tokens in every denominator; ``M`` commutes with the step's
    rollout-correction weight. Synchronous with sampler == trainer, the first micro-step has
    ``KL = 0``: nothing is dropped when ``delta >= 0``.

    Shapes: ``[B, T]`` log-probs and masks, ``[B]`` advantages; returns the unaggregated
    ``[B, T]`` term (``policy_mask``, xDr row weights), aggregated by any ``loss_type``.
    Metrics: ``opsm/masked_seq_frac`` (dropped rows with ``L_i > 0``; ``per="sequence"``, so the
    step divides by *all* its rows, empty ones included, not by the spec's rows with
    ``L_i > 0``), ``opsm/masked_token_frac`` (tokens of dropped rows, token mean),
    ``opsm/seq_kl_mean`` (``KL_i``, same sequence denominator; an empty row adds 0), and
    the ``clip_ratio/*`` fractions of the surrogate. The spec's ``opsm/seq_kl_max`` is not
    logged: the step only sums loss metrics over micro-batches and ranks.
    """
    p: OpsmParams = _loss_params(inputs, OpsmParams)
    terms = ppo_clip_terms(inputs.logp, inputs.old_logp, inputs.advantages, inputs.mask, inputs.clip)
    anchor = inputs.old_logp if inputs.behaviour_logp is None else inputs.behaviour_logp
    keep, kl = opsm_sequence_mask(inputs.logp, anchor, inputs.advantages, inputs.mask, p.delta)
    loss = terms.per_token_loss
    per_token = policy_token_term(torch.where(keep[:, None], loss, torch.zeros_like(loss)), inputs)
    mask = inputs.mask.to(per_token.dtype)
    dropped = ~keep
    metrics = {
        "opsm/masked_seq_frac": LossMetric((dropped & (mask.sum(-1) > 0)).sum().to(per_token.dtype), "sequence"),
        "opsm/masked_token_frac": LossMetric(_token_total(dropped[:, None].expand_as(mask).to(mask.dtype), mask),
                                             "token"),
        "opsm/seq_kl_mean": LossMetric(kl.sum().to(per_token.dtype), "sequence"),
        **clip_metrics(terms, per_token),
    }
    return PolicyTerm(per_token, per_token.new_zeros(()), metrics)
