"""The rules between components (backend x LoRA x dtype x strategy x environment x staleness), in one place.

``compile_run`` calls :func:`check_run` on a configuration whose every key passed its own checks
(``config.validate``); each rule names the key to change and how.
"""

from __future__ import annotations

import contextlib
import difflib
import math
from collections.abc import Callable, Iterator

from maxent_grpo.core.bounds import SpecError
from maxent_grpo.envs import ENVIRONMENTS
from maxent_grpo.errors import ConfigError
from maxent_grpo.methods import get_method
from maxent_grpo.rollout.backends import BACKENDS
from maxent_grpo.rollout.vllm_weights import ENGINE_LORA_RANKS
from maxent_grpo.config.schema import TrainConfig, TrainingConfig
from maxent_grpo.training.precision import Machine
from maxent_grpo.training.replay import check_replay
from maxent_grpo.training.strategy import STRATEGIES, Strategy


def require(ok: bool, key: str, message: str) -> None:
    if not ok:
        raise ConfigError(f"{key}: {message}")


def suggest(name, options) -> str:
    close = difflib.get_close_matches(str(name), [str(o) for o in options], n=1)
    return f" (did you mean {close[0]!r}?)" if close else ""


@contextlib.contextmanager
def config_keys(key: str | Callable[[str], str]) -> Iterator[None]:
    """A record's bounds failing inside (``core.bounds.SpecError``, naming the record's own setting) become
    one ConfigError naming the config key: ``key`` the section the settings come from (``"loss"``:
    ``loss.<setting>``) or a function from the setting to its key."""
    try:
        yield
    except SpecError as err:
        name = key(err.setting) if callable(key) else f"{key}.{err.setting}"
        raise ConfigError(f"{name}: {err.problem}") from None


def prompts_per_step(cfg: TrainConfig) -> int:
    """Prompts each process draws per step: ``training.batch_size`` (completions, TRL's per-device
    convention) over ``num_generations`` when it is set, else ``training.prompts_per_step``."""
    t, g = cfg.training, cfg.generation
    if t.batch_size is None:
        return t.prompts_per_step
    require(t.batch_size % g.num_generations == 0, "training.batch_size",
            f"{t.batch_size} is not a multiple of generation.num_generations={g.num_generations}")
    prompts = t.batch_size // g.num_generations
    require(t.prompts_per_step in (prompts, TrainingConfig.prompts_per_step), "training.prompts_per_step",
            f"{t.prompts_per_step} contradicts training.batch_size={t.batch_size} "
            f"(= {prompts} prompts x {g.num_generations} completions); set one of them")
    return prompts


def check_run(cfg: TrainConfig, machine: Machine, master: str, *, eval_rows_given: bool = False) -> None:
    """Every rule that ties two sections; ``master``: the dtype the trained weights are stored in;
    ``eval_rows_given``: held-out rows came from Python (an eval_dataset) rather than data.eval_size."""
    g, t, lo, lora = cfg.generation, cfg.training, cfg.loss, cfg.model.lora.enabled
    strategy = STRATEGIES[t.strategy]
    if machine.processes is not None:
        require(machine.processes >= strategy.min_processes, "training.strategy",
                f"{strategy.name} needs several processes (torchrun --nproc_per_node N, "
                f"N >= {strategy.min_processes}); with one process use ddp")
    require(not (lora and cfg.model.lm_head_fp32 and "lm_head" in cfg.model.lora.target_modules),
            "model.lm_head_fp32", "the float32 head cannot be a LoRA-wrapped head; leave lm_head out of "
            "model.lora.target_modules")
    one_pass = t.inline_prompts is not False and t.packing is not False  # the prompt in its completions' forward
    require(not (t.gradient_checkpointing and t.share_prompts is True and not one_pass), "training.gradient_checkpointing",
            "needs training.share_prompts: false, or training.inline_prompts and training.packing on (a shared "
            "prompt's KV cache cannot be recomputed in the backward)")
    total = prompts_per_step(cfg) * g.num_generations
    require(t.micro_batch_size == "auto" or total % t.micro_batch_size == 0, "training.micro_batch_size",
            f"{t.micro_batch_size} does not divide the {total} completions of a step")
    require(g.vllm.max_model_len is None or g.vllm.max_model_len > g.max_new_tokens, "generation.vllm.max_model_len",
            f"must exceed generation.max_new_tokens={g.max_new_tokens}")
    if lo.adaptive_entropy:
        for name in ("entropy_target", "entropy_coef_delta", "entropy_coef_min", "entropy_coef_max"):
            value = getattr(lo, name)
            require(math.isfinite(value) and value >= 0, f"loss.{name}", f"must be finite and >= 0, got {value!r}")
        require(lo.entropy_coef_min <= lo.entropy_coef <= lo.entropy_coef_max, "loss.entropy_coef",
                f"the adaptive start value {lo.entropy_coef} must lie in [loss.entropy_coef_min, loss.entropy_coef_max]"
                f" = [{lo.entropy_coef_min}, {lo.entropy_coef_max}]")
    for key, problem in check_replay(cfg.replay, g.num_generations):
        require(False, key, problem)
    require(not cfg.replay.enabled or cfg.data.source.startswith(("modebench_pkg:", "modebench:")), "replay.enabled",
            f"needs a task whose verifier gives mode keys (data.source modebench_pkg:<domain> or modebench:<task>), "
            f"got data.source {cfg.data.source!r}")
    require(lo.advantage_estimator != "maxrl" or lo.policy_entropy_bonus_coef == 0, "loss.policy_entropy_bonus_coef",
            f"must be 0 with loss.advantage_estimator maxrl (the bonus makes rewards non-binary), "
            f"got {lo.policy_entropy_bonus_coef}")
    # Stale samples are trained with the decoupled objective (ALGORITHMS.md §15): clipped against the
    # trainer's log-probs at the step's start, weighted by the ratio to the sampler's.
    require(cfg.rollout.max_staleness == 0 or lo.rollout_correction != "none", "loss.rollout_correction",
            f"none leaves samples up to rollout.max_staleness={cfg.rollout.max_staleness} steps old uncorrected; "
            "use auto (token_truncate) or another correction")
    require(not (cfg.model.dtype == "bfloat16" and t.autocast_bf16 is False), "training.autocast_bf16",
            "false contradicts model.dtype: bfloat16 (bf16 compute by autocast over float32 master weights); "
            "for float32 compute set model.dtype: float32")
    # A vLLM engine holds its own (merged) copy in any dtype; HF would need a second peft model.
    require(g.dtype in (None, "auto") or not lora or BACKENDS[g.backend].owns_weights, "generation.dtype",
            "a separate generation copy is not supported with model.lora.enabled and generation.backend=hf; "
            "set it to null")
    require(g.vllm.lora_sync == "merged" or (lora and BACKENDS[g.backend].owns_weights), "generation.vllm.lora_sync",
            f"adapter sends a LoRA policy's adapter to a vLLM backend; it needs model.lora.enabled and "
            f"generation.backend vllm or vllm_server, got backend {g.backend} with model.lora.enabled={lora}")
    require(g.vllm.lora_sync == "merged" or cfg.model.lora.r <= ENGINE_LORA_RANKS[-1], "model.lora.r",
            f"{cfg.model.lora.r} is above the largest rank vLLM's LoRA engine takes ({ENGINE_LORA_RANKS[-1]}) "
            "for generation.vllm.lora_sync: adapter; use merged")
    require(g.vllm.lora_sync == "merged" or not g.vllm.enable_sleep_mode, "generation.vllm.lora_sync",
            "adapter leaves the base weights in the engine, which sleep mode discards; use merged with sleep mode")
    require(g.compile is not True or g.backend == "hf", "generation.compile",
            f"applies to generation.backend hf; vLLM compiles its own graphs (generation.vllm.enforce_eager), "
            f"got generation.backend {g.backend}")
    require(g.compile is not True or not strategy.collective_forward, "generation.compile",
            f"true is not supported with training.strategy {strategy.name}: each sharded forward gathers the "
            f"weights from every process, which the compiled step does not trace; set it to false or auto")
    require(t.optimizer == "adamw" or not strategy.collective_forward, "training.optimizer",
            f"{t.optimizer} is not supported with training.strategy {strategy.name} (sharded DTensor "
            "parameters); use adamw")
    require(cfg.eval.every_steps == 0 or cfg.data.eval_size > 0 or eval_rows_given, "eval.every_steps",
            "in-loop validation needs a held-out split: set data.eval_size > 0 (or give an eval_dataset)")
    _check_teacher(cfg)
    _check_ray_address(cfg)
    _check_ref_sync(cfg, strategy)
    _check_strategy(cfg, strategy, master)
    _environment_rules(cfg)


def check_given_model(cfg: TrainConfig) -> None:
    """A model given as a Python object is trained in place, in this process: the paths that load the
    model from its folder themselves cannot take it."""
    strategy, backend = STRATEGIES[cfg.training.strategy], BACKENDS[cfg.generation.backend]
    require(strategy.adopts_model, "training.strategy",
            f"{strategy.name} builds the model on the meta device and reads its weights once; with a model "
            "object use ddp, or give the model's folder (model.save_pretrained(DIR))")
    require(not backend.owns_weights, "generation.backend",
            f"{cfg.generation.backend} loads the model from its folder into the engine; with a model object "
            "sample with hf, or give the model's folder (model.save_pretrained(DIR))")


def _check_ray_address(cfg: TrainConfig) -> None:
    """A Ray cluster to join is TransferQueue's, on Ray: the other planes start no Ray."""
    r = cfg.rollout
    if r.transferqueue_ray_address is None:
        return
    require(r.data_plane == "transferqueue", "rollout.transferqueue_ray_address",
            f"joins a Ray cluster for the TransferQueue plane; it needs rollout.data_plane: transferqueue, "
            f"got {r.data_plane} (or set it to null)")
    require(r.transferqueue_ray, "rollout.transferqueue_ray_address",
            "joins a Ray cluster for TransferQueue's Ray actors; it needs rollout.transferqueue_ray: true "
            "(false runs the plane in this process, without Ray), or set it to null")


def _check_ref_sync(cfg: TrainConfig, strategy: type[Strategy]) -> None:
    """A reference that follows the policy needs a separate reference model held whole on each process."""
    if not cfg.loss.sync_ref_model:
        return
    require(cfg.loss.beta > 0, "loss.sync_ref_model", "needs a reference model: set loss.beta > 0")
    # As TRL: the LoRA reference is the base model with the adapters off, nothing to update.
    require(not cfg.model.lora.enabled, "loss.sync_ref_model",
            "is not supported with model.lora.enabled (the reference is the base model with the adapters off)")
    require(strategy.supports_reference_sync, "loss.sync_ref_model",
            f"is not supported with training.strategy={strategy.name} (the reference is sharded); use ddp")


def _check_teacher(cfg: TrainConfig) -> None:
    """A teacher's own chat template renders one-shot prompts only; distillation without rewards zeroes the
    advantages, so the method's policy term must be on them."""
    t = cfg.teacher
    require(t.chat_template == "student" or not cfg.environment.enabled, "teacher.chat_template",
            "teacher renders one-shot prompts again; with multi-turn episodes (environment:) use student")
    if t.rewards:
        return
    require(t.name_or_path is not None, "teacher.rewards", "false needs a teacher (teacher.name_or_path)")
    method = get_method(cfg.method)
    require(method.trains_on_advantages, "teacher.rewards",
            f"false zeroes the advantages, but method {cfg.method}'s policy term is on {method.weighting} weights; "
            "use an advantage method (e.g. method: grpo)")


def _environment_rules(cfg: TrainConfig) -> None:
    """Multi-turn episodes: a known environment, tools and classes that name what to import, and a
    sampler that can run as many turns on each rank."""
    e = cfg.environment
    if not e.enabled:
        return
    known = {*ENVIRONMENTS, *e.classes, *(["tools"] if e.tools else [])}
    if e.name is not None:
        require(e.name in known, "environment.name",
                f"no environment {e.name!r}{suggest(e.name, known)}; registered: {', '.join(sorted(known))}")
    for name in e.classes:
        require(name not in ENVIRONMENTS and name != "tools", f"environment.classes.{name}",
                "the name is taken by a registered environment; choose another")
    backend = BACKENDS[cfg.generation.backend]
    # HF sampling on a sharded policy is a collective: every rank would have to run as many turns.
    require(backend.owns_weights or not STRATEGIES[cfg.training.strategy].collective_forward, "training.strategy",
            f"multi-turn episodes sampled by {backend.name} are not supported with {cfg.training.strategy} (ranks "
            "would run different numbers of generate calls); use ddp, or generation.backend vllm")


def _check_strategy(cfg: TrainConfig, strategy: type[Strategy], master: str) -> None:
    """What the strategy cannot do (docs/SCALING.md). Under a collective forward (FSDP2) every
    rank must run the same number of forwards when the policy samples with HF."""
    why = f"with training.strategy={strategy.name}"
    require(strategy.supports_lora or not cfg.model.lora.enabled, "model.lora.enabled",
            f"LoRA is not supported {why}; use training.strategy=ddp")
    if not strategy.collective_forward or BACKENDS[cfg.generation.backend].owns_weights:
        return  # a vLLM engine holds its own weights and samples without collectives
    # The policy is stored in its master dtype (float32 under bf16 compute): a copy in any other is separate.
    require(cfg.generation.dtype in (None, "auto", master), "generation.dtype",
            f"a separate generation copy (a full model on every rank) is not supported {why}; set it to null")
    require(not cfg.loss.dynamic_sampling, "loss.dynamic_sampling",
            f"is not supported {why} (ranks would run different numbers of generate calls); set it to false")
