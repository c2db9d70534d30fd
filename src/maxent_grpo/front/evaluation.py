"""``GRPOTrainer.evaluate()``: this library's evaluation (``maxent-grpo eval``) of the trainer's model on
its ``eval_dataset``, returned as TRL returns metrics (``eval_`` prefixed, also in ``log_history``).

TRL's ``evaluate()`` reports the loss and rewards of sampled groups; here it is what ``maxent-grpo
eval`` and in-loop validation report: ``pass@1``, ``pass@k`` (unbiased estimator), ``mean@k``,
``distinct@k`` and greedy ``pass@1`` over ``eval.k`` samples per prompt, correctness decided by the
first reward function (>= 1.0), plus each reward's mean. The summary and every completion are written
to ``OUTPUT_DIR/eval/NAME``.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from maxent_grpo.errors import ConfigError

__all__ = ["evaluate_trainer_model"]


def evaluate_trainer_model(plan, model: Any, tokenizer: Any, dataset: Any, out_dir: Path, trainer_state: Any,
                           prefix: str = "eval") -> dict[str, float]:
    """Evaluate ``model`` (an object, or a folder) on ``dataset``'s first ``eval.num_prompts`` rows;
    ``trainer_state`` (rewards/context.py's) is what reward functions reading it get."""
    from maxent_grpo.data.datasets import given_table
    from maxent_grpo.envs import ENVIRONMENT_COLUMN
    from maxent_grpo.evaluate import eval_seed, per_prompt_metrics, per_task_means, write_eval_outputs
    from maxent_grpo.evaluate import EvalSampling, evaluate_prompts
    from maxent_grpo.models import load_model_and_tokenizer, prepare_tokenizer
    from maxent_grpo.rewards.registry import build_reward_spec
    from maxent_grpo.training.data import row_episodes
    from maxent_grpo.training.distributed import Dist
    from maxent_grpo.training.sampler import build_sampler

    if dataset is None:
        raise ConfigError("eval_dataset: none to evaluate on; give GRPOTrainer(eval_dataset=...) or evaluate(eval_dataset)")
    d = plan.data
    table = given_table(dataset, "eval_dataset", prompt_column=d.prompt_column, answer_column=d.answer_column,
                        environment_prompts=d.episodes is not None)
    rows = list(table)[: plan.eval.num_prompts]
    spec = build_reward_spec(list(plan.rewards))
    episodes = row_episodes(d, None if d.episodes is None else [r.get(ENVIRONMENT_COLUMN) for r in rows])
    if isinstance(model, (str, Path)):
        model, loaded = load_model_and_tokenizer(model, dtype=plan.model.dtype, device=Dist().device)
        tokenizer = tokenizer or loaded
    tokenizer = prepare_tokenizer(tokenizer)
    backend = build_sampler(plan.sampler, model, tokenizer, None, seed=eval_seed(plan.seed),
                            sync_dir=out_dir / "vllm_weights", prompts=lambda: [r["prompt"] for r in rows])
    was_training = model.training
    with torch.random.fork_rng(devices=[]), backend.rollout_phase(model):
        torch.manual_seed(eval_seed(plan.seed))
        summary, records = evaluate_prompts(
            backend, tokenizer, rows, spec,
            EvalSampling(k=plan.eval.k, sampling=plan.batch.sampling, draws=plan.eval.draws,
                         system_prompt=plan.batch.system_prompt, few_shot=plan.batch.few_shot),
            episodes=episodes, min_defined_prompts=plan.eval.min_defined_prompts, trainer_state=trainer_state,
        )
    model.train(was_training)
    summary.update(per_task_means(per_prompt_metrics(records, plan.eval.k)))
    write_eval_outputs(out_dir, summary, records)
    sampled = [r for r in records if r["mode"] == "sampled"]
    for name in spec.names:
        values = [r["rewards"][name] for r in sampled if r["rewards"].get(name) is not None]
        if values:
            summary[f"rewards/{name}/mean"] = sum(values) / len(values)
    return {f"{prefix}_{k}": float(v) for k, v in summary.items() if isinstance(v, (int, float))}
