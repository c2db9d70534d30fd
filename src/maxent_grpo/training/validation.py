"""In-loop validation on the held-out split (NeMo-RL's ``validate``), logged with an ``eval/`` prefix."""

from __future__ import annotations

import random
from dataclasses import dataclass, replace

import torch

from maxent_grpo.core.mode_metrics import MIN_DEFINED_PROMPTS
from maxent_grpo.rollout.data_plane import DataPlane, RolloutRecord
from maxent_grpo.tasks.modebench_package import PREFIX as PACKAGE_PREFIX
from maxent_grpo.rewards.context import TrainerState
from maxent_grpo.evaluate import EvalSampling, eval_seed, evaluate_prompts, per_prompt_metrics, per_task_means, write_eval_outputs


@dataclass(frozen=True)
class EvalPlan:
    """``eval:``: how many held-out prompts, how many samples each (``draws`` groups of ``k``), the
    run's seed (the sampling's) and ModeBench's reportable threshold."""

    num_prompts: int
    k: int
    seed: int
    draws: int = 1
    min_defined_prompts: int = MIN_DEFINED_PROMPTS


# The anchor's evaluation draws 4 groups of 8 per ModeBench prompt (ALGORITHMS.md §18); elsewhere one group of 4.
MODEBENCH_DRAWS, MODEBENCH_K, DEFAULT_K = 4, 8, 4


def eval_k(k: int | None, source: str) -> int:
    """``eval.k``, or its default: :data:`MODEBENCH_K` on ``modebench_pkg:`` data, else :data:`DEFAULT_K`."""
    if k is not None:
        return k
    return MODEBENCH_K if source.startswith(PACKAGE_PREFIX) else DEFAULT_K


def eval_draws(draws: int | None, source: str) -> int:
    """``eval.draws``, or its default: :data:`MODEBENCH_DRAWS` on ``modebench_pkg:`` data, else 1."""
    if draws is not None:
        return draws
    return MODEBENCH_DRAWS if source.startswith(PACKAGE_PREFIX) else 1


def _through_plane(plane: DataPlane, partition: str, record: RolloutRecord) -> RolloutRecord:
    """NeMo-RL's ``validate_sync``: the validation batch goes into its own partition, is read back, and
    the partition is cleared."""
    plane.register(partition)
    try:
        plane.put(partition, record)
        return plane.fetch(partition)
    finally:
        plane.clear(partition)


def validate(run, step: int) -> dict[str, float]:
    """Evaluate the current policy on ``run.eval_rows[:plan.eval.num_prompts]``; return ``eval/*`` metrics.

    The main rank writes ``OUTPUT_DIR/eval/step-N/{summary.json,completions.jsonl}``.
    Sampling runs under ``eval_seed(training.seed)`` inside a forked RNG, and python's
    RNG is put back too: validating never changes the training trajectory, and
    ``maxent-grpo eval checkpoints/step-N --config OUTPUT_DIR/config.yaml`` reproduces
    ``eval/step-N`` exactly.
    """
    plan = run.plan
    e = plan.eval
    rows = run.eval_rows[: e.num_prompts]
    device = run.ctx.model.device
    py_state = random.getstate()
    rng = torch.random.fork_rng(devices=[device.index or 0] if device.type == "cuda" else [])
    # One rollout phase for the evaluation's generate calls (a sleeping vLLM engine wakes once).
    with rng, run.ctx.backend.rollout_phase(run.ctx.model):
        torch.manual_seed(eval_seed(e.seed))
        try:
            summary, records = evaluate_prompts(
                run.ctx.backend, run.ctx.tokenizer, rows, run.ctx.reward_spec,
                EvalSampling(k=e.k, sampling=plan.batch.sampling, draws=e.draws, system_prompt=plan.batch.system_prompt,
                             few_shot=plan.batch.few_shot),
                min_defined_prompts=e.min_defined_prompts, episodes=run.ctx.episodes,
                carry=lambda record: _through_plane(run.rollouts.plane, f"val/{step}", replace(record, step=step,
                                                                                                version=step)),
                trainer_state=TrainerState(global_step=step, max_steps=plan.schedule.max_steps,
                                           epoch=step / run.ctx.steps_per_epoch if run.ctx.steps_per_epoch else 0.0),
            )
        finally:
            random.setstate(py_state)
    if run.ctx.dist.is_main:
        write_eval_outputs(run.output_dir / "eval" / f"step-{step}", summary, records)
    # Each task on its own (a ModeBench task, a multi-turn run's environment), beside the pooled numbers.
    per_task = per_task_means(per_prompt_metrics(records, e.k))
    return {f"eval/{k}": float(v) for k, v in {**summary, **per_task}.items() if isinstance(v, (int, float))}
