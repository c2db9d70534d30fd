"""In-loop validation on the held-out split (NeMo-RL's ``validate``), logged with an ``eval/`` prefix."""

from __future__ import annotations

import torch

from maxent_grpo.evaluate import evaluate_prompts, write_eval_outputs


def validate(run, step: int) -> dict[str, float]:
    """Evaluate the current policy on ``run.eval_rows``; return ``eval/*`` metrics (main rank writes files)."""
    cfg = run.cfg
    rows = run.eval_rows[: cfg.eval.num_prompts]
    # Evaluation must not consume the training RNG stream, or resumed runs would diverge.
    rng = torch.get_rng_state()
    torch.manual_seed(cfg.training.seed + 7919 * step)
    try:
        summary, records = evaluate_prompts(
            run.ctx.backend, run.ctx.tokenizer, rows, run.ctx.reward_spec,
            k=cfg.eval.k, sampling=run.ctx.sampling, system_prompt=cfg.data.system_prompt,
        )
    finally:
        torch.set_rng_state(rng)
    if run.ctx.dist.is_main:
        write_eval_outputs(run.output_dir / "eval" / f"step-{step}", summary, records)
    return {f"eval/{k}": float(v) for k, v in summary.items() if isinstance(v, (int, float))}
