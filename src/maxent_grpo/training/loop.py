"""``train()``: the whole loop, top to bottom.

the batch (synchronous: ``prepare_training_batch``, generate -> reward -> score -> weight in a row;
otherwise the ``RolloutQueue``'s rollouts, sampled ``rollout.max_staleness`` steps ahead or through
another data plane, then ``finish_batch``) -> loss and step (``grpo_step``) -> weights to the sampler
-> controllers -> evaluate -> log -> checkpoint.
"""

from __future__ import annotations

import dataclasses
import functools
import logging
import time
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import torch
from tqdm.auto import tqdm

from maxent_grpo.core.entropy_control import update_entropy_coef
from maxent_grpo.core.reference_sync import due, mix_into_reference
from maxent_grpo.core.step import OptimizerUpdate, StepHooks, grpo_step
from maxent_grpo.errors import UserError
from maxent_grpo.kill_points import kill_point
from maxent_grpo.rollout.backend import SamplerGone
from maxent_grpo.core.controllers import step_controllers
from maxent_grpo.rewards.maxent import weighting_at
from maxent_grpo.training.checkpoint import find_latest_checkpoint
from maxent_grpo.training.distributed import process_group
from maxent_grpo.training.interrupt import RunInterrupted, StopSignals
from maxent_grpo.training.learning_signal import no_signal_cause
from maxent_grpo.training.metrics import MetricsLog, MetricsSink, log_training_step, read_metrics, summarize_weight_stats
from maxent_grpo.training.pipeline import PreparedBatch, count_batch, finish_batch, prepare_training_batch
from maxent_grpo.training.run_plan import RunPlan, with_beta
from maxent_grpo.training.replay import admit_batch, replay_batch
from maxent_grpo.training.setup import Run, build_run
from maxent_grpo.training.validation import validate

log = logging.getLogger("maxent_grpo")


class TrainingError(UserError):
    """The run cannot go on; the message says why and where its last checkpoint is."""


@dataclass(frozen=True)
class RunSummary:
    """What a finished run leaves: where, how far, and the checkpoint to use."""

    output_dir: Path
    steps: int
    checkpoint: Path | None  # the final one
    metrics: list[dict]  # every step of the run, resumed parts included (main process)


def train(
    plan: RunPlan, *, resume: str | bool | None = None, overwrite: bool = False, allow_config_change: bool = False,
) -> RunSummary:
    """Train according to ``plan`` (``compile_run``'s). Raises :class:`RunInterrupted` on SIGINT/SIGTERM (after
    saving), :class:`TrainingError` when batches keep failing (after saving)."""
    with process_group(plan.dist_timeout_minutes):
        # The run lives in the call below and is gone when the group is left (process_group).
        return _build_and_train(plan, resume, overwrite, allow_config_change)


def _build_and_train(plan: RunPlan, resume, overwrite: bool, allow_config_change: bool) -> RunSummary:
    run = build_run(plan, resume=resume, overwrite=overwrite, allow_config_change=allow_config_change)
    stop = StopSignals.install()
    try:
        return _train(run, stop)
    finally:
        run.finish()
        stop.restore()


def _train(run: Run, stop: StopSignals) -> RunSummary:
    ctx, schedule, state = run.ctx, run.plan.schedule, run.state
    # Only the main process owns metrics.jsonl: two processes truncating it on resume would race.
    metrics_log = (
        MetricsLog(run.output_dir / "metrics.jsonl", resume_after_step=state.start_step if state.resumed else None)
        if ctx.dist.is_main else None
    )
    sink = MetricsSink(ctx.dist, metrics_log, run.trackers, run.output_dir)
    bar = tqdm(
        total=schedule.max_steps, initial=state.start_step, desc=run.plan.method.name, unit="step",
        disable=not (run.plan.logging.progress_bar and ctx.dist.is_main), dynamic_ncols=True,
    )
    last_save = time.monotonic()
    while state.step < schedule.max_steps:
        step = state.step
        t_start, cpu_start = time.perf_counter(), time.process_time()
        data_before = state.data.state_dict()
        try:
            # Batch `step` (sampled now, or rollout.max_staleness steps ago) and the sampling of the
            # coming ones; each batch draws from its own seed (run seed, rank, batch), so a resumed
            # run or any number of processes samples exactly what an uninterrupted run would.
            record = None  # a batch the rollout queue hands over, counted below
            weighting = weighting_at(run.plan.weighting, state.controllers)  # the live tau and beta
            if run.rollouts.synchronous:
                outcome = prepare_training_batch(ctx, ctx.backend, run.rollouts.draw(step), weighting=weighting,
                                                 skips=state.skips, step=step, more_rows=run.rollouts.draw_rows)
            else:
                run.rollouts.begin_step(step)
                record = run.rollouts.take(step)
                outcome = finish_batch(ctx, record, weighting)
            if isinstance(outcome, PreparedBatch) and not ctx.dist.any_rank(outcome.has_signal):
                _count_no_signal(run, outcome, step + 1)
        except StopIteration:
            log.info("data exhausted after %d epochs at step %d", schedule.num_epochs, step)
            break
        except SamplerGone as err:  # on every process alike (pipeline.settle_sampling): saved as before the step
            raise _sampler_lost(run, step, err, data_state=data_before) from None
        except KeyboardInterrupt:
            with stop.protected():
                raise _abandoned(run, data_before) from None
        # From here to the end of the step a second Ctrl-C finishes the step (and its metrics
        # line and checkpoint) rather than tearing it; the stop check then saves and exits.
        with stop.protected():
            # A queued batch is counted once the step is sure to end: a step abandoned before this point
            # saves it (still on the plane) for the resumed run, which counts it then.
            prepared = outcome if record is None else count_batch(record, outcome, state.skips)
            if prepared is None:
                lost = _end_step(run, step)  # the batch sampled meanwhile waits for the next step
                if lost is not None:
                    raise _sampler_lost(run, step, lost)
                if state.skips.in_a_row >= schedule.max_consecutive_skips:
                    raise _too_many_skips(run, step)
            else:
                metrics = _update_and_log(run, prepared, t_start, cpu_start, sink)
                step = state.step
                reward_comp = prepared.reward_comp
                for line in state.constant_rewards.observe(reward_comp.per_function, reward_comp.reward_names):
                    _warn(run, "constant_reward", line, step)
                line = state.collapse.observe(metrics)
                if line is not None:
                    _warn(run, "collapse", line, step)
                bar.update(1)
                bar.set_postfix(_postfix(metrics), refresh=False)
            if _stop_requested(run, stop):
                raise _interrupted(run)
            if prepared is not None and step < schedule.max_steps and _save_due(run, step, last_save):
                run.save()
                last_save = time.monotonic()
    bar.close()
    with stop.protected():
        final = run.save() if schedule.save_final else None
    history = read_metrics(run.output_dir / "metrics.jsonl") if ctx.dist.is_main else []
    return RunSummary(run.output_dir, state.step, final, history)


def _update_and_log(run: Run, prepared: PreparedBatch, t_start: float, cpu_start: float, sink: MetricsSink) -> dict:
    """The optimizer step on ``prepared``, the controllers, and the step's metrics (returned); advances
    ``run.state.step``."""
    ctx, plan, state = run.ctx, run.plan, run.state
    step = state.step
    timings = dict(prepared.timings)
    t_policy = time.perf_counter()
    result = _policy_update(run, prepared, step + 1, timings)
    timings["time/policy"] = time.perf_counter() - t_policy - timings["time/optimizer"]
    lost = _end_step(run, step, trained=True)
    timings.update(run.rollouts.metrics(step, prepared.version))
    state.step = step = step + 1

    # Controllers run once per step on globally averaged inputs (§8).
    view = summarize_weight_stats(ctx.dist, prepared.weight_stats) if prepared.weight_stats is not None else None
    kl = ctx.dist.mean(result.metrics["kl"]) if "kl" in result.metrics else None
    state.controllers = step_controllers(state.controllers, plan.weighting.controller_settings,
                                         None if view is None else view.entropy, kl, step)

    timings["time/total"] = time.perf_counter() - t_start
    if "replay/time_s" in timings:  # what verified replay costs: its passes and its admission, of the whole step
        timings["replay/time_share"] = (timings["replay/time_s"] + timings["time/replay_admission"]) / timings["time/total"]
    timings["step_cpu_time"] = time.process_time() - cpu_start
    extra = state.skips.metrics()
    if lost is None and run.eval_rows and plan.schedule.eval_due(step):
        t_eval = time.perf_counter()
        extra.update(validate(run, step))
        extra["time/eval"] = time.perf_counter() - t_eval
    metrics = log_training_step(
        prepared, result, sink, step=step, extra=extra, completion_table=plan.logging.completions_due(step),
        learning_rate=run.lr_scheduler.get_last_lr()[0], timings=timings, controller=_controller_metrics(run),
        max_completion_length=plan.method.loss.max_completion_length, weight_view=view,
    )
    if lost is not None:  # the step is trained and logged: keep it, then stop
        raise _sampler_lost(run, step, lost)
    return metrics


def _policy_update(run: Run, prepared, step: int, timings: dict):
    """Train on ``prepared`` as optimizer step ``step``."""
    ctx, plan, state = run.ctx, run.ctx.plan, run.state
    timings["time/optimizer"] = 0.0
    hooks = StepHooks(update=OptimizerUpdate(plan.max_grad_norm, run.lr_scheduler),
                      phase=functools.partial(_timed_phase, run.ctx.dist.device, step, timings), release=run.release_host_memory)

    # The proximal anchor (ALGORITHMS.md §15) is the trainer's own log-probs before the update. With
    # one pass over the batch the weights move only after its last micro-batch, so every micro-batch's
    # own log-probs, detached, are that anchor, fresh or stale batch alike (old_logps=None): no
    # extra forward. Only passes after the first (num_iterations > 1) need it kept from before.
    old_logps = _old_logps(run, prepared) if plan.num_iterations > 1 else None
    spec = with_beta(plan, state.controllers.beta)
    if state.entropy is not None:  # loss.adaptive_entropy: the coefficient the last step left
        spec = dataclasses.replace(spec, entropy_coef=state.entropy.applied(plan.adaptive_entropy))
    replay, bank_metrics = _replay(run, prepared, timings)
    rows = _micro_batch_rows(run, prepared.packed)
    micro_batches = prepared.micro_batches(rows, old_logps)
    for _ in range(plan.num_iterations):
        result = grpo_step(run.train_model, run.optimizer, micro_batches, spec, plan.scoring,
                           comm=run.comm, hooks=hooks, replay=replay)
    result.metrics.update(bank_metrics)
    # What one policy pass over the batch computes, against its real tokens (padding, shared prompts, packing).
    result.metrics["tokens/policy_forward"] = float(sum(
        plan.scoring.forward_positions(run.train_model, mb.input_ids, mb.attention_mask, mb.prompt_length)
        for mb in micro_batches))
    result.metrics["tokens/real"] = float(prepared.total_input_tokens)
    result.metrics["micro_batch/rows"] = float(rows)
    if plan.ref_sync is not None:  # loss.sync_ref_model: after the step's optimizer update, when due
        synced = due(step, plan.ref_sync.sync_steps)
        if synced:
            mix_into_reference(run.reference, ctx.model, plan.ref_sync.alpha)
        result.metrics["reference/synced"] = float(synced)
    if state.entropy is not None:
        result.metrics["entropy_coef"] = spec.entropy_coef
        state.entropy = update_entropy_coef(state.entropy, result.metrics["entropy"], plan.adaptive_entropy)
    return result


def _micro_batch_rows(run: Run, packed) -> int:
    """Rows per micro-batch: the plan's, or under a memory budget (``training.micro_batch_size: auto``
    on CUDA) the most whole groups that fit at this step's lengths, the longest over ranks so that
    every rank splits alike."""
    budget = run.micro_batch_budget
    if budget is None:
        return run.plan.micro_batch_size
    seq_len, completion_len = run.ctx.dist.max_over_ranks(
        [packed.input_ids.shape[1], packed.completion_mask.shape[1]])
    return budget.rows(packed.input_ids.shape[0], seq_len, completion_len)


_PHASE_TIMINGS = {"replay": "replay/time_s", "update": "time/optimizer"}


@contextmanager
def _timed_phase(device: torch.device, step: int, timings: dict, name: str):
    """``grpo_step``'s phases, their seconds added to ``timings``: the replay pass to ``replay/time_s``,
    the optimizer update to ``time/optimizer``. On a GPU the device is drained before and after the
    replay, so its clock holds the replay's kernels and no other's."""
    if name == "update":
        kill_point("step.after_backward", step)
    drain = name == "replay" and device.type == "cuda"
    if drain:
        torch.cuda.synchronize(device)
    t0 = time.perf_counter()
    try:
        yield
    finally:
        if drain:
            torch.cuda.synchronize(device)
        timings[_PHASE_TIMINGS[name]] += time.perf_counter() - t0


def _replay(run: Run, prepared, timings: dict):
    """Verified mode replay (training/replay.py): admit this step's groups, then this step's replay
    batch (None while the bank is empty) and the bank's metrics. ``({}``, None) without replay."""
    bank = run.state.bank
    if bank is None:
        return None, {}
    timings["replay/time_s"] = 0.0  # the replay forward/backward (0 while the bank is empty): _timed_phase
    t0 = time.perf_counter()
    comp, packed = prepared.reward_comp, prepared.packed
    metrics = admit_batch(bank, prepared.rows, prepared.rollout, comp.per_function[:, 0],
                          packed.completion_mask.sum(dim=1) > 0, run.ctx.dist, prepared.grades)
    # The pad id the batch itself was packed with (pipeline.pack_rollout); its positions are masked anyway.
    replay = replay_batch(bank, run.plan.replay, prepared.rollout.num_generations, run.ctx.tokenizer.pad_token_id,
                          packed.input_ids.device, run.plan.micro_batch_size)
    timings["time/replay_admission"] = time.perf_counter() - t0
    return replay, metrics



def _end_step(run: Run, step: int, *, trained: bool = False) -> UserError | None:
    """The batch being sampled complete (from the old weights), then the new weights to the sampler.
    Returns the error of a sampler that is gone (a server died, a timeout), for the caller to stop on.
    Every rank returns one when any rank's batch failed: a rank that went on alone would wait in the
    weight push's collectives until the process group's timeout. (The push agrees within itself.)"""
    failed: UserError | None = None
    try:
        run.rollouts.end_step(step)
    except UserError as err:
        failed = err
    if run.ctx.dist.any_rank(failed is not None):
        return failed or UserError("another process's sampler failed (its error is in its log)")
    if trained:
        try:
            run.ctx.backend.sync_weights(run.ctx.model)
        except UserError as err:
            return err
    return None


def _sampler_lost(run: Run, step: int, err: UserError, data_state: dict | None = None) -> TrainingError:
    path = _save_or_latest(run, data_state)
    where = f"checkpoint {path}" if path is not None else "no checkpoint (no step had finished)"
    return TrainingError(f"the sampler failed after step {step}: {err}; {where}")


def _count_no_signal(run: Run, prepared, step: int) -> None:
    """No group on any rank has rewards that differ: every advantage is 0, so the policy term is
    skipped in effect. The step still runs (KL and entropy terms, the optimizer state, as in TRL)
    and does not count as a failure: a model that has mastered the task gets such batches too.
    The warning names what this process's batch shows of the cause (training/learning_signal.py)."""
    skips = run.state.skips.by_stage
    skips["no_signal"] += 1
    n = skips["no_signal"]
    if n == 1 or n % 10 == 0:
        cause = no_signal_cause(prepared.reward_comp.per_function, prepared.reward_comp.reward_names,
                                prepared.packed.truncated, run.plan.sampler.params.max_new_tokens)
        _warn(run, "no_signal", f"no learning signal: every group's completions got the same reward: {cause} "
              f"({n} such batches so far; skipped/no_signal in metrics.jsonl)", step)


def _warn(run: Run, kind: str, line: str, step: int) -> None:
    """A warning about the run's learning, on the console and in the trackers (``warnings/<kind>`` and
    the ``warnings`` table), from the main process."""
    if not run.ctx.dist.is_main:
        return
    log.warning(line)
    run.trackers.log({f"warnings/{kind}": 1.0}, step)
    run.trackers.log_table("warnings", ["step", "warning"], [[step, line]], step)


def _stop_requested(run: Run, stop: StopSignals) -> bool:
    # Every rank must stop after the same step: one that got the signal later would otherwise
    # go on to the next step's collectives alone.
    return run.ctx.dist.any_rank(stop.requested)


def _save_due(run: Run, step: int, last_save: float) -> bool:
    due = run.plan.schedule.save_due(step, (time.monotonic() - last_save) / 60)
    return run.ctx.dist.any_rank(due)  # clocks differ between processes; one decides for all


def _save_or_latest(run: Run, data_state: dict | None = None) -> Path | None:
    """A checkpoint of the state's step when this process trained one, else the latest there is;
    ``data_state``: the data sampler's state to save (a step cut short: as it was before the step)."""
    if run.state.step == run.state.start_step:
        return find_latest_checkpoint(run.output_dir)
    return run.save(data_state=data_state)


def _interrupted(run: Run) -> RunInterrupted:
    step, path = run.state.step, _save_or_latest(run)
    where = f"checkpoint {path}" if path is not None else "nothing to resume from (no step had finished)"
    return RunInterrupted(f"interrupted after step {step}: {where}", path, step)


def _abandoned(run: Run, data_before: dict) -> RunInterrupted:
    """A second signal cut the step short: save the state from before it (one process only:
    with several, the others may be inside a collective and a save could hang)."""
    step = run.state.step
    if run.ctx.dist.world_size == 1 and step > run.state.start_step:
        path = run.save(data_state=data_before)
    else:
        path = find_latest_checkpoint(run.output_dir)
    where = f"checkpoint {path}" if path is not None else "no checkpoint"
    return RunInterrupted(f"interrupted during step {step + 1} (abandoned): {where}", path, step)


def _too_many_skips(run: Run, step: int) -> TrainingError:
    path = _save_or_latest(run)
    where = f"checkpoint {path}" if path is not None else "no checkpoint (no step had finished)"
    skips = run.state.skips
    return TrainingError(
        f"{skips.in_a_row} batches in a row failed (training.max_consecutive_skips="
        f"{run.plan.schedule.max_consecutive_skips}) at step {step}; last error: {skips.last}; {where}"
    )


def _old_logps(run: Run, prepared) -> torch.Tensor:
    """Log-probs of the pre-update policy: the proximal anchor of a batch reused (num_iterations > 1)."""
    p = prepared.packed
    return run.ctx.plan.scoring.score_rows(run.ctx.model, p.input_ids, p.attention_mask, p.prompt_length)[0]


def _controller_metrics(run: Run) -> dict[str, float]:
    if not run.plan.method.logs_controllers:
        return {}
    live = run.state.controllers
    return {"tau": float(live.tau), "beta": float(live.beta)}


def _postfix(m: dict) -> dict[str, str]:
    out = {"reward": f"{m['reward']:.3f}"}
    if "kl" in m and m["kl"] is not None:
        out["kl"] = f"{m['kl']:.4f}"
    out["len"] = f"{m['completions/mean_length']:.0f}"
    out["s/step"] = f"{m['time/total']:.1f}"
    return out
