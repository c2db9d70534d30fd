"""Wiring: build the model, reference, data, rewards, generator, optimizer and state of a run."""

from __future__ import annotations

import json
import logging
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

import torch
from transformers import get_scheduler

from maxent_grpo.core.step import Comm
from maxent_grpo.envs import ENVIRONMENT_COLUMN
from maxent_grpo.envs.episodes import EpisodePlay
from maxent_grpo.envs.settings import row_environments
from maxent_grpo.data.datasets import PromptSampler, load_prompt_dataset, split_train_eval
from maxent_grpo.data.prompts import longest_prompt_tokens
from maxent_grpo.models import (
    apply_lora, enable_activation_checkpointing, fill_pad_token, load_tokenizer, master_dtype, parse_dtype,
    reference_context, resolve_model_path,
)
from maxent_grpo.rewards.maxent import controller_state_dict, restore_controller_state
from maxent_grpo.rewards.registry import build_reward_spec
from maxent_grpo.rollout.backends import BACKENDS, BackendInputs
from maxent_grpo.rollout.data_plane import RolloutRecord
from maxent_grpo.rollout.open_plane import open_data_plane
from maxent_grpo.run_files import write_text_atomic
from maxent_grpo.training.checkpoint import CheckpointError, find_latest_checkpoint, read_trainer_state
from maxent_grpo.training.config import ConfigError, TrainConfig, TrainingConfig, save_config, to_dict
from maxent_grpo.training.distributed import Dist, log_device
from maxent_grpo.training.pipeline import PipelineContext
from maxent_grpo.training.rollout_queue import RolloutQueue
from maxent_grpo.training.seeding import seed_everything
from maxent_grpo.training.plan import RunPlan, compile_run, describe_rollout_correction
from maxent_grpo.training.precision import bf16_is_fast, resolve_precision
from maxent_grpo.training.run_dir import (
    RunDirError, RunLock, claim_output_dir, config_history, history_line, resume_changes,
)
from maxent_grpo.training.strategy import STRATEGIES, Strategy
from maxent_grpo.training.trackers import make_trackers, require_trackers
from maxent_grpo.training.weighting_config import weighting_from_config

if TYPE_CHECKING:  # datasets is imported by the loaders that need it (the GPU machine has none)
    from datasets import Dataset

log = logging.getLogger("maxent_grpo")


class ShardedSampler:
    """Each rank takes its own slice of every global batch, so ranks never see the same prompt."""

    def __init__(self, sampler: PromptSampler, dist: Dist):
        self.sampler, self.dist = sampler, dist

    def next_batch(self) -> list[dict]:
        rows = self.sampler.next_batch()
        return rows[self.dist.rank :: self.dist.world_size]


@dataclass
class Run:
    cfg: TrainConfig
    output_dir: Path
    ctx: PipelineContext
    train_model: torch.nn.Module  # DDP-wrapped with several processes (FSDP2: the sharded model itself)
    optimizer: torch.optim.Optimizer
    lr_scheduler: object
    sampler: ShardedSampler
    trackers: object
    comm: Comm  # how grpo_step reaches the other processes
    strategy: Strategy  # how the policy is spread over them, and how it is saved
    rollouts: RolloutQueue  # the coming steps' batches (rollout.max_staleness), on the data plane
    eval_rows: list[dict] = field(default_factory=list)
    start_step: int = 0
    resumed: bool = False
    lock: RunLock | None = None  # held by the main process until finish()
    last_metrics: dict = field(default_factory=dict)  # the latest step's, for the progress bar

    def trainer_state(self, step: int, sampler_state: dict | None = None) -> dict:
        return {
            "step": step,
            # The state before the step's batches were drawn when a step is abandoned half-way.
            "sampler": self.sampler.sampler.state_dict() if sampler_state is None else sampler_state,
            "controller": controller_state_dict(self.ctx.weighting),
            "skips": dict(self.ctx.skips),
            "config": to_dict(self.cfg),
            # Each rank's batches sampled and not yet trained on (rollout.max_staleness >= 1): a resumed
            # run restores them rather than sampling them again from weights it no longer has.
            "rollouts_in_flight": self.ctx.dist.gather_objects([[r.to_state() for r in self.rollouts.in_flight(step)]]),
        }

    def save(self, step: int, sampler_state: dict | None = None) -> Path | None:
        """Write the checkpoint of ``step`` (none for step 0); return its folder."""
        if step == 0:
            return None
        return self.strategy.save(
            self.output_dir, step, model=self.ctx.model, tokenizer=self.ctx.tokenizer, optimizer=self.optimizer,
            lr_scheduler=self.lr_scheduler, trainer_state=self.trainer_state(step, sampler_state),
            keep_last=self.cfg.checkpoint.keep_last,
        )

    def finish(self) -> None:
        self.rollouts.close()
        self.trackers.close()
        if self.lock is not None:
            self.lock.release()


def _reference_scorer(cfg: TrainConfig, plan: RunPlan, model, name_or_path: str, strategy: Strategy):
    scoring = plan.scoring
    if cfg.model.lora.enabled:
        def score(ids, mask, plen):
            with reference_context(model):
                return scoring.score_rows(model, ids, mask, plen)[0]
        return score
    ref = strategy.load_reference(name_or_path, dtype=cfg.model.dtype)

    def score(ids, mask, plen):
        return scoring.score_rows(ref, ids, mask, plen)[0]
    return score


def _generation_backend(cfg: TrainConfig, model, tokenizer, model_path: str, output_dir: Path, dist: Dist,
                        strategy: Strategy, prompts: Callable[[], list]):
    g = cfg.generation
    # Only a colocated engine with no vllm.max_model_len plans its KV cache from the data's prompts; an
    # episode's context grows past its prompt (tool descriptions, turns): the engine keeps the model's length.
    sized = BACKENDS[g.backend].plans_context and g.vllm.max_model_len is None and not cfg.environment.enabled
    return BACKENDS[g.backend].build(BackendInputs(
        model=model, tokenizer=tokenizer, model_path=model_path,
        sample_dtype=None if g.dtype is None else parse_dtype(g.dtype), batch_size=g.batch_size,
        share_prompts=cfg.training.share_prompts, vllm=g.vllm, seed=cfg.training.seed,
        world_size=dist.world_size, is_main=dist.is_main, any_rank=dist.any_rank,
        # Sharded: every forward gathers weights with the other ranks, so every rank
        # runs generate to the longest row of any rank.
        synced_gpus=strategy.collective_forward, default_sync_dir=output_dir / "vllm_weights",
        max_prompt_tokens=longest_prompt_tokens(
            tokenizer, prompts(), system_prompt=cfg.data.system_prompt, few_shot=cfg.data.few_shot,
        ) if sized else None,
        max_new_tokens=g.max_new_tokens,
    ))


def build_run(
    cfg: TrainConfig, *, resume: str | bool | None = None, overwrite: bool = False, allow_config_change: bool = False,
) -> Run:
    """Everything a run needs, checked in the order of their cost: the tracker packages, the output
    folder, the resume checkpoint's config, data, rewards, the generation backend, then the model."""
    # Every process checks (the main one starts them): all ranks refuse together, none waits for the others.
    require_trackers(cfg.logging.report_to)
    dist = Dist.init(cfg.training.dist_timeout_minutes)
    log_device(dist)
    strategy = STRATEGIES[cfg.training.strategy](dist)
    if dist.world_size < strategy.min_processes:
        raise ConfigError(f"training.strategy: {strategy.name} needs several processes (torchrun --nproc_per_node N, "
                          f"N >= {strategy.min_processes}); with one process use ddp")
    cfg = resolve_precision(cfg, bf16_is_fast(dist.device), cuda=dist.device.type == "cuda")
    plan = compile_run(cfg)
    output_dir = Path(cfg.logging.output_dir)
    lock = _claim(output_dir, dist, resume=bool(resume), overwrite=overwrite)
    ckpt = _resume_checkpoint(output_dir, resume)
    history = config_history(output_dir / "config.yaml")
    if ckpt is not None:
        saved = read_trainer_state(ckpt)
        changes = resume_changes(
            saved.get("config") or _saved_config(output_dir), to_dict(cfg), allow_change=allow_config_change,
        )
        history.append(history_line(int(saved["step"]), changes))
    method = plan.method
    seed_everything(cfg.training.seed + dist.rank)

    # Data and rewards first: their errors must come before the slow model load.
    train_ds, eval_rows = _load_data(cfg, dist)
    environments = _environments(cfg, train_ds)
    reward_spec = build_reward_spec(cfg.rewards)
    model_path = resolve_model_path(cfg.model.name_or_path)
    BACKENDS[cfg.generation.backend].check(cfg.generation.vllm, model_path)
    if dist.is_main:
        save_config(cfg, output_dir / "config.yaml", header=history)
        write_text_atomic(output_dir / "run_info.json", json.dumps(
            {"method": cfg.method, **method.identity(), "model": model_path, "world_size": dist.world_size}, indent=2
        ))
    log.info("method %s: family=%s loss=%s weighting=%s", method.name, method.family, method.loss.policy_loss,
             method.weighting)
    log.info("rollout correction: %s", describe_rollout_correction(method.loss))

    model, tokenizer = _load_policy(cfg, model_path, dist, strategy)
    reference = _reference_scorer(cfg, plan, model, model_path, strategy) if method.needs_reference else None
    optimizer, lr_scheduler = build_optimizer(model, cfg.training)
    train_model, gradient_sync = strategy.wrap(model)

    sampler = PromptSampler(
        train_ds, cfg.training.prompts_per_step * dist.world_size, seed=cfg.training.seed,
        shuffle=cfg.data.shuffle, num_epochs=cfg.data.num_epochs,
    )
    ctx = PipelineContext(
        plan=plan, model=model, tokenizer=tokenizer,
        backend=_generation_backend(cfg, model, tokenizer, model_path, output_dir, dist, strategy,
                                    lambda: [*train_ds["prompt"], *(r["prompt"] for r in eval_rows)]),
        reward_spec=reward_spec, weighting=weighting_from_config(cfg), dist=dist, reference_logps=reference,
        episodes=None if environments is None else EpisodePlay(environments, plan.batch.episodes),
    )
    sharded = ShardedSampler(sampler, dist)
    r = cfg.rollout
    rollouts = RolloutQueue(
        ctx, sharded.next_batch, open_data_plane(r.data_plane, ray=r.transferqueue_ray),
        max_staleness=r.max_staleness, beside=BACKENDS[cfg.generation.backend].samples_beside,
        seed=cfg.training.seed, wait_timeout_s=r.wait_timeout_s,
    )
    run = Run(
        cfg=cfg, output_dir=output_dir, ctx=ctx, train_model=train_model, optimizer=optimizer,
        lr_scheduler=lr_scheduler, sampler=sharded, rollouts=rollouts,
        trackers=make_trackers(cfg.logging.report_to if dist.is_main else [], output_dir, config=to_dict(cfg)),
        comm=Comm(world_size=dist.world_size, all_reduce_sum=dist.all_reduce_sum, gradient_sync=gradient_sync),
        strategy=strategy, eval_rows=eval_rows, lock=lock,
    )
    if ckpt is not None:
        _resume(run, ckpt)
    return run


def _environments(cfg: TrainConfig, train_ds: Dataset):
    """Each row's environment factory when the run plays episodes (``environment:``), else None."""
    has_column = ENVIRONMENT_COLUMN in train_ds.column_names
    if not cfg.environment.enabled:
        if has_column:
            raise ConfigError(f"environment.name: the dataset {cfg.data.source} has an {ENVIRONMENT_COLUMN!r} column "
                              "(one environment per row); set environment.name, the environment of rows without one")
        return None
    return row_environments(cfg.environment, train_ds[ENVIRONMENT_COLUMN] if has_column else None)


def _load_data(cfg: TrainConfig, dist: Dist) -> tuple[Dataset, list[dict]]:
    """The training rows and the held-out rows (none when ``data.eval_size`` is 0)."""
    d = cfg.data
    dataset = load_prompt_dataset(
        d.source, split=d.split, prompt_column=d.prompt_column, answer_column=d.answer_column, size=d.size,
        seed=cfg.training.seed, instruction=d.instruction, task_kwargs=d.task_kwargs,
    )
    train_ds, eval_rows = dataset, []
    if d.eval_size > 0:
        train_ds, eval_ds = split_train_eval(dataset, d.eval_size, cfg.training.seed)
        eval_rows = list(eval_ds)
    per_step = cfg.training.prompts_per_step * dist.world_size
    if per_step > len(train_ds):
        raise ConfigError(
            f"training.prompts_per_step: {cfg.training.prompts_per_step} prompts x {dist.world_size} process(es) per "
            f"step is more than the {len(train_ds)} training rows of {d.source}"
        )
    return train_ds, eval_rows


def _load_policy(cfg: TrainConfig, model_path: str, dist: Dist, strategy: Strategy):
    """The trained policy in its master dtype, with LoRA and activation checkpointing, placed by the strategy."""
    tokenizer = load_tokenizer(model_path)

    def adapt(model: torch.nn.Module) -> torch.nn.Module:
        fill_pad_token(model, tokenizer)
        if cfg.model.lora.enabled:
            lc = cfg.model.lora
            model = apply_lora(model, r=lc.r, alpha=lc.alpha, dropout=lc.dropout, target_modules=lc.target_modules)
        if cfg.training.gradient_checkpointing:
            enable_activation_checkpointing(model)
        return model

    # Before the optimizer exists: it must hold the (sharded) parameters.
    model = strategy.load_policy(model_path, dtype=master_dtype(cfg.model.dtype, cfg.model.lora.enabled),
                                 adapt=adapt, bf16_compute=cfg.training.autocast_bf16)
    return model, tokenizer


def build_optimizer(model: torch.nn.Module, t: TrainingConfig) -> tuple[torch.optim.Optimizer, object]:
    """The run's AdamW over the trainable parameters and its LR schedule (over every update of the run),
    from ``training:``."""
    trained = [p for p in model.parameters() if p.requires_grad]
    params: list = trained
    if t.weight_decay > 0:
        # Biases and norm gains (the 1-D parameters) are not decayed, as in HF / TRL and
        # OpenRLHF: decay would pull an RMSNorm gain from 1 toward 0. One group when there is
        # no decay, so checkpoints of earlier runs (one group) still resume.
        params = [{"params": [p for p in trained if p.ndim >= 2]},
                  {"params": [p for p in trained if p.ndim < 2], "weight_decay": 0.0}]
    optimizer = torch.optim.AdamW(
        params, lr=t.learning_rate, betas=(t.adam_beta1, t.adam_beta2), weight_decay=t.weight_decay,
    )
    lr_scheduler = get_scheduler(
        {"constant": "constant_with_warmup"}.get(t.lr_scheduler, t.lr_scheduler),
        optimizer, num_warmup_steps=t.warmup_steps, num_training_steps=t.max_steps * t.num_iterations,
    )
    return optimizer, lr_scheduler


def _claim(output_dir: Path, dist: Dist, *, resume: bool, overwrite: bool) -> RunLock | None:
    """Lock the output folder on the main process; every rank raises its refusal."""
    lock, refusal = None, None
    if dist.is_main:
        try:
            lock = claim_output_dir(output_dir, resume=resume, overwrite=overwrite)
        except RunDirError as err:
            refusal = str(err)
    refusal = dist.broadcast_object(refusal)
    if refusal is not None:
        raise RunDirError(refusal)
    return lock


def _resume_checkpoint(output_dir: Path, resume: str | bool | None) -> Path | None:
    if not resume:
        return None
    if resume is not True:
        return Path(resume)
    ckpt = find_latest_checkpoint(output_dir)
    if ckpt is None:
        log.warning("--resume: no complete checkpoint under %s; starting from step 0", output_dir)
    return ckpt


def _saved_config(output_dir: Path) -> dict:
    """The config of a run saved before checkpoints held their config: its config.yaml."""
    import yaml

    path = output_dir / "config.yaml"
    if not path.is_file():
        raise CheckpointError(f"--resume: the checkpoint holds no config and {path} is missing; cannot check the "
                              "new config against the run's")
    return yaml.safe_load(path.read_text())


def _resume(run: Run, ckpt: Path) -> None:
    state = run.strategy.load(ckpt, model=run.ctx.model, optimizer=run.optimizer, lr_scheduler=run.lr_scheduler)
    run.ctx.backend.sync_weights(run.ctx.model)
    run.sampler.sampler.load_state_dict(state["sampler"])
    restore_controller_state(run.ctx.weighting, state["controller"])
    run.ctx.skips.update(state["skips"])
    # Checkpoints written before asynchronous rollouts hold none; with another number of processes the
    # batches are sampled again (from the resumed weights).
    in_flight = state.get("rollouts_in_flight") or []
    if len(in_flight) == run.ctx.dist.world_size:
        run.rollouts.restore([RolloutRecord.from_state(r) for r in in_flight[run.ctx.dist.rank]])
    run.start_step, run.resumed = int(state["step"]), True
    log.info("resumed from %s at step %d", ckpt, run.start_step)
