"""Wiring: build the model, reference, data, rewards, generator, optimizer and state of a run."""

from __future__ import annotations

import json
import logging
import os
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import torch

from maxent_grpo.core.step import Comm
from maxent_grpo.envs import ENVIRONMENT_COLUMN
from maxent_grpo.data.datasets import PromptSampler
from maxent_grpo.models import resolve_model_path
from maxent_grpo.rewards.registry import build_reward_spec
from maxent_grpo.rollout.backends import BACKENDS
from maxent_grpo.rollout.open_plane import open_data_plane
from maxent_grpo.rollout.transferqueue_ray import Ranks
from maxent_grpo.run_files import write_text_atomic
from maxent_grpo.core.entropy_control import EntropyCoefState
from maxent_grpo.core.mode_bank import ModeBank
from maxent_grpo.training.checkpoint import (
    CheckpointError, find_latest_checkpoint, load_reference_state, read_trainer_state,
)
from maxent_grpo.training.collapse import CollapseWatch
from maxent_grpo.training.data import load_rows, row_episodes
from maxent_grpo.training.distributed import Dist, log_device
from maxent_grpo.training.host_memory import host_memory_release
from maxent_grpo.training.micro_batches import DTYPE_BYTES, MicroBatchBudget, device_budget
from maxent_grpo.training.model_shape import Shape
from maxent_grpo.training.pipeline import PipelineContext
from maxent_grpo.training.run_plan import RunPlan, describe_rollout_correction, with_run_length
from maxent_grpo.training.policy import build_optimizer, load_policy, load_reference, reference_scorer
from maxent_grpo.training.rollout_queue import RolloutQueue
from maxent_grpo.training.run_dir import (
    ResumeRequest, RunDirError, RunLock, claim_output_dir, config_history, history_line, resume_changes,
    resume_request, save_config,
)
from maxent_grpo.training.sampler import SamplerProcess, build_sampler, describe_sampling
from maxent_grpo.training.seeding import seed_everything
from maxent_grpo.training.strategy import STRATEGIES, Strategy
from maxent_grpo.training.teacher import check_teacher, teacher_scorer
from maxent_grpo.training.trackers import make_trackers, require_trackers
from maxent_grpo.training.train_state import TrainState

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
    """A run, built from its plan (``ctx.plan``; its configuration as data is ``plan.source``): the parts
    that do the work, and its live :class:`TrainState` (``state``), the one record a checkpoint saves."""

    output_dir: Path
    ctx: PipelineContext
    state: TrainState
    rollouts: RolloutQueue  # the batches of the coming steps: sampled, waiting on the data plane
    train_model: torch.nn.Module  # DDP-wrapped with several processes (FSDP2: the sharded model itself)
    optimizer: torch.optim.Optimizer
    lr_scheduler: object
    sampler: ShardedSampler
    trackers: object
    comm: Comm  # how grpo_step reaches the other processes
    strategy: Strategy  # how the policy is spread over them, and how it is saved
    eval_rows: list[dict] = field(default_factory=list)
    lock: RunLock | None = None  # held by the main process until finish()
    # The separate reference model (None: no reference, or LoRA's adapters-off base); loss.sync_ref_model
    # moves it toward the policy, and it is then saved with every checkpoint.
    reference: torch.nn.Module | None = None
    # Hands freed host memory back to the OS between the policy's passes (training.release_host_memory;
    # None when off, and on a GPU): training/host_memory.py.
    release_host_memory: Callable[[], None] | None = None
    # training.micro_batch_size: auto on CUDA: what each step's micro-batches may take (None: plan.micro_batch_size rows).
    micro_batch_budget: MicroBatchBudget | None = None

    @property
    def plan(self) -> RunPlan:
        return self.ctx.plan

    def save(self, data_state: dict | None = None) -> Path | None:
        """Write the checkpoint of the state's step (none for step 0); return its folder. ``data_state``:
        the sampler's position from before a step abandoned half-way."""
        step = self.state.step
        if step == 0:
            return None
        return self.strategy.save(
            self.output_dir, step, model=self.ctx.model, tokenizer=self.ctx.tokenizer, optimizer=self.optimizer,
            lr_scheduler=self.lr_scheduler, trainer_state={
                **self.state.to_dict(self.plan.source, data_state), **self.rollouts.state_dict(step, self.ctx.dist)},
            keep_last=self.plan.schedule.keep_last,
            # A reference that follows the policy is state: a resumed run must score against the same one.
            reference_state=None if self.plan.ref_sync is None else dict(self.reference.named_parameters()),
        )

    def finish(self) -> None:
        self.rollouts.close()
        self.trackers.close()
        if self.lock is not None:
            self.lock.release()


def build_run(
    plan: RunPlan, *, resume: str | bool | None = None, overwrite: bool = False, allow_config_change: bool = False,
) -> Run:
    """Everything a run needs, checked in the order of their cost: the tracker packages, the output
    folder, the resume checkpoint's config, data, rewards, the generation backend, then the model."""
    request = resume_request(resume)
    # Every process checks (the main one starts them): all ranks refuse together, none waits for the others.
    require_trackers(list(plan.logging.report_to))
    dist = Dist.init(plan.dist_timeout_minutes)
    log_device(dist)
    strategy = STRATEGIES[plan.strategy](dist)
    output_dir = Path(plan.logging.output_dir)
    lock = _claim(output_dir, dist, resume=request is not None, overwrite=overwrite)
    # A run that fails to start gives its folder back: the same process (a notebook) may start it again.
    try:
        return _build_claimed(plan, dist, strategy, output_dir, lock, request, allow_config_change)
    except BaseException:
        if lock is not None:
            lock.release()
        raise


def _build_claimed(plan: RunPlan, dist: Dist, strategy: Strategy, output_dir: Path, lock: RunLock | None,
                   request: ResumeRequest | None, allow_config_change: bool) -> Run:
    ckpt = _resume_checkpoint(output_dir, request, dist)
    history = _checked_history(plan, output_dir, request, ckpt, allow_config_change)
    method = plan.method
    seed_everything(plan.seed + dist.rank)

    # Data and rewards first: their errors must come before the slow model load.
    train_ds, eval_rows = load_rows(plan.data, plan.batch.prompts_per_step, dist.world_size, plan.schedule.max_steps)
    counted = plan.schedule.max_steps is None
    plan = with_run_length(plan, len(train_ds), dist.world_size)
    episodes = row_episodes(plan.data, train_ds[ENVIRONMENT_COLUMN] if ENVIRONMENT_COLUMN in train_ds.column_names
                            else None)
    reward_spec = build_reward_spec(list(plan.rewards))
    given = plan.model.given  # a model object from Python: no folder to read (model_path None)
    model_path = None if given is not None else resolve_model_path(plan.model.name_or_path)
    # training.micro_batch_size: auto on CUDA sizes from the model's shape: a config it cannot read fails before the load.
    shape = None
    if plan.micro_batch_from_memory:
        shape = (Shape.from_config(given.config.to_dict()) if given is not None
                 else Shape.from_pretrained(model_path, "training.micro_batch_size: auto"))
    if model_path is not None:
        BACKENDS[plan.sampler.backend].check(plan.sampler.vllm, model_path)
    teacher_path = None if plan.teacher is None else check_teacher(
        plan.teacher, model_path if plan.model.given_tokenizer is None else plan.model.given_tokenizer)
    if dist.is_main:
        _write_run_files(plan, output_dir, history, model_path, dist.world_size)
    _log_start(plan, dist.world_size, len(train_ds) if counted else None)

    # The reference first: of a model object it copies the weights before the policy's own changes.
    ref_model = load_reference(plan.model, model_path, strategy) if method.needs_reference else None
    model, tokenizer = load_policy(plan.model, model_path, strategy)
    reference = reference_scorer(plan.scoring, model, ref_model) if method.needs_reference else None
    teacher = None if plan.teacher is None else teacher_scorer(plan.teacher, teacher_path, plan.scoring, strategy)
    optimizer, lr_scheduler = build_optimizer(model, plan.optimizer)
    train_model, gradient_sync = strategy.wrap(model)

    sampler = PromptSampler(
        train_ds, plan.batch.prompts_per_step * dist.world_size, seed=plan.seed,
        shuffle=plan.data.shuffle, num_epochs=plan.data.num_epochs,
    )
    backend = build_sampler(
        plan.sampler, model, tokenizer, model_path, seed=plan.seed, sync_dir=output_dir / "vllm_weights",
        prompts=lambda: [*train_ds["prompt"], *(r["prompt"] for r in eval_rows)],
        process=SamplerProcess(world_size=dist.world_size, is_main=dist.is_main, any_rank=dist.any_rank,
                               synced_gpus=strategy.collective_forward),
    )
    # Every model and the engine are in memory now; the first optimizer step still adds gradients and AdamW state.
    budget = None if shape is None else device_budget(
        model, shape, dist, compute_bytes=2 if plan.model.autocast_bf16 else DTYPE_BYTES[plan.model.dtype],
        gradient_checkpointing=plan.model.gradient_checkpointing, num_generations=plan.batch.num_generations)
    if budget is not None:
        log.info("training.micro_batch_size auto: %s", budget.describe())
    ctx = PipelineContext(
        plan=plan, model=model, tokenizer=tokenizer, backend=backend, reward_spec=reward_spec,
        dist=dist, reference_logps=reference, teacher_logps=teacher,
        episodes=episodes,
        steps_per_epoch=len(train_ds) / (plan.batch.prompts_per_step * dist.world_size),
        recovers_lost_server=BACKENDS[plan.sampler.backend].recovers_lost_server,
    )
    sharded = ShardedSampler(sampler, dist)
    run = Run(
        output_dir=output_dir, ctx=ctx, state=_initial_state(plan, sampler), rollouts=_rollout_queue(ctx, sharded),
        train_model=train_model, optimizer=optimizer,
        lr_scheduler=lr_scheduler, sampler=sharded,
        trackers=make_trackers(list(plan.logging.report_to) if dist.is_main else [], output_dir, config=plan.source,
                               observers=plan.logging.observers if dist.is_main else ()),
        comm=Comm(world_size=dist.world_size, all_reduce_sum=dist.all_reduce_sum, gradient_sync=gradient_sync),
        strategy=strategy, eval_rows=eval_rows, lock=lock, reference=ref_model,
        release_host_memory=host_memory_release(dist.device.type) if plan.release_host_memory else None,
        micro_batch_budget=budget,
    )
    if ckpt is not None:
        try:
            _resume(run, ckpt)
        except BaseException:
            run.finish()
            raise
    return run


def _write_run_files(plan: RunPlan, output_dir: Path, history: list[str], model_path: str | None,
                     world_size: int) -> None:
    """The run folder's ``config.yaml`` (with its history of resumes) and ``run_info.json`` (the main process's)."""
    method = plan.method
    save_config(plan.source, output_dir / "config.yaml", header=history)
    write_text_atomic(output_dir / "run_info.json", json.dumps(
        {"method": method.name, **method.identity(), "model": model_path or plan.model.name_or_path,
         "world_size": world_size}, indent=2
    ))


def _log_start(plan: RunPlan, world_size: int, counted_rows: int | None) -> None:
    """What the run is, in the log before the models load: each ``auto`` resolved, the method, the global
    batch, the run's length when it was counted from ``counted_rows`` training rows, sampling, the correction."""
    method = plan.method
    for note in plan.notes:
        log.info("%s", note)
    log.info("method %s: family=%s loss=%s weighting=%s", method.name, method.family, method.loss.policy_loss,
             method.weighting)
    log.info("%s", plan.global_batch(world_size))
    if counted_rows is not None:
        log.info("run length: %d steps (data.num_epochs=%d passes over %d training rows, %d per step)",
                 plan.schedule.max_steps, plan.schedule.num_epochs, counted_rows,
                 plan.batch.prompts_per_step * world_size)
    log.info("%s", describe_sampling(plan.sampler))
    log.info("rollout correction: %s", describe_rollout_correction(method.loss))


def _initial_state(plan: RunPlan, sampler: PromptSampler) -> TrainState:
    return TrainState(
        data=sampler,
        # The live controller state starts from the plan's settings; the plan itself is never changed.
        controllers=plan.weighting.controller_state,
        collapse=CollapseWatch(plan.logging.collapse_window, plan.method.collapse_advice),
        bank=ModeBank(plan.replay.capacity, plan.replay.groups_per_step) if plan.replay.enabled else None,
        entropy=EntropyCoefState(plan.method.loss.entropy_coef) if plan.adaptive_entropy is not None else None,
    )


def _rollout_queue(ctx: PipelineContext, sharded: ShardedSampler) -> RolloutQueue:
    """The queue on its data plane. On a joined Ray cluster every rank opens the plane here, in its main
    thread: rank 0 starts it, and the ranks agree (collectives) before the others connect."""
    plan, r, dist = ctx.plan, ctx.plan.rollout, ctx.dist
    ranks = Ranks(rank=dist.rank, world_size=dist.world_size, gather=dist.gather_objects)
    plane = open_data_plane(r.data_plane, ray=r.transferqueue_ray, ray_address=r.transferqueue_ray_address,
                            ranks=ranks)
    return RolloutQueue(
        ctx, sharded.next_batch, plane,
        max_staleness=r.max_staleness, beside=BACKENDS[plan.sampler.backend].samples_beside,
        seed=plan.seed, wait_timeout_s=r.wait_timeout_s,
    )


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


def _resume_checkpoint(output_dir: Path, request: ResumeRequest | None, dist: Dist) -> Path | None:
    """The checkpoint to resume from. The main process alone looks for the latest complete one (it hashes
    every file and removes dead saves' leftovers) and tells the others, so every rank resumes from the same."""
    if request is None:
        return None
    if request.path is not None:
        return request.path
    ckpt = find_latest_checkpoint(output_dir) if dist.is_main else None
    ckpt = dist.broadcast_object(ckpt)
    restart = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
    again = f" (torchrun restart {restart})" if restart != "0" else ""
    if ckpt is None:
        log.info("--resume auto%s: no complete checkpoint under %s; starting from step 0", again, output_dir)
    else:
        log.info("--resume auto%s: continuing from %s", again, ckpt)
    return ckpt


def _checked_history(plan: RunPlan, output_dir: Path, request: ResumeRequest | None, ckpt: Path | None,
                     allow_config_change: bool) -> list[str]:
    """The resume history for config.yaml, after checking the new config against the run's."""
    history = config_history(output_dir / "config.yaml")
    if ckpt is not None:
        saved = read_trainer_state(ckpt)
        changes = resume_changes(
            saved.get("config") or _saved_config(output_dir), plan.source, allow_change=allow_config_change,
        )
        history.append(history_line(int(saved["step"]), changes))
    elif request is not None and (output_dir / "config.yaml").is_file():
        # A run with no complete checkpoint yet starts again from step 0 in its folder: only as the same run.
        resume_changes(_saved_config(output_dir), plan.source, allow_change=allow_config_change)
    return history


def _saved_config(output_dir: Path) -> dict:
    """The config of a run saved before checkpoints held their config: its config.yaml."""
    import yaml

    path = output_dir / "config.yaml"
    if not path.is_file():
        raise CheckpointError(f"--resume: the checkpoint holds no config and {path} is missing; cannot check the "
                              "new config against the run's")
    return yaml.safe_load(path.read_text())


def _resume(run: Run, ckpt: Path) -> None:
    saved = run.strategy.load(ckpt, model=run.ctx.model, optimizer=run.optimizer, lr_scheduler=run.lr_scheduler)
    run.ctx.backend.sync_weights(run.ctx.model)
    if run.plan.ref_sync is not None:
        load_reference_state(ckpt, run.reference)
    run.state.restore(saved, replay=run.plan.replay, where=ckpt)
    run.rollouts.load_state_dict(saved, run.ctx.dist)
    log.info("resumed from %s at step %d", ckpt, run.state.step)
