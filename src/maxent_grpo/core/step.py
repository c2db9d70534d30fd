"""One optimizer step over micro-batches (ALGORITHMS.md §3, §4, §6).

``grpo_step`` is the only function here that touches a model and an optimizer.
It first counts the whole step (tokens, sequences, groups, micro-batches; summed
over ranks), so each micro-batch's loss is its exact share of the step loss;
gradients are accumulated by backward per micro-batch. Under DDP, which
*averages* gradients over ranks, every contribution is multiplied by
``world_size`` so the result is the gradient of the sum.
"""

from __future__ import annotations

from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass
from typing import Callable, Sequence

import torch

from maxent_grpo.core.logprobs import get_per_token_logps_and_entropies
from maxent_grpo.core.losses import (
    IMPORTANCE_SAMPLING_LEVELS,
    KL_ESTIMATORS,
    LOSS_AGGREGATIONS,
    POLICY_LOSSES,
    ClipSettings,
    PolicyInputs,
    StepNormalizer,
    aggregate,
    entropy_bonus,
    kl_penalty,
    top_entropy_mask,
    top_entropy_threshold,
)
from maxent_grpo.core.rollout_correction import (
    ROLLOUT_CORRECTIONS,
    MismatchSums,
    combine_mismatch_sums,
    rollout_correction_weights,
    rollout_mismatch_sums,
)


@dataclass(frozen=True)
class MicroBatch:
    """One forward/backward's rows. Completion tensors are ``[B, T]`` with ``T = L - prompt_length``.

    ``old_logps=None`` means one pass per rollout batch (old = current, detached).
    ``behaviour_logps`` are the sampler's own log-probs: with them the step
    measures the sampler/trainer mismatch and applies ``rollout_correction``.
    ``row_weights`` are xDr multipliers on the policy term; ``listwise_weights``
    (``[B]``, whole groups, group-major) and ``listwise_active`` (``[B // G]``
    bool) feed the listwise losses.
    """

    input_ids: torch.Tensor
    attention_mask: torch.Tensor
    prompt_length: int
    completion_mask: torch.Tensor
    advantages: torch.Tensor
    old_logps: torch.Tensor | None = None
    ref_logps: torch.Tensor | None = None
    row_weights: torch.Tensor | None = None
    listwise_weights: torch.Tensor | None = None
    listwise_active: torch.Tensor | None = None
    behaviour_logps: torch.Tensor | None = None

    def __post_init__(self) -> None:
        if self.input_ids.dim() != 2:
            raise ValueError(f"input_ids must be [B, L], got shape {tuple(self.input_ids.shape)}")
        b, length = self.input_ids.shape
        if self.attention_mask.shape != (b, length):
            raise ValueError(f"attention_mask shape {tuple(self.attention_mask.shape)} != input_ids {(b, length)}")
        if not 1 <= self.prompt_length <= length:
            raise ValueError(f"prompt_length must be in [1, {length}], got {self.prompt_length}")
        bt = (b, length - self.prompt_length)
        tensors = {
            "completion_mask": (self.completion_mask, bt),
            "advantages": (self.advantages, (b,)),
            "old_logps": (self.old_logps, bt),
            "ref_logps": (self.ref_logps, bt),
            "behaviour_logps": (self.behaviour_logps, bt),
            "row_weights": (self.row_weights, (b,)),
            "listwise_weights": (self.listwise_weights, (b,)),
        }
        for name, (value, shape) in tensors.items():
            if value is not None and tuple(value.shape) != shape:
                raise ValueError(f"{name} must have shape {shape}, got {tuple(value.shape)}")
        if self.listwise_active is not None and (
            self.listwise_active.dim() != 1 or self.listwise_active.dtype != torch.bool
        ):
            raise ValueError("listwise_active must be a 1-D bool tensor [B // num_generations]")


@dataclass(frozen=True)
class LossConfig:
    """Loss knobs beyond grpo_step's arguments (EasyDeL's ``loss_config``).

    ``entropy_coef`` is alpha in ``L - alpha * B`` (§6); ``listwise_clip_coef``
    weights the optional clipped term with ``a_i = w_i - 1/G`` for listwise losses.
    ``max_completion_length`` is required by ``loss_type="dr_grpo"``.
    ``rollout_correction`` / ``rollout_correction_cap``: the importance weight
    between the sampler and the trainer's old policy on the per-token policy
    term (``core/rollout_correction.py``); needs behaviour log-probs.
    """

    policy_loss: str = "clipped_surrogate"
    kl_estimator: str = "k3"
    dual_clip: float | None = None
    max_completion_length: int | None = None
    temperature: float = 1.0
    entropy_coef: float = 0.0
    listwise_clip_coef: float = 0.0
    rollout_correction: str = "none"
    rollout_correction_cap: float = 3.0

    def __post_init__(self) -> None:
        if self.policy_loss not in POLICY_LOSSES:
            raise ValueError(f"policy_loss must be one of {sorted(POLICY_LOSSES)}, got {self.policy_loss!r}")
        if self.kl_estimator not in KL_ESTIMATORS:
            raise ValueError(f"kl_estimator must be one of {sorted(KL_ESTIMATORS)}, got {self.kl_estimator!r}")
        if self.dual_clip is not None and self.dual_clip <= 1:
            raise ValueError(f"dual_clip must be > 1, got {self.dual_clip}")
        if self.max_completion_length is not None and self.max_completion_length < 1:
            raise ValueError(f"max_completion_length must be >= 1, got {self.max_completion_length}")
        if self.temperature <= 0:
            raise ValueError(f"temperature must be > 0, got {self.temperature}")
        if self.entropy_coef < 0:
            raise ValueError(f"entropy_coef must be >= 0, got {self.entropy_coef}")
        if self.listwise_clip_coef < 0:
            raise ValueError(f"listwise_clip_coef must be >= 0, got {self.listwise_clip_coef}")
        if self.rollout_correction not in ROLLOUT_CORRECTIONS:
            raise ValueError(f"rollout_correction must be one of {list(ROLLOUT_CORRECTIONS)}, got {self.rollout_correction!r}")
        if not self.rollout_correction_cap >= 1:
            raise ValueError(f"rollout_correction_cap must be >= 1, got {self.rollout_correction_cap}")


@dataclass(frozen=True)
class StepResult:
    """``loss`` is the step loss summed over ranks; metrics are global token / step values.

    ``mismatch``: this process's sampler/trainer mismatch statistics (None
    without behaviour log-probs); the caller combines them over ranks.
    """

    loss: float
    grad_norm: float
    metrics: dict[str, float]
    mismatch: MismatchSums | None = None


# Order of the per-step sums that are all-reduced together at the end.
_SUMS = ("loss", "policy_loss", "kl", "entropy", "low", "high", "region", "entropy_bonus")


def _check_arguments(micro_batches, num_generations, beta, loss_type, epsilon, epsilon_high, delta,
                     importance_sampling_level, top_entropy_quantile, gradient_accumulation_steps,
                     cfg: LossConfig, all_reduce_sum, world_size) -> None:
    if len(micro_batches) == 0:
        raise ValueError("micro_batches must not be empty")
    if gradient_accumulation_steps is not None and gradient_accumulation_steps != len(micro_batches):
        raise ValueError(
            f"gradient_accumulation_steps={gradient_accumulation_steps} != len(micro_batches)={len(micro_batches)}"
        )
    if num_generations < 1:
        raise ValueError(f"num_generations must be >= 1, got {num_generations}")
    if beta < 0:
        raise ValueError(f"beta must be >= 0, got {beta}")
    if loss_type not in LOSS_AGGREGATIONS:
        raise ValueError(f"loss_type must be one of {sorted(LOSS_AGGREGATIONS)}, got {loss_type!r}")
    if not 0 < epsilon < 1:
        raise ValueError(f"epsilon must be in (0, 1), got {epsilon}")
    if epsilon_high <= 0:
        raise ValueError(f"epsilon_high must be > 0, got {epsilon_high}")
    if delta is not None and delta <= 1 + epsilon_high:
        raise ValueError(f"delta must be > 1 + epsilon_high = {1 + epsilon_high}, got {delta}")
    if importance_sampling_level not in IMPORTANCE_SAMPLING_LEVELS:
        raise ValueError(
            f"importance_sampling_level must be one of {list(IMPORTANCE_SAMPLING_LEVELS)}, "
            f"got {importance_sampling_level!r}"
        )
    if not 0 < top_entropy_quantile <= 1:
        raise ValueError(f"top_entropy_quantile must be in (0, 1], got {top_entropy_quantile}")
    if world_size < 1:
        raise ValueError(f"world_size must be >= 1, got {world_size}")
    if world_size > 1 and all_reduce_sum is None:
        raise ValueError("all_reduce_sum is required when world_size > 1 (the step's counts must be global)")
    if loss_type == "dr_grpo" and cfg.max_completion_length is None:
        raise ValueError("loss_config.max_completion_length is required for loss_type='dr_grpo'")
    for k, mb in enumerate(micro_batches):
        if cfg.rollout_correction != "none" and mb.behaviour_logps is None:
            raise ValueError(
                f"micro_batches[{k}].behaviour_logps is required by rollout_correction={cfg.rollout_correction!r}"
            )
        if beta > 0 and mb.ref_logps is None:
            raise ValueError(f"micro_batches[{k}].ref_logps is required when beta > 0")
        if cfg.max_completion_length is not None and mb.completion_mask.shape[0] > 0:
            longest = int(mb.completion_mask.sum(-1).max())
            if longest > cfg.max_completion_length:
                raise ValueError(
                    f"micro_batches[{k}] has a completion of {longest} tokens > "
                    f"loss_config.max_completion_length={cfg.max_completion_length}"
                )


def _step_normalizer(micro_batches, cfg: LossConfig, all_reduce_sum, world_size: int) -> StepNormalizer:
    m = len(micro_batches)
    groups = sum(int(mb.listwise_active.sum()) for mb in micro_batches if mb.listwise_active is not None)
    local = [
        sum(int(mb.input_ids.shape[0]) for mb in micro_batches),
        sum(int(mb.completion_mask.sum()) for mb in micro_batches),
        m,
        m * m,
        groups,
    ]
    counts = torch.tensor(local, dtype=torch.float64, device=micro_batches[0].input_ids.device)
    if all_reduce_sum is not None:
        counts = all_reduce_sum(counts)
    seqs, tokens, mbs, mbs_sq, groups = (int(round(float(c))) for c in counts)
    # sum(m)^2 == W * sum(m^2) iff every rank has the same m; unequal counts would
    # leave some rank waiting in a DDP backward forever, so fail on all ranks.
    if mbs * mbs != world_size * mbs_sq:
        raise ValueError(
            f"micro_batches: every rank must run the same number of micro-batches "
            f"(total {mbs} over world_size={world_size} ranks)"
        )
    return StepNormalizer(
        num_sequences=seqs, num_tokens=tokens, num_micro_batches=mbs,
        max_completion_length=cfg.max_completion_length, num_groups=groups,
    )


def optimizer_update(model: torch.nn.Module, optimizer: torch.optim.Optimizer, lr_scheduler,
                     max_grad_norm: float | None) -> torch.Tensor:
    """Clip the gradient norm (when ``max_grad_norm``), step the optimizer and scheduler, zero the
    grads; return the norm before clipping."""
    params = [p for p in model.parameters() if p.grad is not None]
    if max_grad_norm is not None:
        grad_norm = torch.nn.utils.clip_grad_norm_(params, max_grad_norm)
    else:
        grad_norm = torch.nn.utils.get_total_norm([p.grad for p in params])
    optimizer.step()
    if lr_scheduler is not None:
        lr_scheduler.step()
    optimizer.zero_grad()
    return grad_norm


def grpo_step(
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    micro_batches: Sequence[MicroBatch],
    *,
    num_generations: int,
    beta: float = 0.0,
    loss_type: str = "dapo",
    epsilon: float = 0.2,
    epsilon_high: float | None = None,
    delta: float | None = None,
    importance_sampling_level: str = "token",
    top_entropy_quantile: float = 1.0,
    gradient_accumulation_steps: int | None = None,
    loss_config: LossConfig | None = None,
    max_grad_norm: float | None = None,
    lr_scheduler=None,
    all_reduce_sum: Callable[[torch.Tensor], torch.Tensor] | None = None,
    world_size: int = 1,
    share_prompts: bool = True,
    update: Callable[..., torch.Tensor] = optimizer_update,
    gradient_sync: Callable[[bool], AbstractContextManager] | None = None,
) -> StepResult:
    """Forward/backward every micro-batch, clip, step the optimizer and scheduler, zero the grads.

    Per token the loss is ``policy * top_entropy_mask * row_weight + beta * KL``,
    aggregated by ``loss_type`` with the step's global counts; listwise policy
    losses add their group term; ``entropy_coef > 0`` subtracts ``alpha * B``.
    ``all_reduce_sum`` sums a tensor over ranks (in place or not; its return
    value is used); ``model`` is expected to be DDP-wrapped when ``world_size > 1``.
    ``share_prompts``: each distinct prompt of a micro-batch runs once (``completion_logits``).
    ``update(model, optimizer, lr_scheduler, max_grad_norm)`` applies the gradients
    (:func:`optimizer_update`; the trainer passes a timed one: the core keeps no clock).
    ``gradient_sync(is_last)`` is entered around each micro-batch's forward and backward: with
    several processes it turns the gradient reduction off for all but the last (DDP ``no_sync``,
    FSDP2 ``set_requires_gradient_sync``), so gradients cross the network once per step.
    """
    cfg = loss_config if loss_config is not None else LossConfig()
    eps_high = epsilon if epsilon_high is None else epsilon_high
    _check_arguments(micro_batches, num_generations, beta, loss_type, epsilon, eps_high, delta,
                     importance_sampling_level, top_entropy_quantile, gradient_accumulation_steps,
                     cfg, all_reduce_sum, world_size)
    norm = _step_normalizer(micro_batches, cfg, all_reduce_sum, world_size)
    clip = ClipSettings(epsilon, eps_high, delta, cfg.dual_clip, importance_sampling_level)
    policy_loss = POLICY_LOSSES[cfg.policy_loss]
    vocab_size = model.config.get_text_config().vocab_size
    sums = torch.zeros(len(_SUMS), dtype=torch.float64, device=micro_batches[0].input_ids.device)
    mismatch: list[MismatchSums] = []
    ratio_level = "sequence" if cfg.rollout_correction.startswith("sequence") else "token"

    threshold = _step_entropy_threshold(model, micro_batches, top_entropy_quantile, cfg, share_prompts)
    optimizer.zero_grad()
    last = len(micro_batches) - 1
    for i, mb in enumerate(micro_batches):
        # Gradients are reduced over ranks once, in the last micro-batch's backward.
        with nullcontext() if gradient_sync is None else gradient_sync(i == last):
            logp, ent = get_per_token_logps_and_entropies(
                model, mb.input_ids, mb.attention_mask, mb.prompt_length,
                temperature=cfg.temperature, with_entropy=True, share_prompts=share_prompts,
            )
            mask = mb.completion_mask.to(logp.dtype)
            old = logp.detach() if mb.old_logps is None else mb.old_logps
            policy_mask = mask if threshold is None else top_entropy_mask(ent, mask, top_entropy_quantile, threshold)
            term = policy_loss(
                PolicyInputs(
                    logp=logp, old_logp=old, mask=mask, policy_mask=policy_mask,
                    advantages=mb.advantages, num_generations=num_generations, clip=clip,
                    row_weights=mb.row_weights, listwise_weights=mb.listwise_weights,
                    listwise_active=mb.listwise_active, listwise_clip_coef=cfg.listwise_clip_coef,
                ),
                norm,
            )
            per_token_policy = term.per_token_loss
            if mb.behaviour_logps is not None:
                mismatch.append(rollout_mismatch_sums(old, mb.behaviour_logps, mask, level=ratio_level))
                if cfg.rollout_correction != "none":
                    per_token_policy = per_token_policy * rollout_correction_weights(
                        old, mb.behaviour_logps, mask, cfg.rollout_correction, cfg.rollout_correction_cap
                    ).to(per_token_policy.dtype)
            policy_part = aggregate(per_token_policy, mask, loss_type, norm) + term.sequence_loss
            contribution = policy_part
            kl_sum = logp.new_zeros(())
            if mb.ref_logps is not None:
                # Measured whenever a reference is scored (the KL controller and the logs need it),
                # added to the loss only with beta > 0.
                kl = kl_penalty(logp, mb.ref_logps, cfg.kl_estimator)
                if beta > 0:
                    contribution = contribution + aggregate(beta * kl, mask, loss_type, norm)
                kl_sum = (kl.detach() * mask).sum()
            bonus = logp.new_zeros(())
            if cfg.entropy_coef > 0:
                bonus = entropy_bonus(ent, mask, vocab_size, loss_type, norm)
                contribution = contribution - cfg.entropy_coef * bonus
            (contribution * world_size).backward()

            s = term.surrogate
            zero = logp.new_zeros(())
            clip_counts = (zero, zero, zero) if s is None else (
                s.low_clipped.sum(), s.high_clipped.sum(), s.region_clipped.sum()
            )
            values = (contribution, policy_part, kl_sum, (ent * mask).sum(), *clip_counts, bonus)
            sums += torch.stack([v.detach().to(sums.dtype) for v in values])

    if all_reduce_sum is not None:
        sums = all_reduce_sum(sums)
    grad_norm = update(model, optimizer, lr_scheduler, max_grad_norm)
    metrics = _metrics(dict(zip(_SUMS, sums.tolist())), norm, micro_batches[0].ref_logps is not None, cfg,
                       float(grad_norm))
    return StepResult(
        loss=float(sums[0]), grad_norm=float(grad_norm), metrics=metrics,
        mismatch=combine_mismatch_sums(mismatch) if mismatch else None,
    )


def _step_entropy_threshold(model, micro_batches, quantile: float, cfg: LossConfig, share_prompts: bool):
    """The entropy threshold of the step's top ``quantile`` tokens (None: keep all), from a no-grad
    pass over every micro-batch first: the top fraction is of the whole step, not of each
    micro-batch. With several processes each takes the top fraction of its own tokens."""
    if quantile == 1:
        return None
    ents = []
    with torch.no_grad():
        for mb in micro_batches:
            ents.append(get_per_token_logps_and_entropies(
                model, mb.input_ids, mb.attention_mask, mb.prompt_length,
                temperature=cfg.temperature, with_entropy=True, share_prompts=share_prompts,
            )[1])
    return top_entropy_threshold(ents, [mb.completion_mask for mb in micro_batches], quantile)


def _metrics(sums: dict[str, float], norm: StepNormalizer, has_reference: bool, cfg: LossConfig,
             grad_norm: float) -> dict[str, float]:
    tokens = max(norm.num_tokens, 1)
    out = {
        "loss": sums["loss"],
        "policy_loss": sums["policy_loss"],
        "entropy": sums["entropy"] / tokens,
        "clip_ratio/low_mean": sums["low"] / tokens,
        "clip_ratio/high_mean": sums["high"] / tokens,
        "clip_ratio/region_mean": sums["region"] / tokens,
        "grad_norm": grad_norm,
        "num_tokens": float(norm.num_tokens),
    }
    if has_reference:
        out["kl"] = sums["kl"] / tokens
    if cfg.entropy_coef > 0:
        out["entropy_bonus"] = sums["entropy_bonus"]
    return out
