"""What one optimizer step is given: its rows (:class:`MicroBatch`) and its loss (:class:`LossSpec`).

Both are checked when built, so ``grpo_step`` and its terms (``core/step_terms.py``) read
valid records. ``core/step.py`` re-exports them.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from maxent_grpo.core import listwise, peer_losses, vespo
from maxent_grpo.core.bounds import require
from maxent_grpo.core.distill import DistillTerm
from maxent_grpo.core.entropy_terms import check_top_entropy_quantile
from maxent_grpo.core.losses import POLICY_LOSSES, ClipSettings, check_aggregation, check_kl_estimator
from maxent_grpo.core.rollout_correction import check_rollout_correction, check_seq_logprob_error_threshold

# Imported for their registrations in POLICY_LOSSES, which LossSpec checks its name against:
# the listwise losses, SAPO, GMPO, DPPO, OPSM, VESPO.
REGISTERING_MODULES = (listwise, peer_losses, vespo)


@dataclass(frozen=True)
class MicroBatch:
    """One forward/backward's rows. Completion tensors are ``[B, T]`` with ``T = L - prompt_length``.

    ``num_generations`` is G, the completions per prompt (rows are group-major).
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
    num_generations: int
    completion_mask: torch.Tensor
    advantages: torch.Tensor
    old_logps: torch.Tensor | None = None
    ref_logps: torch.Tensor | None = None
    row_weights: torch.Tensor | None = None
    listwise_weights: torch.Tensor | None = None
    listwise_active: torch.Tensor | None = None
    behaviour_logps: torch.Tensor | None = None
    teacher_logps: torch.Tensor | None = None  # on-policy distillation: the teacher's, [B, T]

    def __post_init__(self) -> None:
        if self.input_ids.dim() != 2:
            raise ValueError(f"input_ids must be [B, L], got shape {tuple(self.input_ids.shape)}")
        b, length = self.input_ids.shape
        if self.attention_mask.shape != (b, length):
            raise ValueError(f"attention_mask shape {tuple(self.attention_mask.shape)} != input_ids {(b, length)}")
        if not 1 <= self.prompt_length <= length:
            raise ValueError(f"prompt_length must be in [1, {length}], got {self.prompt_length}")
        if self.num_generations < 1:
            raise ValueError(f"num_generations must be >= 1, got {self.num_generations}")
        bt = (b, length - self.prompt_length)
        tensors = {
            "completion_mask": (self.completion_mask, bt),
            "advantages": (self.advantages, (b,)),
            "old_logps": (self.old_logps, bt),
            "ref_logps": (self.ref_logps, bt),
            "behaviour_logps": (self.behaviour_logps, bt),
            "teacher_logps": (self.teacher_logps, bt),
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
class LossSpec:
    """Everything the step's loss is made of (EasyDeL's ``loss_config``); the bounds are checked here.

    Per token the loss is ``policy * top_entropy_mask * row_weight + beta * KL`` (``beta * rho * KL``
    with ``kl_importance_weighted``, rho the policy / old-policy ratio carrying gradient, §19),
    aggregated by ``loss_type`` with the step's global counts; listwise policy
    losses add their group term; ``entropy_coef`` (alpha, §6) subtracts ``alpha * B``.
    ``policy_params`` is the registered policy loss's own settings record.
    ``max_completion_length`` is required by ``loss_type="dr_grpo"``.
    ``rollout_correction`` / ``rollout_correction_cap``: the importance weight
    between the sampler and the trainer's old policy on the per-token policy
    term (``core/rollout_correction.py``; a loss registered with
    ``applies_correction``, GMPO, is handed the weight and applies it to its
    sequence loss itself); needs behaviour log-probs.
    ``distill`` (on-policy distillation, ``core/distill.py``) adds the teacher's reverse-KL
    term per token, aggregated like the policy term; needs teacher log-probs.
    """

    policy_loss: str = "clipped_surrogate"
    policy_params: object | None = None
    loss_type: str = "dapo"
    clip: ClipSettings = ClipSettings()
    beta: float = 0.0
    kl_estimator: str = "k3"
    kl_importance_weighted: bool = False  # beta * rho * KL per token, rho with gradient (§19)
    entropy_coef: float = 0.0
    top_entropy_quantile: float = 1.0
    rollout_correction: str = "none"
    rollout_correction_cap: float = 2.0  # verl's threshold, ALGORITHMS.md §15
    seq_logprob_error_threshold: float | None = None
    max_completion_length: int | None = None
    distill: DistillTerm | None = None

    def __post_init__(self) -> None:
        require(self.policy_loss in POLICY_LOSSES, "policy_loss",
                f"must be one of {sorted(POLICY_LOSSES)}, got {self.policy_loss!r}")
        loss = POLICY_LOSSES[self.policy_loss]
        want = loss.params
        require(want is None and self.policy_params is None or want is not None and isinstance(self.policy_params, want),
                "policy_params", f"must be a {want.__name__ if want else 'None'} for {self.policy_loss!r}, "
                f"got {type(self.policy_params).__name__}")
        check_aggregation(self.loss_type, self.max_completion_length)
        require(loss.loss_types is None or self.loss_type in loss.loss_types, "loss_type",
                f"must be one of {list(loss.loss_types or ())} for the {self.policy_loss} policy loss, "
                f"got {self.loss_type!r}")
        require(self.beta >= 0, "beta", f"must be >= 0, got {self.beta}")
        check_kl_estimator(self.kl_estimator)
        require(self.entropy_coef >= 0, "entropy_coef", f"must be >= 0, got {self.entropy_coef}")
        check_top_entropy_quantile(self.top_entropy_quantile)
        check_rollout_correction(self.rollout_correction, self.rollout_correction_cap)
        check_seq_logprob_error_threshold(self.seq_logprob_error_threshold)
