"""``train()``: the whole loop, top to bottom.

generate -> reward -> score -> weight (``prepare_training_batch``) -> loss and
step (``grpo_step``) -> controllers -> log -> checkpoint -> evaluate.
"""

from __future__ import annotations

import logging
import time
from pathlib import Path

import torch
from tqdm.auto import tqdm

from maxent_grpo.core.logprobs import get_per_token_logps
from maxent_grpo.core.step import grpo_step
from maxent_grpo.rewards.maxent import controller_state_dict, maybe_update_beta, maybe_update_tau
from maxent_grpo.training.config import TrainConfig
from maxent_grpo.training.metrics import MetricsLog, build_training_metrics_dict
from maxent_grpo.training.pipeline import prepare_training_batch
from maxent_grpo.training.setup import Run, build_run, seed_step
from maxent_grpo.training.tables import write_completion_table
from maxent_grpo.training.validation import validate

log = logging.getLogger("maxent_grpo")

# A run stops when this many batches in a row fail before any succeeded.
MAX_INITIAL_FAILURES = 3


class TrainingError(RuntimeError):
    """The run cannot go on; the message says why."""


def train(cfg: TrainConfig, *, resume: str | bool | None = None) -> Path:
    """Train according to ``cfg``; return the output directory."""
    run = build_run(cfg, resume=resume)
    cfg, ctx = run.cfg, run.ctx
    # Only the main process owns metrics.jsonl: two processes truncating it on resume would race.
    metrics_log = (
        MetricsLog(run.output_dir / "metrics.jsonl", resume_after_step=run.start_step if run.resumed else None)
        if ctx.dist.is_main else None
    )
    bar = tqdm(
        total=cfg.training.max_steps, initial=run.start_step, desc=f"{cfg.method}", unit="step",
        disable=not (cfg.logging.progress_bar and ctx.dist.is_main), dynamic_ncols=True,
    )
    step, consecutive_failures, succeeded = run.start_step, 0, run.start_step > 0
    while step < cfg.training.max_steps:
        t_start, cpu_start = time.perf_counter(), time.process_time()
        # Each step draws from its own seed (run seed, rank, step), so a resumed run or any
        # number of processes samples exactly what an uninterrupted run would.
        seed_step(cfg.training.seed, ctx.dist.rank, step)
        try:
            prepared = prepare_training_batch(ctx, run.sampler.next_batch(), run.sampler.next_batch)
        except StopIteration:
            log.info("data exhausted after %d epochs at step %d", cfg.data.num_epochs, step)
            break
        if prepared is None:
            consecutive_failures += 1
            if not succeeded and consecutive_failures >= MAX_INITIAL_FAILURES:
                raise TrainingError(f"every batch failed ({consecutive_failures} in a row); last error: {ctx.last_error}")
            continue
        consecutive_failures, succeeded = 0, True
        timings = dict(prepared.timings)

        t_policy = time.perf_counter()
        old_logps = _old_logps(run, prepared) if cfg.training.num_iterations > 1 else None
        for _ in range(cfg.training.num_iterations):
            with autocast(cfg, ctx.dist.device):
                result = grpo_step(
                    run.train_model, run.optimizer, prepared.micro_batches(cfg.training.micro_batch_size, old_logps),
                    num_generations=cfg.generation.num_generations,
                    beta=ctx.weighting.beta if ctx.method.weighting != "listwise" else 0.0,
                    loss_type=cfg.loss.loss_type,
                    epsilon=cfg.loss.epsilon,
                    epsilon_high=cfg.loss.epsilon_high,
                    delta=cfg.loss.delta,
                    importance_sampling_level=cfg.loss.importance_sampling_level,
                    top_entropy_quantile=cfg.loss.top_entropy_quantile,
                    loss_config=run.loss_config,
                    max_grad_norm=cfg.training.max_grad_norm,
                    lr_scheduler=run.lr_scheduler,
                    share_prompts=cfg.training.share_prompts,
                    all_reduce_sum=ctx.dist.all_reduce_sum,
                    world_size=ctx.dist.world_size,
                )
        ctx.backend.sync_weights(ctx.model)
        timings["time/optimizer"] = result.metrics.pop("time/optimizer")
        timings["time/policy"] = time.perf_counter() - t_policy - timings["time/optimizer"]
        step += 1

        # Controllers run once per step on globally averaged inputs (§8).
        if prepared.weight_stats is not None:
            maybe_update_tau(ctx.weighting, _global_weight_view(run, prepared), step)
        if "kl" in result.metrics:
            maybe_update_beta(ctx.weighting, ctx.dist.mean(result.metrics["kl"]))

        timings["time/total"] = time.perf_counter() - t_start
        timings["step_cpu_time"] = time.process_time() - cpu_start
        metrics = build_training_metrics_dict(
            prepared, result, step=step, learning_rate=run.lr_scheduler.get_last_lr()[0],
            timings=timings, controller=_controller_metrics(run), dist=ctx.dist,
            max_completion_length=cfg.generation.max_new_tokens,
        )
        metrics.update({f"skipped/{k}": float(v) for k, v in ctx.skips.items()})
        if run.eval_rows and cfg.eval.every_steps and step % cfg.eval.every_steps == 0:
            t_eval = time.perf_counter()
            metrics.update(validate(run, step))
            metrics["time/eval"] = time.perf_counter() - t_eval
        if metrics_log is not None:
            metrics_log.write(metrics)
            run.trackers.log(metrics, step)
            if cfg.logging.log_completions_every and step % cfg.logging.log_completions_every == 0:
                write_completion_table(run.output_dir, step, prepared, run.trackers)
        bar.update(1)
        bar.set_postfix(_postfix(metrics), refresh=False)
        if cfg.checkpoint.save_steps and step % cfg.checkpoint.save_steps == 0 and step < cfg.training.max_steps:
            run.save(step)
    bar.close()
    run.save(step)
    run.finish()
    return run.output_dir


def autocast(cfg: TrainConfig, device: torch.device):
    return torch.autocast(device.type, dtype=torch.bfloat16, enabled=cfg.training.autocast_bf16)


def _old_logps(run: Run, prepared) -> torch.Tensor:
    """Log-probs of the pre-update policy, needed only when a batch is reused (num_iterations > 1)."""
    packed, size = prepared.packed, run.cfg.training.micro_batch_size
    outs = []
    with torch.no_grad(), autocast(run.cfg, run.ctx.dist.device):
        for s in range(0, packed.input_ids.shape[0], size):
            sl = slice(s, s + size)
            outs.append(get_per_token_logps(
                run.ctx.model, packed.input_ids[sl], packed.attention_mask[sl], packed.prompt_length,
                temperature=run.cfg.generation.temperature, share_prompts=run.cfg.training.share_prompts,
            ))
    return torch.cat(outs)


def _global_weight_view(run: Run, prepared):
    from maxent_grpo.rewards.maxent import WeightLoggingView

    ws, dist = prepared.weight_stats, run.ctx.dist
    return WeightLoggingView(
        entropy=dist.mean(float(ws.weight_entropy)),
        entropy_min=min(dist.gather_floats([float(ws.weight_entropy_min)])),
        entropy_max=max(dist.gather_floats([float(ws.weight_entropy_max)])),
    )


def _controller_metrics(run: Run) -> dict[str, float]:
    if run.ctx.method.family != "maxent" and run.cfg.loss.beta == 0:
        return {}
    state = controller_state_dict(run.ctx.weighting)
    return {"tau": float(state["tau"]), "beta": float(state["beta"])}


def _postfix(m: dict) -> dict[str, str]:
    out = {"reward": f"{m['reward']:.3f}"}
    if "kl" in m and m["kl"] is not None:
        out["kl"] = f"{m['kl']:.4f}"
    out["len"] = f"{m['completions/mean_length']:.0f}"
    out["s/step"] = f"{m['time/total']:.1f}"
    return out
