"""Wiring: build the model, reference, data, rewards, generator, optimizer and state of a run."""

from __future__ import annotations

import importlib.util
import json
import logging
import random
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch
from safetensors import SafetensorError
from transformers import get_scheduler

from maxent_grpo.core.step import Comm
from maxent_grpo.models import (
    apply_lora, enable_activation_checkpointing, load_model_and_tokenizer, load_reference_model, parse_dtype,
    reference_context, resolve_model_path,
)
from maxent_grpo.rewards.maxent import controller_state_dict, restore_controller_state
from maxent_grpo.rewards.registry import build_reward_spec
from maxent_grpo.rollout.hf import HFGenerationBackend
from maxent_grpo.run_files import write_text_atomic
from maxent_grpo.training.checkpoint import (
    CheckpointError, describe_write_error, find_latest_checkpoint, load_checkpoint, read_trainer_state, save_checkpoint,
    save_failed,
)
from maxent_grpo.training.config import ConfigError, TrainConfig, TrainingConfig, save_config, to_dict
from maxent_grpo.data.datasets import PromptSampler, load_prompt_dataset, split_train_eval
from maxent_grpo.training.distributed import DataParallelPolicy, Dist, ddp_gradient_sync, log_device
from maxent_grpo.training.pipeline import PipelineContext
from maxent_grpo.training.plan import RunPlan, compile_run
from maxent_grpo.training.precision import bf16_is_fast, master_dtype, resolve_precision
from maxent_grpo.training.run_dir import (
    RunDirError, RunLock, claim_output_dir, config_history, history_line, resume_changes,
)
from maxent_grpo.training.sharded_checkpoint import load_sharded_checkpoint, save_sharded_checkpoint
from maxent_grpo.training.sharding import fsdp2_gradient_sync, shard_model
from maxent_grpo.training.trackers import make_trackers
from maxent_grpo.training.weighting_config import weighting_from_config

log = logging.getLogger("maxent_grpo")


def build_optimizer(model: torch.nn.Module, t: TrainingConfig) -> tuple[torch.optim.Optimizer, object]:
    """The run's AdamW over the trainable parameters and its LR schedule, from ``training:``."""
    optimizer = torch.optim.AdamW(
        [p for p in model.parameters() if p.requires_grad], lr=t.learning_rate,
        betas=(t.adam_beta1, t.adam_beta2), weight_decay=t.weight_decay,
    )
    lr_scheduler = get_scheduler(
        {"constant": "constant_with_warmup"}.get(t.lr_scheduler, t.lr_scheduler),
        optimizer, num_warmup_steps=t.warmup_steps, num_training_steps=t.max_steps * t.num_iterations,
    )
    return optimizer, lr_scheduler


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
        }

    def save(self, step: int, sampler_state: dict | None = None) -> Path | None:
        """Write the checkpoint of ``step`` (none for step 0); return its folder."""
        if step == 0:
            return None
        state = self.trainer_state(step, sampler_state)
        if self.cfg.training.strategy == "fsdp2":
            return save_sharded_checkpoint(
                self.output_dir, step, model=self.ctx.model, tokenizer=self.ctx.tokenizer,
                optimizer=self.optimizer, lr_scheduler=self.lr_scheduler,
                trainer_state=state, keep_last=self.cfg.checkpoint.keep_last,
            )
        path, failure = None, None
        if self.ctx.dist.is_main:
            try:
                path = save_checkpoint(
                    self.output_dir, step, model=self.ctx.model, tokenizer=self.ctx.tokenizer,
                    optimizer=self.optimizer, lr_scheduler=self.lr_scheduler,
                    trainer_state=state, keep_last=self.cfg.checkpoint.keep_last,
                )
            # Disk full, permissions (safetensors reports the same I/O errors as its own): the
            # earlier checkpoints are untouched.
            except (OSError, SafetensorError) as err:
                failure = describe_write_error(err, self.output_dir)
        # Also the barrier: every rank learns whether the save worked.
        failure = self.ctx.dist.broadcast_object(failure)
        if failure is not None:
            raise save_failed(self.output_dir, step, failure)
        return path

    def finish(self) -> None:
        self.trackers.close()
        if self.lock is not None:
            self.lock.release()


def _seed_everything(seed: int) -> None:
    random.seed(seed)
    torch.manual_seed(seed)


def seed_step(seed: int, rank: int, step: int) -> None:
    """Seed python and torch for one optimizer step from (seed, rank, step)."""
    derived = int(np.random.SeedSequence([seed, rank, step]).generate_state(1, np.uint64)[0] >> 1)
    _seed_everything(derived)


def _reference_scorer(cfg: TrainConfig, plan: RunPlan, model, name_or_path: str):
    scoring = plan.scoring
    if cfg.model.lora.enabled:
        def score(ids, mask, plen):
            with reference_context(model):
                return scoring.score_rows(model, ids, mask, plen)[0]
        return score
    ref = load_reference_model(name_or_path, dtype=cfg.model.dtype, device=model.device)
    if cfg.training.strategy == "fsdp2":
        shard_model(ref)

    def score(ids, mask, plen):
        return scoring.score_rows(ref, ids, mask, plen)[0]
    return score


def _check_backend_available(cfg: TrainConfig) -> None:
    """Fail before the model loads when the chosen generation backend cannot run here."""
    g = cfg.generation
    if g.backend == "vllm" and importlib.util.find_spec("vllm") is None:
        raise ConfigError(
            "generation.backend: vllm needs the vllm package: pip install 'maxent-grpo[vllm]' on a GPU machine, "
            "or bash scripts/setup_vllm.sh for vLLM's CPU build"
        )
    if g.backend == "vllm_server" and g.vllm.weight_sync == "nccl":
        raise ConfigError(
            "generation.vllm.weight_sync: nccl is not implemented in this version (docs/VLLM.md); use disk"
        )
    if g.backend == "vllm_server":
        from maxent_grpo.rollout.vllm_server import served_model

        served_model(g.vllm.server_url, timeout_s=g.vllm.request_timeout_s)  # reachable, one model


def _generation_backend(
    cfg: TrainConfig, model, tokenizer, model_path: str, output_dir: Path, dist: Dist, *, fsdp2: bool
):
    g = cfg.generation
    sample_dtype = None if g.dtype is None else parse_dtype(g.dtype)
    if g.backend == "hf":
        return HFGenerationBackend(
            model, tokenizer, batch_size=g.batch_size, dtype=sample_dtype, share_prompts=cfg.training.share_prompts,
            # Sharded: every forward gathers weights with the other ranks, so every rank
            # runs generate to the longest row of any rank.
            synced_gpus=fsdp2,
        )
    if g.backend == "vllm":
        from maxent_grpo.rollout.vllm_colocate import VLLMColocateBackend

        return VLLMColocateBackend(
            model_path, tokenizer, model_dtype=model.dtype, sample_dtype=sample_dtype,
            gpu_memory_utilization=g.vllm.gpu_memory_utilization, max_model_len=g.vllm.max_model_len,
            enable_sleep_mode=g.vllm.enable_sleep_mode, enforce_eager=g.vllm.enforce_eager,
            world_size=dist.world_size, seed=cfg.training.seed,
        )
    from maxent_grpo.rollout.vllm_server import VLLMServerBackend

    backend = VLLMServerBackend(
        g.vllm.server_url, tokenizer,
        sync_dir=g.vllm.sync_dir if g.vllm.sync_dir is not None else output_dir / "vllm_weights",
        is_main=dist.is_main, barrier=dist.barrier, timeout_s=g.vllm.request_timeout_s,
    )
    # The server may still hold another run's weights: start it from this policy.
    backend.sync_weights(model)
    return backend


def build_run(
    cfg: TrainConfig, *, resume: str | bool | None = None, overwrite: bool = False, allow_config_change: bool = False,
) -> Run:
    """Everything a run needs, checked in the order of their cost: the output folder,
    the resume checkpoint's config, data, rewards, the generation backend, then the model."""
    dist = Dist.init(cfg.training.dist_timeout_minutes)
    log_device(dist)
    fsdp2 = cfg.training.strategy == "fsdp2"
    if fsdp2 and dist.world_size == 1:
        raise ConfigError("training.strategy: fsdp2 needs several processes (torchrun --nproc_per_node N); "
                          "with one process use ddp")
    cfg = resolve_precision(cfg, bf16_is_fast(dist.device))
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
    _seed_everything(cfg.training.seed + dist.rank)

    # Data and rewards first: their errors must come before the slow model load.
    dataset = load_prompt_dataset(
        cfg.data.source, split=cfg.data.split, prompt_column=cfg.data.prompt_column,
        answer_column=cfg.data.answer_column, size=cfg.data.size, seed=cfg.training.seed,
        instruction=cfg.data.instruction, task_kwargs=cfg.data.task_kwargs,
    )
    train_ds, eval_ds = dataset, None
    if cfg.data.eval_size > 0:
        train_ds, eval_ds = split_train_eval(dataset, cfg.data.eval_size, cfg.training.seed)
    per_step = cfg.training.prompts_per_step * dist.world_size
    if per_step > len(train_ds):
        raise ConfigError(
            f"training.prompts_per_step: {cfg.training.prompts_per_step} prompts x {dist.world_size} process(es) per "
            f"step is more than the {len(train_ds)} training rows of {cfg.data.source}"
        )
    reward_spec = build_reward_spec(cfg.rewards)
    _check_backend_available(cfg)
    model_path = resolve_model_path(cfg.model.name_or_path)
    if dist.is_main:
        save_config(cfg, output_dir / "config.yaml", header=history)
        write_text_atomic(output_dir / "run_info.json", json.dumps(
            {"method": cfg.method, **method.identity(), "model": model_path, "world_size": dist.world_size}, indent=2
        ))
    log.info("method %s: family=%s loss=%s weighting=%s", method.name, method.family, method.loss.policy_loss,
             method.weighting)

    model, tokenizer = load_model_and_tokenizer(
        model_path, dtype=master_dtype(cfg.model.dtype, cfg.model.lora.enabled), device=dist.device,
    )
    if cfg.model.lora.enabled:
        lc = cfg.model.lora
        model = apply_lora(model, r=lc.r, alpha=lc.alpha, dropout=lc.dropout, target_modules=lc.target_modules)
    if cfg.training.gradient_checkpointing:
        enable_activation_checkpointing(model)
    if fsdp2:
        # Before the optimizer exists: it must hold the sharded parameters.
        shard_model(model, mixed_precision=dist.device.type == "cuda" and cfg.training.autocast_bf16)
    reference = _reference_scorer(cfg, plan, model, model_path) if method.needs_reference else None

    optimizer, lr_scheduler = build_optimizer(model, cfg.training)
    train_model, gradient_sync = model, fsdp2_gradient_sync(model) if fsdp2 else None
    if dist.world_size > 1 and not fsdp2:
        train_model = DataParallelPolicy(model, device_ids=[dist.device.index] if dist.device.type == "cuda" else None,
                                         gradient_as_bucket_view=True)
        gradient_sync = ddp_gradient_sync(train_model)

    sampler = PromptSampler(
        train_ds, cfg.training.prompts_per_step * dist.world_size, seed=cfg.training.seed,
        shuffle=cfg.data.shuffle, num_epochs=cfg.data.num_epochs,
    )
    ctx = PipelineContext(
        plan=plan, model=model, tokenizer=tokenizer,
        backend=_generation_backend(cfg, model, tokenizer, model_path, output_dir, dist, fsdp2=fsdp2),
        reward_spec=reward_spec, weighting=weighting_from_config(cfg), dist=dist, reference_logps=reference,
    )
    run = Run(
        cfg=cfg, output_dir=output_dir, ctx=ctx, train_model=train_model, optimizer=optimizer,
        lr_scheduler=lr_scheduler, sampler=ShardedSampler(sampler, dist),
        trackers=make_trackers(cfg.logging.report_to if dist.is_main else [], output_dir, config=to_dict(cfg)),
        comm=Comm(world_size=dist.world_size, all_reduce_sum=dist.all_reduce_sum, gradient_sync=gradient_sync),
        eval_rows=list(eval_ds) if eval_ds is not None else [], lock=lock,
    )
    if ckpt is not None:
        _resume(run, ckpt)
    return run


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
    load = load_sharded_checkpoint if run.cfg.training.strategy == "fsdp2" else load_checkpoint
    state = load(ckpt, model=run.ctx.model, optimizer=run.optimizer, lr_scheduler=run.lr_scheduler)
    run.ctx.backend.sync_weights(run.ctx.model)
    run.sampler.sampler.load_state_dict(state["sampler"])
    restore_controller_state(run.ctx.weighting, state["controller"])
    run.ctx.skips.update(state["skips"])
    run.start_step, run.resumed = int(state["step"]), True
    log.info("resumed from %s at step %d", ckpt, run.start_step)
