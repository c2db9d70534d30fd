"""Per-token policy losses, KL estimators and aggregation (ALGORITHMS.md §3); the listwise losses
(§4) are in ``listwise.py``, the entropy terms in ``entropy_terms.py``, the peers' losses in ``peer_losses.py``.

Every aggregator returns one micro-batch's *contribution* to the optimizer
step's loss, normalised by the whole step's counts (``StepNormalizer``), so the
step loss is the plain sum of contributions over micro-batches and ranks. That
is what makes ``dapo``, ``dr_grpo``, ``grpo`` and the listwise losses invariant
to how the step is split; ``bnpo`` is defined per micro-batch and is not.

Masks are float ``[B, T]`` tensors of 0/1 (``completion_mask``); ``T_i`` is a
row's mask sum. Rows with ``T_i = 0`` (empty completions) contribute 0.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch

from maxent_grpo.core.bounds import require

# ---------------------------------------------------------------- KL estimators
# d = logp_ref - logp (Schulman's estimators of KL(pi || pi_ref)).


def _k1(d: torch.Tensor) -> torch.Tensor:
    return -d


def _k2(d: torch.Tensor) -> torch.Tensor:
    return 0.5 * d * d


def _k3(d: torch.Tensor) -> torch.Tensor:
    # expm1 keeps precision where exp(d) - 1 would cancel (d near 0, the common case).
    return torch.expm1(d) - d


KL_ESTIMATORS: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {"k1": _k1, "k2": _k2, "k3": _k3}


def check_kl_estimator(estimator: str) -> None:
    require(estimator in KL_ESTIMATORS, "kl_estimator", f"must be one of {sorted(KL_ESTIMATORS)}, got {estimator!r}")


def kl_penalty(logp: torch.Tensor, ref_logp: torch.Tensor, estimator: str = "k3") -> torch.Tensor:
    """Per-token KL estimate ``[B, T]`` with ``d = ref_logp - logp``."""
    check_kl_estimator(estimator)
    if ref_logp.shape != logp.shape:
        raise ValueError(f"ref_logp shape {tuple(ref_logp.shape)} does not match logp {tuple(logp.shape)}")
    return KL_ESTIMATORS[estimator](ref_logp.to(logp.dtype) - logp)


# ------------------------------------------------------------ clipped surrogate

IMPORTANCE_SAMPLING_LEVELS = ("token", "sequence")


@dataclass(frozen=True)
class ClipSettings:
    """The trust region of the ratio surrogates (§3): ``clip(r, 1 - epsilon_low, 1 + epsilon_high)``.

    ``delta`` caps the unclipped branch (``min(r, delta) * A``); ``dual_clip`` ``c0`` bounds
    the loss of ``A < 0`` tokens by ``-c0 * A``. The bounds are checked here and nowhere else.
    """

    epsilon_low: float = 0.2
    epsilon_high: float = 0.2
    delta: float | None = None
    dual_clip: float | None = None
    importance_sampling_level: str = "token"

    def __post_init__(self) -> None:
        require(0 < self.epsilon_low < 1, "epsilon_low",
                f"must be in (0, 1) (the ratio's lower clip is 1 - epsilon), got {self.epsilon_low}")
        require(self.epsilon_high > 0, "epsilon_high", f"must be > 0, got {self.epsilon_high}")
        require(self.delta is None or self.delta > 1 + self.epsilon_high, "delta",
                f"must be > 1 + epsilon_high = {1 + self.epsilon_high} (it caps the ratio above the clip), "
                f"got {self.delta}")
        require(self.dual_clip is None or self.dual_clip > 1, "dual_clip", f"must be > 1, got {self.dual_clip}")
        require(self.importance_sampling_level in IMPORTANCE_SAMPLING_LEVELS, "importance_sampling_level",
                f"must be one of {list(IMPORTANCE_SAMPLING_LEVELS)}, got {self.importance_sampling_level!r}")


@dataclass(frozen=True)
class SurrogateTerms:
    """Output of ``clipped_surrogate``; masks are bool ``[B, T]`` (already ANDed with the token mask)."""

    per_token_loss: torch.Tensor
    ratio: torch.Tensor
    low_clipped: torch.Tensor
    high_clipped: torch.Tensor
    region_clipped: torch.Tensor


def sequence_mean(values: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """``[B]`` masked mean over tokens; 0 for rows with no tokens."""
    return (values * mask).sum(-1) / mask.sum(-1).clamp(min=1)


def importance_ratio(logp: torch.Tensor, old_logp: torch.Tensor, mask: torch.Tensor, level: str) -> torch.Tensor:
    """Ratio ``[B, T]`` whose value and gradient the surrogate uses.

    ``token``: ``exp(logp - old)``. ``sequence`` (GSPO-token form):
    ``sg[s_i] * exp(logp - sg[logp])`` with ``s_i = exp(masked mean_t(logp - old))``.
    Its value is ``s_i`` on every token and the gradient of token ``t`` flows
    only through that token's own log-prob, scaled by ``s_i``. With a per-sequence
    advantage this gives the same gradient as differentiating ``s_i`` itself
    (TRL), except that tokens dropped from the policy term (top-entropy mask)
    get no gradient here, where TRL would still reach them through the mean.
    """
    log_ratio = logp - old_logp.to(logp.dtype)
    if level == "token":
        return torch.exp(log_ratio)
    seq = torch.exp(sequence_mean(log_ratio.detach(), mask))
    return seq[:, None] * torch.exp(logp - logp.detach())


def kl_importance_weight(logp: torch.Tensor, old_logp: torch.Tensor, mask: torch.Tensor, level: str) -> torch.Tensor:
    """``rho`` ``[B, T]`` of the importance-weighted KL term (ALGORITHMS.md §19, DeepSeek-V3.2 arXiv 2512.02556,
    TRL's ``use_bias_correction_kl``): ``exp(logp - old)`` per token, or per sequence
    ``exp(masked mean_t(logp - old))`` broadcast over its tokens, as TRL does. It carries gradient (not
    detached), so ``beta * rho * kl`` changes the KL gradient even on-policy, where its value is 1:
    ``d(rho kl)/dlogp = d kl/dlogp + kl``."""
    log_ratio = logp - old_logp.to(logp.dtype)
    if level == "token":
        return torch.exp(log_ratio)
    return torch.exp(sequence_mean(log_ratio, mask))[:, None].expand_as(logp)


def check_advantages(advantages: torch.Tensor, logp: torch.Tensor) -> None:
    if advantages.dim() != 1 or advantages.shape[0] != logp.shape[0]:
        raise ValueError(f"advantages must be [B={logp.shape[0]}], got shape {tuple(advantages.shape)}")


def clipped_surrogate(
    logp: torch.Tensor,
    old_logp: torch.Tensor,
    advantages: torch.Tensor,
    *,
    mask: torch.Tensor,
    epsilon_low: float = 0.2,
    epsilon_high: float = 0.2,
    delta: float | None = None,
    dual_clip: float | None = None,
    importance_sampling_level: str = "token",
) -> SurrogateTerms:
    """PPO clipped surrogate, per token: ``-min(c*A, clip(c, 1-eps_low, 1+eps_high)*A)`` for both signs of A
    (:class:`ClipSettings` for ``delta`` and ``dual_clip``).

    Clip masks follow TRL: low = ``A<0 & c<1-eps_low``, high = ``A>0 & c>1+eps_high``,
    region = either. ``per_token_loss`` is not masked (aggregators multiply by the mask).
    """
    clip = ClipSettings(epsilon_low, epsilon_high, delta, dual_clip, importance_sampling_level)
    return ppo_clip_terms(logp, old_logp, advantages, mask, clip)


def ppo_clip_terms(logp, old_logp, advantages, mask, clip: ClipSettings) -> SurrogateTerms:
    check_advantages(advantages, logp)
    ratio = importance_ratio(logp, old_logp, mask, clip.importance_sampling_level)
    adv = advantages.to(logp.dtype)[:, None]
    unclipped = ratio if clip.delta is None else torch.clamp(ratio, max=clip.delta)
    clipped = torch.clamp(ratio, 1 - clip.epsilon_low, 1 + clip.epsilon_high)
    objective = torch.minimum(unclipped * adv, clipped * adv)
    if clip.dual_clip is not None:
        objective = torch.where(adv < 0, torch.maximum(objective, clip.dual_clip * adv), objective)
    on = mask > 0
    r = ratio.detach()
    low = on & (adv < 0) & (r < 1 - clip.epsilon_low)
    high = on & (adv > 0) & (r > 1 + clip.epsilon_high)
    return SurrogateTerms(-objective, r, low, high, low | high)


def cispo_surrogate(
    logp: torch.Tensor,
    old_logp: torch.Tensor,
    advantages: torch.Tensor,
    *,
    mask: torch.Tensor,
    epsilon_max: float,
    importance_sampling_level: str = "token",
) -> SurrogateTerms:
    """CISPO (MiniMax-M1, arXiv:2506.13585; ScaleRL), per token: ``-sg(min(r, eps_max)) * A * logp``.

    The importance weight is truncated and detached, so, unlike the PPO clip, no token
    loses its gradient: every token moves along ``A * grad logp`` scaled by its capped
    weight. ``epsilon_max`` is the absolute cap on ``r`` (``loss.epsilon_high``; TRL,
    verl and EasyDeL use 5). ``high_clipped`` marks ``A > 0`` tokens with ``r > eps_max``
    (TRL's ``cispo_clip_ratio``); nothing is clipped below.
    """
    check_advantages(advantages, logp)
    r = importance_ratio(logp, old_logp, mask, importance_sampling_level).detach()
    adv = advantages.to(logp.dtype)[:, None]
    per_token = -torch.clamp(r, max=epsilon_max) * adv * logp
    on = mask > 0
    high = on & (adv > 0) & (r > epsilon_max)
    return SurrogateTerms(per_token, r, torch.zeros_like(high), high, high)


# ------------------------------------------------------------------ aggregation


@dataclass(frozen=True)
class StepNormalizer:
    """Counts over the whole optimizer step: all micro-batches on all ranks.

    ``num_sequences`` counts every row (empty completions included),
    ``num_tokens`` the active completion tokens, ``num_groups`` the active
    listwise groups; ``max_completion_length`` is only needed by ``dr_grpo``.
    """

    num_sequences: int
    num_tokens: int
    num_micro_batches: int
    max_completion_length: int | None = None
    num_groups: int = 0

    def __post_init__(self) -> None:
        counts = {
            "num_sequences": self.num_sequences,
            "num_tokens": self.num_tokens,
            "num_micro_batches": self.num_micro_batches,
            "num_groups": self.num_groups,
        }
        for name, value in counts.items():
            if value < 0:
                raise ValueError(f"{name} must be >= 0, got {value}")


def _row_sums(per_token: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    return (per_token * mask).sum(-1)


def aggregate_grpo(per_token: torch.Tensor, mask: torch.Tensor, norm: StepNormalizer) -> torch.Tensor:
    """``sum_i (S_i / T_i) / num_sequences``: mean over sequences of per-sequence token means."""
    return sequence_mean(per_token, mask).sum() / max(norm.num_sequences, 1)


def aggregate_bnpo(per_token: torch.Tensor, mask: torch.Tensor, norm: StepNormalizer) -> torch.Tensor:
    """``(sum_i S_i / sum_i T_i over this micro-batch) / num_micro_batches``; depends on the split."""
    return _row_sums(per_token, mask).sum() / mask.sum().clamp(min=1) / max(norm.num_micro_batches, 1)


def aggregate_dr_grpo(per_token: torch.Tensor, mask: torch.Tensor, norm: StepNormalizer) -> torch.Tensor:
    """``sum_i S_i / (num_sequences * L_max)``: a constant normaliser (Dr.GRPO); ``L_max`` is
    ``norm.max_completion_length`` (:func:`check_aggregation` requires it)."""
    return _row_sums(per_token, mask).sum() / (max(norm.num_sequences, 1) * norm.max_completion_length)


def aggregate_dapo(per_token: torch.Tensor, mask: torch.Tensor, norm: StepNormalizer) -> torch.Tensor:
    """``sum_i S_i / num_tokens``, the step's active token count (DAPO token-level mean)."""
    return _row_sums(per_token, mask).sum() / max(norm.num_tokens, 1)


def aggregate_luspo(per_token: torch.Tensor, mask: torch.Tensor, norm: StepNormalizer) -> torch.Tensor:
    """``sum_i S_i / num_sequences``: each sequence's loss summed over its tokens, then the mean over the
    step's sequences (LUSPO, arXiv 2602.05261; ALGORITHMS.md §21): a sequence weighs in proportion to its
    length, where ``grpo``'s per-sequence mean weighs every sequence the same."""
    return _row_sums(per_token, mask).sum() / max(norm.num_sequences, 1)


Aggregator = Callable[[torch.Tensor, torch.Tensor, StepNormalizer], torch.Tensor]

LOSS_AGGREGATIONS: dict[str, Aggregator] = {
    "grpo": aggregate_grpo,
    "bnpo": aggregate_bnpo,
    "dr_grpo": aggregate_dr_grpo,
    "dapo": aggregate_dapo,
    "luspo": aggregate_luspo,
}


def check_aggregation(loss_type: str, max_completion_length: int | None) -> None:
    """The bounds of an aggregation: a known ``loss_type``; ``L_max >= 1``, and given for ``dr_grpo``."""
    require(loss_type in LOSS_AGGREGATIONS, "loss_type",
            f"must be one of {sorted(LOSS_AGGREGATIONS)}, got {loss_type!r}")
    require(max_completion_length is None or max_completion_length >= 1, "max_completion_length",
            f"must be >= 1, got {max_completion_length}")
    require(loss_type != "dr_grpo" or max_completion_length is not None, "max_completion_length",
            "is required for loss_type='dr_grpo'")


def aggregate(per_token: torch.Tensor, mask: torch.Tensor, loss_type: str, norm: StepNormalizer) -> torch.Tensor:
    """The micro-batch's contribution of ``per_token`` under ``loss_type``."""
    check_aggregation(loss_type, norm.max_completion_length)
    return LOSS_AGGREGATIONS[loss_type](per_token, mask.to(per_token.dtype), norm)


# ------------------------------------------------------ policy objective registry
# verl's core_algos registry: a policy loss is one registered function; its own settings
# are one frozen record (``params``), and it returns its own metrics (verl's pg_metrics).


@dataclass(frozen=True)
class PolicyInputs:
    """What a policy objective sees for one micro-batch.

    ``policy_mask`` is the completion mask times the top-entropy mask: the
    tokens the per-token policy term applies to. ``row_weights`` (xDr) scale
    that per-token term only. Listwise tensors are rows group-major, ``[B]`` and
    ``[B // num_generations]``. ``behaviour_logp`` (``[B, T]``) are the sampler's
    log-probs when it returned them; ``params`` is the loss's own settings record.
    ``correction_weights`` (``[B, T]``, detached) is the rollout-correction weight ``w``
    (§9, §15) at ``correction_level`` (``"token"`` or ``"sequence"``: one weight per row),
    given only to a loss registered with ``applies_correction`` (the step multiplies
    ``w`` into every other loss's per-token term); None: no correction.
    """

    logp: torch.Tensor
    old_logp: torch.Tensor
    mask: torch.Tensor
    policy_mask: torch.Tensor
    advantages: torch.Tensor
    num_generations: int
    clip: ClipSettings
    row_weights: torch.Tensor | None = None
    listwise_weights: torch.Tensor | None = None
    listwise_active: torch.Tensor | None = None
    behaviour_logp: torch.Tensor | None = None
    params: object | None = None
    correction_weights: torch.Tensor | None = None
    correction_level: str = "token"


@dataclass(frozen=True)
class LossMetric:
    """One micro-batch's share of a loss metric: ``total`` (a scalar summed over the micro-batch)
    is summed over the step and the ranks, then divided by the step's active tokens
    (``per="token"``) or sequences (``per="sequence"``)."""

    total: torch.Tensor
    per: str


@dataclass(frozen=True)
class PolicyTerm:
    """A policy objective's output.

    ``per_token_loss`` ``[B, T]`` (zero where the objective has no token term)
    is aggregated by ``loss_type`` together with the KL term;
    ``sequence_loss`` is a scalar step contribution already normalised.
    ``metrics``: the same keys on every call of one loss (they are reduced over ranks by position).
    """

    per_token_loss: torch.Tensor
    sequence_loss: torch.Tensor
    metrics: dict[str, LossMetric]


PolicyLossFn = Callable[[PolicyInputs, StepNormalizer], PolicyTerm]


@dataclass(frozen=True)
class PolicyLoss:
    """A registered policy loss: its function, the type of its settings record (None: it has
    none), the ``loss_type`` aggregations it is defined for (None: any), and whether it applies
    the rollout-correction weight itself (``PolicyInputs.correction_weights``; a sequence-level
    loss such as GMPO folds token weights into one row weight) rather than the step
    multiplying it into the per-token term."""

    fn: PolicyLossFn
    params: type | None = None
    loss_types: tuple[str, ...] | None = None
    applies_correction: bool = False

    def __call__(self, inputs: PolicyInputs, norm: StepNormalizer) -> PolicyTerm:
        return self.fn(inputs, norm)


POLICY_LOSSES: dict[str, PolicyLoss] = {}


def register_policy_loss(name: str, params: type | None = None, loss_types: tuple[str, ...] | None = None,
                         applies_correction: bool = False):
    """Decorator: register ``fn`` as the policy loss ``name`` (:class:`PolicyLoss` for the options)."""

    def add(fn: PolicyLossFn) -> PolicyLossFn:
        if name in POLICY_LOSSES:
            raise ValueError(f"policy loss {name!r} is registered twice")
        POLICY_LOSSES[name] = PolicyLoss(fn, params, loss_types, applies_correction)
        return fn

    return add


def clip_metrics(terms: SurrogateTerms | None, like: torch.Tensor) -> dict[str, LossMetric]:
    """The clip fractions of a ratio surrogate (zeros without one)."""
    zero = like.new_zeros(())
    sums = (zero, zero, zero) if terms is None else (
        terms.low_clipped.sum(), terms.high_clipped.sum(), terms.region_clipped.sum()
    )
    names = ("clip_ratio/low_mean", "clip_ratio/high_mean", "clip_ratio/region_mean")
    return {n: LossMetric(v.to(like.dtype), "token") for n, v in zip(names, sums)}


def policy_token_term(per_token: torch.Tensor, inputs: PolicyInputs) -> torch.Tensor:
    """Restrict a per-token loss to the policy tokens and scale it by the xDr row weights."""
    per_token = per_token * inputs.policy_mask
    if inputs.row_weights is not None:
        per_token = per_token * inputs.row_weights.detach().to(per_token.dtype)[:, None]
    return per_token


@register_policy_loss("clipped_surrogate")
def clipped_surrogate_objective(inputs: PolicyInputs, norm: StepNormalizer) -> PolicyTerm:
    terms = ppo_clip_terms(inputs.logp, inputs.old_logp, inputs.advantages, inputs.mask, inputs.clip)
    per_token = policy_token_term(terms.per_token_loss, inputs)
    return PolicyTerm(per_token, per_token.new_zeros(()), clip_metrics(terms, per_token))


@register_policy_loss("cispo")
def cispo_objective(inputs: PolicyInputs, norm: StepNormalizer) -> PolicyTerm:
    c = inputs.clip
    terms = cispo_surrogate(inputs.logp, inputs.old_logp, inputs.advantages, mask=inputs.mask,
                            epsilon_max=c.epsilon_high, importance_sampling_level=c.importance_sampling_level)
    per_token = policy_token_term(terms.per_token_loss, inputs)
    return PolicyTerm(per_token, per_token.new_zeros(()), clip_metrics(terms, per_token))
