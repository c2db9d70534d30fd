"""One optimizer step over micro-batches (ALGORITHMS.md §3, §4, §6).

``grpo_step`` is the only function here that touches a model and an optimizer.
It first counts the whole step (tokens, sequences, groups, micro-batches; summed
over ranks), so each micro-batch's loss is its exact share of the step loss;
gradients are accumulated by backward per micro-batch. Under DDP, which
*averages* gradients over ranks, every contribution is multiplied by
``world_size`` so the result is the gradient of the sum.

Each micro-batch is scored once (a :class:`~maxent_grpo.core.step_terms.TokenView`)
and its loss is the sum of the step's terms (``core/step_terms.py``: policy, KL,
distillation, entropy bonus), each adding its contribution and its logged totals;
all totals cross ranks in one all-reduce.

``replay`` (verified mode replay, ``core/replay.py``) adds ``scale * L_replay``
once to the step's gradient. It runs before the fresh micro-batches, with the
gradient reduction off: the gradients cross ranks once, in the last fresh
backward, and the sum does not depend on the order. Every rank replays the same
groups and the reduction averages, so the term counts once whatever the world
size. Its metrics join the step's.

What the step trains with is one :class:`LossSpec` (built once per run by
``config.compile.compile_run``); how the model is scored is one
:class:`~maxent_grpo.core.logprobs.Scoring`; how it reaches other processes is
one :class:`Comm`.
"""

from __future__ import annotations

from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass
from typing import Callable, Sequence

import torch

from maxent_grpo.core.entropy_terms import top_entropy_threshold
from maxent_grpo.core.logprobs import Scoring
from maxent_grpo.core.losses import POLICY_LOSSES, LossMetric, StepNormalizer
from maxent_grpo.core.replay import ReplayBatch, replay_backward
from maxent_grpo.core.rollout_correction import CorrectionPlan, MismatchSums, combine_mismatch_sums
from maxent_grpo.core.step_inputs import LossSpec, MicroBatch
from maxent_grpo.core.step_terms import StepFacts, TermOut, TokenView, step_terms

__all__ = [
    "POLICY_LOSSES", "Comm", "LossSpec", "MicroBatch", "OptimizerUpdate", "StepHooks", "StepResult", "grpo_step",
]


@dataclass(frozen=True)
class Comm:
    """How the step reaches the other processes (the defaults: one process).

    ``all_reduce_sum`` sums a tensor over ranks (in place or not; its return value is
    used); ``gradient_sync(is_last)`` is entered around each micro-batch's forward and
    backward: with several processes it turns the gradient reduction off for all but
    the last (DDP ``no_sync``, FSDP2 ``set_requires_gradient_sync``), so gradients cross
    the network once per step. The model is DDP-wrapped or FSDP2-sharded when ``world_size > 1``.
    """

    world_size: int = 1
    all_reduce_sum: Callable[[torch.Tensor], torch.Tensor] | None = None
    gradient_sync: Callable[[bool], AbstractContextManager] | None = None

    def __post_init__(self) -> None:
        if self.world_size < 1:
            raise ValueError(f"world_size must be >= 1, got {self.world_size}")
        if self.world_size > 1 and self.all_reduce_sum is None:
            raise ValueError("all_reduce_sum is required when world_size > 1 (the step's counts must be global)")

    def sync(self, is_last: bool) -> AbstractContextManager:
        """``gradient_sync(is_last)``, or nothing with one process."""
        return nullcontext() if self.gradient_sync is None else self.gradient_sync(is_last)


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


def _check_micro_batches(micro_batches: Sequence[MicroBatch], spec: LossSpec, terms) -> None:
    if len(micro_batches) == 0:
        raise ValueError("micro_batches must not be empty")
    g = micro_batches[0].num_generations
    for k, mb in enumerate(micro_batches):
        if mb.num_generations != g:
            raise ValueError(f"micro_batches[{k}].num_generations={mb.num_generations} != {g} of micro_batches[0]")
        for term in terms:
            for field, why in term.needs.items():
                if getattr(mb, field) is None:
                    raise ValueError(f"micro_batches[{k}].{field} is required by {why}")
        if spec.max_completion_length is not None and mb.completion_mask.shape[0] > 0:
            longest = int(mb.completion_mask.sum(-1).max())
            if longest > spec.max_completion_length:
                raise ValueError(
                    f"micro_batches[{k}] has a completion of {longest} tokens > "
                    f"max_completion_length={spec.max_completion_length}"
                )


def _step_normalizer(micro_batches, spec: LossSpec, comm: Comm) -> StepNormalizer:
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
    if comm.all_reduce_sum is not None:
        counts = comm.all_reduce_sum(counts)
    seqs, tokens, mbs, mbs_sq, groups = (int(round(float(c))) for c in counts)
    # sum(m)^2 == W * sum(m^2) iff every rank has the same m; unequal counts would
    # leave some rank waiting in a DDP backward forever, so fail on all ranks.
    if mbs * mbs != comm.world_size * mbs_sq:
        raise ValueError(
            f"micro_batches: every rank must run the same number of micro-batches "
            f"(total {mbs} over world_size={comm.world_size} ranks)"
        )
    return StepNormalizer(
        num_sequences=seqs, num_tokens=tokens, num_micro_batches=mbs,
        max_completion_length=spec.max_completion_length, num_groups=groups,
    )


@dataclass(frozen=True)
class OptimizerUpdate:
    """Apply the step's gradients: clip the norm (when ``max_grad_norm``), step the optimizer and
    the scheduler, zero the grads; return the norm before clipping."""

    max_grad_norm: float | None = None
    lr_scheduler: object | None = None

    def __call__(self, model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> torch.Tensor:
        params = [p for p in model.parameters() if p.grad is not None]
        if self.max_grad_norm is not None:
            grad_norm = torch.nn.utils.clip_grad_norm_(params, self.max_grad_norm)
        else:
            grad_norm = torch.nn.utils.get_total_norm([p.grad for p in params])
        optimizer.step()
        if self.lr_scheduler is not None:
            self.lr_scheduler.step()
        optimizer.zero_grad()
        return grad_norm


def _no_phase(name: str) -> AbstractContextManager:
    return nullcontext()


@dataclass(frozen=True)
class StepHooks:
    """What the trainer hooks into a step; the core keeps no clock and manages no host memory.

    ``update`` applies the gradients (an :class:`OptimizerUpdate`) and returns their norm.
    ``phase(name)`` is a context entered around the ``"replay"`` pass and the ``"update"``: the
    trainer times them there. ``release`` is called before each micro-batch's forward and before
    its backward, when the previous pass's tensors are freed (the trainer hands freed host memory
    back to the OS there, ``training/host_memory.py``); it must not touch the model.
    """

    update: Callable[[torch.nn.Module, torch.optim.Optimizer], torch.Tensor] = OptimizerUpdate()
    phase: Callable[[str], AbstractContextManager] = _no_phase
    release: Callable[[], None] | None = None


def grpo_step(
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    micro_batches: Sequence[MicroBatch],
    spec: LossSpec,
    scoring: Scoring,
    *,
    comm: Comm = Comm(),
    hooks: StepHooks = StepHooks(),
    replay: ReplayBatch | None = None,
) -> StepResult:
    """Forward/backward every micro-batch under ``spec``: its loss is the sum of the terms of
    :func:`~maxent_grpo.core.step_terms.step_terms`, each given the micro-batch's :class:`TokenView`.
    ``replay`` (verified mode replay, ``core/replay.py``) runs first; then ``hooks.update``."""
    terms = step_terms(spec, bool(micro_batches) and micro_batches[0].ref_logps is not None)
    _check_micro_batches(micro_batches, spec, terms)
    facts = StepFacts(_step_normalizer(micro_batches, spec, comm),
                      _step_entropy_threshold(model, micro_batches, spec.top_entropy_quantile, scoring),
                      model.config.get_text_config().vocab_size, correction_plan(spec))
    optimizer.zero_grad()
    replay_metrics: dict[str, float] = {}
    if replay is not None:
        with comm.sync(False), hooks.phase("replay"):
            replay_metrics = replay_backward(model, replay, scoring)
    totals: dict[str, LossMetric] = {}
    mismatch: list[MismatchSums] = []
    for i, mb in enumerate(micro_batches):
        _release(hooks)
        with comm.sync(i == len(micro_batches) - 1):  # gradients cross ranks once, in the last backward
            view = _token_view(model, mb, facts.correction, scoring)
            outs = [term(view, facts) for term in terms]
            loss = _sum_losses(outs)
            _release(hooks)
            (loss * comm.world_size).backward()
        _accumulate(totals, [TermOut(None, {"loss": LossMetric(loss, "step"),
                                            "entropy": LossMetric((view.entropy * view.mask).sum(), "token")}), *outs])
        if mb.behaviour_logps is not None:
            mismatch.append(facts.correction.mismatch(view.old, mb.behaviour_logps, view.mask))
    reduced = _all_reduce(totals, comm, micro_batches[0].input_ids.device)
    with hooks.phase("update"):
        grad_norm = float(hooks.update(model, optimizer))
    metrics = {name: value / _divisor(totals[name].per, facts.norm) for name, value in reduced.items()}
    metrics.update(grad_norm=grad_norm, num_tokens=float(facts.norm.num_tokens), **replay_metrics)
    return StepResult(loss=reduced["loss"], grad_norm=grad_norm, metrics=metrics,
                      mismatch=combine_mismatch_sums(mismatch) if mismatch else None)


def _release(hooks: StepHooks) -> None:
    if hooks.release is not None:
        hooks.release()


def correction_plan(spec: LossSpec) -> CorrectionPlan:
    """The step's sampler -> trainer correction, decided here once (``core/rollout_correction.py``)."""
    return CorrectionPlan(spec.rollout_correction, spec.rollout_correction_cap,
                          POLICY_LOSSES[spec.policy_loss].applies_correction, spec.seq_logprob_error_threshold)


def _token_view(model, mb: MicroBatch, correction: CorrectionPlan, scoring: Scoring) -> TokenView:
    """Score ``mb`` once for every term: log-probs with their graph, entropies, the anchor, the correction."""
    logp, ent = scoring.logps(model, mb.input_ids, mb.attention_mask, mb.prompt_length, with_entropy=True)
    mask = mb.completion_mask.to(logp.dtype)
    old = logp.detach() if mb.old_logps is None else mb.old_logps
    return TokenView(mb, logp, ent, mask, old, correction.weights(old, mb.behaviour_logps, mask))


def _sum_losses(outs: list[TermOut]) -> torch.Tensor:
    """The micro-batch's loss: the terms' contributions added in the terms' order."""
    parts = [out.loss for out in outs if out.loss is not None]
    loss = parts[0]
    for part in parts[1:]:
        loss = loss + part
    return loss


def _accumulate(totals: dict[str, LossMetric], outs: list[TermOut]) -> None:
    """Add one micro-batch's logged totals (float64, detached) to the step's."""
    for out in outs:
        for name, metric in out.totals.items():
            value = metric.total.detach().to(torch.float64)
            if name in totals:
                value = totals[name].total + value
            totals[name] = LossMetric(value, metric.per)


def _all_reduce(totals: dict[str, LossMetric], comm: Comm, device) -> dict[str, float]:
    """Every total summed over ranks in one all-reduce (the same names in the same order on every rank)."""
    values = torch.stack([metric.total.to(device) for metric in totals.values()])
    if comm.all_reduce_sum is not None:
        values = comm.all_reduce_sum(values)
    return dict(zip(totals, values.tolist()))


def _divisor(per: str, norm: StepNormalizer) -> int:
    if per == "step":
        return 1
    return max(norm.num_tokens if per == "token" else norm.num_sequences, 1)


def _step_entropy_threshold(model, micro_batches, quantile: float, scoring: Scoring):
    """The entropy threshold of the step's top ``quantile`` tokens (None: keep all), from a no-grad
    pass over every micro-batch first: the top fraction is of the whole step, not of each
    micro-batch. With several processes each takes the top fraction of its own tokens."""
    if quantile == 1:
        return None
    ents = []
    with torch.no_grad():
        for mb in micro_batches:
            ents.append(scoring.logps(model, mb.input_ids, mb.attention_mask, mb.prompt_length, with_entropy=True)[1])
    return top_entropy_threshold(ents, [mb.completion_mask for mb in micro_batches], quantile)
