"""MaxEnt-GRPO reward statistics, listwise weights and controllers: the public face.

The names follow the seed page ``maxent_grpo.rewards.maxent``; the arithmetic
lives in ``maxent_grpo.core`` (advantages, weighting, seed_grpo,
reward_entropy, controllers) and is not repeated here. Tensors are flat
``[N]`` (prompt-major, ``N = P * G``) or grouped ``[P, G]``.

A reward of ``NaN`` marks a completion for which every reward function returned
``None``: it gets advantage 0, is left out of its group's statistics, and
counts as reward 0 in the q-distribution.
"""

from __future__ import annotations

import math
import os
from collections.abc import Sequence
from dataclasses import dataclass, field, replace

import torch

from maxent_grpo.core import controllers as ctl
from maxent_grpo.core.advantages import (
    SCALE_REWARDS,
    combine_rewards,
    compute_advantages,
    group_reward_std,
    zero_std_groups,
    zero_truncated_rewards,
)
from maxent_grpo.core.controllers import (
    ControllerMetaSettings,
    ControllerSettings,
    ControllerState,
    KlControllerSettings,
    TauSchedule,
)
from maxent_grpo.core.reward_entropy import entropy_bonus_rewards
from maxent_grpo.core.seed_grpo import seed_grpo_scales
from maxent_grpo.core.weighting import listwise_weights, q_distribution, weight_entropy

__all__ = [
    "CONTROLLER_STATE_FILENAME",
    "WeightNormalizationSettings",
    "QDistributionSettings",
    "TauSchedule",
    "KlControllerSettings",
    "ControllerMetaSettings",
    "ControllerState",
    "WeightingSettings",
    "ReferenceLogprobs",
    "SeedGrpoInputs",
    "RewardStatsSettings",
    "RewardComputation",
    "WeightStats",
    "WeightLoggingView",
    "compute_reward_statistics",
    "apply_policy_entropy_bonus",
    "reward_moments",
    "group_advantages",
    "weight_vector_from_q",
    "weight_matrix_from_q",
    "compute_weight_stats",
    "collect_weight_entropy",
    "build_uniform_weight_stats",
    "split_reference_logprobs",
    "split_reference_token_counts",
    "maybe_update_tau",
    "maybe_update_beta",
    "apply_meta_controller_update",
    "controller_state_dict",
    "save_controller_state",
    "load_controller_state",
    "broadcast_controller_state",
    "restore_controller_state",
]

CONTROLLER_STATE_FILENAME = "controller_state.json"


def _grouped(name: str, flat: torch.Tensor, num_generations: int) -> torch.Tensor:
    if flat.dim() != 1 or flat.shape[0] % num_generations != 0:
        raise ValueError(
            f"{name} must be [N] with N a multiple of num_generations={num_generations}, got shape {tuple(flat.shape)}"
        )
    return flat.view(-1, num_generations)


def _check_num_generations(num_generations: int) -> None:
    if isinstance(num_generations, bool) or not isinstance(num_generations, int) or num_generations < 2:
        raise ValueError(f"num_generations must be an int >= 2 (a group is needed), got {num_generations!r}")


# ---------------------------------------------------------------- settings


@dataclass(frozen=True)
class WeightNormalizationSettings:
    len_norm_ref: bool = True


@dataclass(frozen=True)
class QDistributionSettings:
    temperature: float = 1.0
    epsilon: float = 1e-6

    def __post_init__(self) -> None:
        if not (math.isfinite(self.temperature) and self.temperature > 0):
            raise ValueError(f"q_distribution.temperature must be a finite number > 0, got {self.temperature}")
        if not (math.isfinite(self.epsilon) and self.epsilon >= 0):
            raise ValueError(f"q_distribution.epsilon must be a finite number >= 0, got {self.epsilon}")


@dataclass
class WeightingSettings:
    """Listwise weighting hyperparameters and the live controller state.

    ``tau`` and ``beta`` are the live values (the controllers update them in
    place); ``controller_state`` carries the rest (entropy EMA, ``log tau``,
    step, histories) and is kept in step with them. ``train_grpo_objective``
    is a flag for the loop (train the GRPO surrogate instead of the listwise
    loss); it changes no formula here.
    """

    tau: float
    beta: float
    normalization: WeightNormalizationSettings = field(default_factory=WeightNormalizationSettings)
    q_distribution: QDistributionSettings = field(default_factory=QDistributionSettings)
    tau_schedule: TauSchedule = field(default_factory=TauSchedule)
    kl_controller: KlControllerSettings = field(default_factory=KlControllerSettings)
    controller_meta: ControllerMetaSettings = field(default_factory=ControllerMetaSettings)
    train_grpo_objective: bool = False
    scale_rewards: str = "group"
    controller_state: ControllerState | None = None

    def __post_init__(self) -> None:
        if not (math.isfinite(self.tau) and self.tau >= 0):
            raise ValueError(f"tau must be a finite number >= 0, got {self.tau}")
        if not (math.isfinite(self.beta) and self.beta >= 0):
            raise ValueError(f"beta must be a finite number >= 0, got {self.beta}")
        if self.scale_rewards not in SCALE_REWARDS:
            raise ValueError(f"scale_rewards must be one of {list(SCALE_REWARDS)}, got {self.scale_rewards!r}")
        if self.controller_state is None:
            self.controller_state = ControllerState.initial(self.tau, self.beta)
        elif (self.controller_state.tau, self.controller_state.beta) != (self.tau, self.beta):
            raise ValueError(
                f"controller_state (tau={self.controller_state.tau}, beta={self.controller_state.beta}) "
                f"disagrees with tau={self.tau}, beta={self.beta}"
            )

    @property
    def denom(self) -> float:
        """``tau + beta``, the denominator of the listwise softmax."""
        return self.tau + self.beta

    @property
    def len_norm_ref(self) -> bool:
        return self.normalization.len_norm_ref

    @property
    def q_temperature(self) -> float:
        return self.q_distribution.temperature

    @property
    def q_epsilon(self) -> float:
        return self.q_distribution.epsilon

    @property
    def tau_target_entropy(self) -> float | None:
        return self.tau_schedule.target_entropy

    @property
    def tau_lr(self) -> float:
        return self.tau_schedule.lr

    @property
    def tau_min(self) -> float:
        return self.tau_schedule.min

    @property
    def tau_max(self) -> float:
        return self.tau_schedule.max

    @property
    def tau_warmup_steps(self) -> int:
        return self.tau_schedule.warmup_steps

    @property
    def kl_target(self) -> float:
        return self.kl_controller.target

    @property
    def controller_settings(self) -> ControllerSettings:
        return ControllerSettings(self.tau_schedule, self.kl_controller, self.controller_meta)


def _live_state(cfg: WeightingSettings) -> ControllerState:
    """The controller state with ``cfg.tau`` / ``cfg.beta`` (which callers may have set directly)."""
    return cfg.controller_state.with_params(cfg.tau, cfg.beta)


def _commit(cfg: WeightingSettings, state: ControllerState) -> None:
    cfg.controller_state = state
    cfg.tau = state.tau
    cfg.beta = state.beta


# ---------------------------------------------------------------- records


@dataclass(frozen=True)
class ReferenceLogprobs:
    """Reference-model sequence log-probs: ``ref_logp_sum[N]`` summed over each completion's ``ref_tok_counts[N]`` tokens."""

    ref_logp_sum: torch.Tensor
    ref_tok_counts: torch.Tensor

    def __post_init__(self) -> None:
        if self.ref_logp_sum.dim() != 1 or self.ref_tok_counts.shape != self.ref_logp_sum.shape:
            raise ValueError(
                f"ref_logp_sum and ref_tok_counts must both be [N], got {tuple(self.ref_logp_sum.shape)} "
                f"and {tuple(self.ref_tok_counts.shape)}"
            )

    @property
    def ref_logp_per_token(self) -> torch.Tensor:
        """Length-normalised log-probs ``sum / max(T, 1)``."""
        return self.ref_logp_sum / self.ref_tok_counts.to(self.ref_logp_sum.dtype).clamp(min=1)

    @property
    def ref_logp_mean(self) -> float:
        return float(self.ref_logp_per_token.mean())

    @property
    def avg_completion_tokens(self) -> float:
        return float(self.ref_tok_counts.to(torch.float64).mean())


@dataclass(frozen=True)
class SeedGrpoInputs:
    """What SEED-GRPO needs per completion (flat ``[N]``) and its settings.

    ``cluster_ids`` are compared within a group only; a completion with no
    answer must have an id no other completion of its group has.
    ``seq_logps`` are the behaviour policy's summed sequence log-probs.
    """

    cluster_ids: torch.Tensor
    seq_logps: torch.Tensor
    token_counts: torch.Tensor
    alpha: float = 0.0417
    normalize_by_max_entropy: bool = True
    length_normalize: bool = True

    def scales(self, num_generations: int) -> torch.Tensor:
        return seed_grpo_scales(
            _grouped("seed_grpo.cluster_ids", self.cluster_ids, num_generations),
            _grouped("seed_grpo.seq_logps", self.seq_logps, num_generations),
            _grouped("seed_grpo.token_counts", self.token_counts, num_generations),
            alpha=self.alpha,
            normalize_by_max_entropy=self.normalize_by_max_entropy,
            length_normalize=self.length_normalize,
        )


@dataclass(frozen=True)
class RewardStatsSettings:
    q_temperature: float
    q_epsilon: float
    scale_rewards: str = "group"
    advantage_estimator: str = "grpo"


@dataclass(frozen=True)
class RewardComputation:
    """Rewards of one batch and everything derived from them.

    ``total[N]`` is the reward each completion is trained on (after truncation
    zeroing and any entropy bonus; ``NaN`` = no reward applied);
    ``advantages[N]`` already include the SEED scales when SEED is on;
    ``q[P, G]`` is the floored listwise target.
    """

    per_function: torch.Tensor
    reward_names: tuple[str, ...]
    total: torch.Tensor
    advantages: torch.Tensor
    q: torch.Tensor
    group_std: torch.Tensor
    zero_std: torch.Tensor
    seed_scales: torch.Tensor | None
    num_generations: int
    settings: RewardStatsSettings
    seed_grpo: SeedGrpoInputs | None = None
    entropy_bonus: torch.Tensor | None = None

    @property
    def num_prompts(self) -> int:
        return self.q.shape[0]

    @property
    def q_grouped(self) -> torch.Tensor:
        return self.q

    @property
    def advantages_grouped(self) -> torch.Tensor:
        return self.advantages.view(-1, self.num_generations)

    @property
    def frac_zero_std(self) -> float:
        return float(self.zero_std.to(torch.float64).mean())

    @property
    def train_reward_mean(self) -> float:
        return reward_moments(self.total)[0]

    @property
    def train_reward_std(self) -> float:
        return reward_moments(self.total)[1]


def _derived(total: torch.Tensor, num_generations: int, settings: RewardStatsSettings,
             seed: SeedGrpoInputs | None) -> dict[str, torch.Tensor | None]:
    """Advantages, q, group statistics and SEED scales from the final rewards."""
    adv = compute_advantages(total, num_generations, estimator=settings.advantage_estimator,
                             scale_rewards=settings.scale_rewards)
    scales = None
    if seed is not None:
        scales = seed.scales(num_generations).to(adv.dtype)
        adv = (adv.view(-1, num_generations) * scales[:, None]).reshape(-1)
    q_input = torch.nan_to_num(total.view(-1, num_generations), nan=0.0)
    return {
        "advantages": adv,
        "q": q_distribution(q_input, settings.q_temperature, settings.q_epsilon),
        "group_std": group_reward_std(total, num_generations),
        "zero_std": zero_std_groups(total, num_generations),
        "seed_scales": scales,
    }


def compute_reward_statistics(
    per_function: torch.Tensor,
    weights: torch.Tensor | Sequence[float],
    num_generations: int,
    *,
    q_temperature: float,
    q_epsilon: float,
    scale_rewards: str = "group",
    advantage_estimator: str = "grpo",
    truncated: torch.Tensor | None = None,
    zero_truncated_completion_rewards: bool = False,
    seed_grpo: SeedGrpoInputs | None = None,
    names: Sequence[str] | None = None,
) -> RewardComputation:
    """Total rewards, group advantages, q-distribution and (optionally) SEED scales for one batch.

    ``per_function[N, K]`` holds each reward function's value (``NaN`` where it
    returned ``None``), ``weights[K]`` their weights. With
    ``zero_truncated_completion_rewards``, rows flagged in ``truncated[N]`` get
    reward 0.
    """
    _check_num_generations(num_generations)
    if per_function.dim() != 2 or per_function.shape[0] % num_generations != 0:
        raise ValueError(f"per_function must be [N, K] with N a multiple of num_generations={num_generations}, "
                         f"got shape {tuple(per_function.shape)}")
    w = torch.as_tensor(weights, dtype=per_function.dtype, device=per_function.device)
    k = per_function.shape[1]
    names = tuple(names) if names is not None else tuple(f"reward_{i}" for i in range(k))
    if len(names) != k:
        raise ValueError(f"names must hold one name per reward function ({k}), got {len(names)}")
    total = combine_rewards(per_function, w)
    if zero_truncated_completion_rewards:
        if truncated is None:
            raise ValueError("truncated is required when zero_truncated_completion_rewards=True")
        total = zero_truncated_rewards(total, truncated)
    settings = RewardStatsSettings(q_temperature, q_epsilon, scale_rewards, advantage_estimator)
    return RewardComputation(
        per_function=per_function,
        reward_names=names,
        total=total,
        num_generations=num_generations,
        settings=settings,
        seed_grpo=seed_grpo,
        **_derived(total, num_generations, settings, seed_grpo),
    )


def apply_policy_entropy_bonus(
    reward_comp: RewardComputation, mean_token_entropy: torch.Tensor, coef: float
) -> RewardComputation:
    """Add ``coef * sigma_r * z(entropy)`` to the rewards and recompute advantages, q and SEED scales (§6).

    ``mean_token_entropy[N]`` is each completion's mean token entropy.
    ``coef = 0`` returns ``reward_comp`` itself. Applying a bonus twice is an error.
    """
    if coef == 0.0:
        return reward_comp
    if reward_comp.entropy_bonus is not None:
        raise ValueError("reward_comp: the policy entropy bonus has already been applied")
    g = reward_comp.num_generations
    h = _grouped("mean_token_entropy", mean_token_entropy, g)
    if h.shape[0] != reward_comp.num_prompts:
        raise ValueError(f"mean_token_entropy must be [N={reward_comp.total.shape[0]}], got {tuple(mean_token_entropy.shape)}")
    total = entropy_bonus_rewards(reward_comp.total.view(-1, g), h, coef).reshape(-1)
    return replace(
        reward_comp,
        total=total,
        entropy_bonus=total - reward_comp.total,
        **_derived(total, g, reward_comp.settings, reward_comp.seed_grpo),
    )


def reward_moments(total: torch.Tensor) -> tuple[float, float]:
    """Mean and unbiased std of the rewards that were applied (``NaN`` rows left out; std 0 under two values)."""
    known = total[~torch.isnan(total)].to(torch.float64)
    if known.numel() == 0:
        return 0.0, 0.0
    std = float(known.std()) if known.numel() >= 2 else 0.0
    return float(known.mean()), std


def group_advantages(
    rewards: torch.Tensor | Sequence[Sequence[float]],
    *,
    scale_rewards: str = "group",
    estimator: str = "grpo",
) -> tuple[torch.Tensor, torch.Tensor]:
    """Advantages of grouped rewards (``[P, G]`` tensor or equal-length lists): ``(grouped [P, G], flat [N])``."""
    if not isinstance(rewards, torch.Tensor):
        lengths = {len(group) for group in rewards}
        if len(lengths) != 1:
            raise ValueError(f"rewards: ragged groups (sizes {sorted(lengths)}); every group needs the same G")
        rewards = torch.tensor([list(group) for group in rewards], dtype=torch.get_default_dtype())
    if rewards.dim() != 2:
        raise ValueError(f"rewards must be [P, G], got shape {tuple(rewards.shape)}")
    g = rewards.shape[1]
    _check_num_generations(g)
    flat = compute_advantages(rewards.reshape(-1), g, estimator=estimator, scale_rewards=scale_rewards)
    return flat.view(-1, g), flat


# ---------------------------------------------------------------- weights


@dataclass(frozen=True)
class WeightLoggingView:
    """Aggregated entropy statistics for logging (nats; ``entropy_norm`` divides by ``log G``)."""

    entropy: float = 0.0
    entropy_norm: float = 0.0
    entropy_min: float = 0.0
    entropy_max: float = 0.0
    advantage_entropy_mean: float = 0.0
    advantage_entropy_std: float = 0.0


@dataclass(frozen=True)
class WeightStats:
    """Listwise weights of a batch and their entropy diagnostics.

    ``advantage_entropy[N]`` are the listwise advantages ``w_i - 1/G`` (the
    seed's name for them).
    """

    weights_grouped: torch.Tensor
    flat_weights: torch.Tensor
    weight_entropy: float
    weight_entropy_min: float
    weight_entropy_max: float
    advantage_entropy: torch.Tensor

    def logging_view(self) -> WeightLoggingView:
        """This batch's statistics as a :class:`WeightLoggingView` (local; cross-rank reduction is the caller's)."""
        g = self.weights_grouped.shape[1]
        adv = self.advantage_entropy.to(torch.float64)
        return WeightLoggingView(
            entropy=self.weight_entropy,
            entropy_norm=self.weight_entropy / math.log(g) if g > 1 else 0.0,
            entropy_min=self.weight_entropy_min,
            entropy_max=self.weight_entropy_max,
            advantage_entropy_mean=float(adv.mean()),
            advantage_entropy_std=float(adv.std()) if adv.numel() >= 2 else 0.0,
        )


def split_reference_logprobs(ref_stats: ReferenceLogprobs, num_generations: int, len_norm_ref: bool) -> torch.Tensor:
    """Reference sequence log-probs grouped ``[P, G]``, divided by token counts when ``len_norm_ref``."""
    values = ref_stats.ref_logp_per_token if len_norm_ref else ref_stats.ref_logp_sum
    return _grouped("ref_stats.ref_logp_sum", values, num_generations)


def split_reference_token_counts(ref_stats: ReferenceLogprobs, num_generations: int) -> torch.Tensor:
    """Reference token counts grouped ``[P, G]``."""
    return _grouped("ref_stats.ref_tok_counts", ref_stats.ref_tok_counts, num_generations)


def weight_matrix_from_q(
    q_values: torch.Tensor,
    ref_logp: torch.Tensor | None,
    token_counts: torch.Tensor | None,
    weighting_cfg: WeightingSettings,
    *,
    include_reference_term: bool = True,
) -> torch.Tensor:
    """Listwise weights ``[P, G]`` from q (already tempered and floored) and summed reference log-probs.

    The reference term is length-normalised when ``weighting_cfg.len_norm_ref``;
    without it (``include_reference_term=False`` or ``ref_logp=None``) the
    reference is uniform, and the denominator is still ``tau + beta``.
    """
    return listwise_weights(
        q_values,
        weighting_cfg.tau,
        weighting_cfg.beta,
        ref_logp=ref_logp if include_reference_term else None,
        token_counts=token_counts,
        length_normalize=weighting_cfg.len_norm_ref,
    ).detach()


def weight_vector_from_q(
    q_values: torch.Tensor,
    ref_logp: torch.Tensor | None,
    token_counts: torch.Tensor | None,
    weighting_cfg: WeightingSettings,
    *,
    include_reference_term: bool = True,
) -> torch.Tensor:
    """:func:`weight_matrix_from_q` for one group: ``[G]`` in, ``[G]`` out."""
    def row(x: torch.Tensor | None) -> torch.Tensor | None:
        return None if x is None else x.unsqueeze(0)

    return weight_matrix_from_q(row(q_values), row(ref_logp), row(token_counts), weighting_cfg,
                                include_reference_term=include_reference_term).squeeze(0)


def collect_weight_entropy(weights_grouped: torch.Tensor) -> tuple[float, float, float, torch.Tensor]:
    """(mean, min, max) of the per-group weight entropies and the listwise advantages ``w - 1/G`` flat."""
    h = weight_entropy(weights_grouped).to(torch.float64)
    adv = (weights_grouped - 1.0 / weights_grouped.shape[1]).reshape(-1)
    return float(h.mean()), float(h.min()), float(h.max()), adv


def _weight_stats(weights_grouped: torch.Tensor) -> WeightStats:
    mean, lo, hi, adv = collect_weight_entropy(weights_grouped)
    return WeightStats(weights_grouped, weights_grouped.reshape(-1), mean, lo, hi, adv)


def compute_weight_stats(
    reward_comp: RewardComputation,
    ref_stats: ReferenceLogprobs | None,
    weighting_cfg: WeightingSettings,
) -> WeightStats:
    """Listwise weights for the batch from its q and the reference log-probs (detached).

    ``ref_stats`` may be ``None`` only when ``beta = 0`` (no reference model).
    """
    g = reward_comp.num_generations
    ref_logp = token_counts = None
    if weighting_cfg.beta > 0:
        if ref_stats is None:
            raise ValueError("ref_stats is required when beta > 0")
        ref_logp = split_reference_logprobs(ref_stats, g, len_norm_ref=False)
        token_counts = split_reference_token_counts(ref_stats, g)
        if ref_logp.shape != reward_comp.q.shape:
            raise ValueError(f"ref_stats must cover the batch's {reward_comp.total.shape[0]} completions, "
                             f"got {ref_stats.ref_logp_sum.shape[0]}")
    weights = weight_matrix_from_q(reward_comp.q, ref_logp, token_counts, weighting_cfg)
    return _weight_stats(weights)


def build_uniform_weight_stats(num_prompts: int, num_generations: int) -> WeightStats:
    """Uniform ``1/G`` weights, the GRPO-style fallback."""
    if num_prompts < 1 or num_generations < 1:
        raise ValueError(f"num_prompts and num_generations must be >= 1, got {num_prompts}, {num_generations}")
    return _weight_stats(torch.full((num_prompts, num_generations), 1.0 / num_generations))


# ---------------------------------------------------------------- controllers


def maybe_update_tau(
    weighting_cfg: WeightingSettings,
    weight_stats: WeightStats | WeightLoggingView,
    global_step: int,
    lr_scale: float | None = None,
) -> None:
    """Tau controller step toward the target weight entropy, in place (no-op when unconfigured or warming up).

    Pass the globally averaged :class:`WeightLoggingView` in multi-process runs.
    """
    if isinstance(weight_stats, WeightStats):
        entropy = weight_stats.weight_entropy
    elif isinstance(weight_stats, WeightLoggingView):
        entropy = weight_stats.entropy
    else:
        raise ValueError(f"weight_stats must be WeightStats or WeightLoggingView, got {type(weight_stats).__name__}")
    state = ctl.update_tau(_live_state(weighting_cfg), entropy, weighting_cfg.tau_schedule, global_step,
                           1.0 if lr_scale is None else lr_scale)
    _commit(weighting_cfg, state)


def maybe_update_beta(weighting_cfg: WeightingSettings, measured_kl: float) -> None:
    """Adaptive-KL beta step, in place (no-op unless target, horizon and step size are all > 0)."""
    _commit(weighting_cfg, ctl.update_beta(_live_state(weighting_cfg), measured_kl, weighting_cfg.kl_controller))


def apply_meta_controller_update(
    weighting_cfg: WeightingSettings,
    *,
    tau_grad: float | None = None,
    beta_grad: float | None = None,
    lr_scale: float = 1.0,
) -> bool:
    """Meta-controller gradient step on tau / beta, in place; ``True`` when either changed.

    Does nothing (``False``) unless ``controller_meta.enabled``.
    """
    if not weighting_cfg.controller_meta.enabled:
        return False
    before = _live_state(weighting_cfg)
    after = ctl.apply_meta_gradients(before, weighting_cfg.controller_settings, tau_grad=tau_grad,
                                     beta_grad=beta_grad, lr_scale=lr_scale)
    _commit(weighting_cfg, after)
    return (after.tau, after.beta) != (before.tau, before.beta)


def controller_state_dict(weighting_cfg: WeightingSettings) -> dict:
    """JSON-ready snapshot of the controller state."""
    return _live_state(weighting_cfg).to_dict()


def save_controller_state(path: str | os.PathLike[str], weighting_cfg: WeightingSettings) -> None:
    """Write the controller state to ``path`` atomically."""
    ctl.save_controller_state(path, _live_state(weighting_cfg))


def load_controller_state(path: str | os.PathLike[str], weighting_cfg: WeightingSettings) -> bool:
    """Restore the controller state from ``path`` into ``weighting_cfg``; ``False`` when there is no such file.

    A file that exists but is malformed raises ``ValueError``.
    """
    if not os.path.isfile(path):
        return False
    _commit(weighting_cfg, ctl.load_controller_state(path))
    return True


def restore_controller_state(weighting_cfg: WeightingSettings, state: dict) -> None:
    """Restore a snapshot made by :func:`controller_state_dict` (a checkpoint's copy) into ``weighting_cfg``."""
    _commit(weighting_cfg, ControllerState.from_dict(state))


def broadcast_controller_state(weighting_cfg: WeightingSettings) -> None:
    """Give every rank rank 0's controller state (no-op outside a multi-process group). A collective."""
    _commit(weighting_cfg, ctl.broadcast_controller_state(_live_state(weighting_cfg)))
