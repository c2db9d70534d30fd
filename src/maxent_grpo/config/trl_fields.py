"""The table of ``--from-trl``: every field TRL's ``trl grpo`` reads from a GRPO YAML, as
:class:`Mapped` (our keys, TRL's meaning and default), :class:`Refused` (one line why) or
:class:`Ignored` (no effect here), with the value transforms the mapped ones need. The conversion
that applies it is config/trl.py; its module docstring explains the batch and step arithmetic.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from maxent_grpo.errors import ConfigError

__all__ = ["GRPO_FIELDS", "SCRIPT_FIELDS", "TRAINING_ARGUMENTS_FIELDS", "TRL_FIELDS", "Ignored", "Mapped", "Refused"]


@dataclass(frozen=True)
class Mapped:
    """``to(value, fields)`` gives our dotted keys; ``fields`` is the whole file over TRL's defaults."""

    default: Any
    keys: str  # our key(s), for the table
    to: Callable[[Any, Mapping[str, Any]], dict[str, Any]]
    note: str = ""


_FIRST_ACCEPTED = object()


@dataclass(frozen=True)
class Refused:
    """No equivalent here. A value in ``accepts`` (TRL's default: it asks for nothing) passes;
    ``when`` (text ``when_text``) accepts by the rest of the file."""

    reason: str
    accepts: tuple = (None,)  # the first is TRL's default, unless trl_default names another
    when: Callable[[Any, Mapping[str, Any]], bool] | None = None
    when_text: str = ""
    # TRL's default where it is not one of accepts: a file that leaves the field out is then refused too
    # (config/trl.py judges an absent field at its default).
    trl_default: Any = _FIRST_ACCEPTED

    @property
    def default(self) -> Any:
        return self.accepts[0] if self.trl_default is _FIRST_ACCEPTED else self.trl_default

    def allows(self, value: Any, fields: Mapping[str, Any]) -> bool:
        if any(_number(value, ok) == ok and type(_number(value, ok)) is type(ok) for ok in self.accepts):
            return True
        return self.when is not None and self.when(value, fields)


@dataclass(frozen=True)
class Ignored:
    reason: str
    default: Any = None  # TRL's default (GRPOConfig's field default, front/grpo_config.py)


def _number(value: Any, like: Any) -> Any:
    """``value`` read as a float where ``like`` is one: YAML 1.1 reads ``1e-8`` (no dot) as a string."""
    if isinstance(like, float) and isinstance(value, str):
        try:
            return float(value)
        except ValueError:
            return value
    return value


def _key(key: str, transform: Callable[[Any], Any] | None = None):
    return lambda value, fields: {key: transform(value) if transform else value}


def _same(key: str, default: Any, note: str = "") -> Mapped:
    return Mapped(default, key, _key(key), note)


def _nothing(value, fields) -> dict:
    return {}


def _fail(field: str, message: str) -> ConfigError:
    return ConfigError(f"{field}: {message}")


# ------------------------------------------------------------------ joint transforms

def _batch(value, f) -> dict:
    per_device, accum, g = f["per_device_train_batch_size"], f["gradient_accumulation_steps"], f["num_generations"]
    completions = per_device * accum
    if completions % g:
        raise _fail("per_device_train_batch_size", (
            f"{per_device} x gradient_accumulation_steps {accum} = {completions} completions per process and "
            f"step is not a multiple of num_generations {g}: here each process samples whole groups "
            "(training.prompts_per_step prompts x num_generations)"))
    micro = "auto" if f["auto_find_batch_size"] else per_device  # auto: sized from free memory, not halved on OOM
    return {"training.prompts_per_step": completions // g, "training.micro_batch_size": micro}


def _updates_to_steps(field: str, value: int, f) -> int:
    """TRL counts optimizer updates; a step here is ``num_iterations`` of them."""
    mu = f["num_iterations"]
    if isinstance(value, float) and not value.is_integer():
        raise _fail(field, f"a fraction ({value}) of the run is not supported here; give a number of updates")
    if int(value) % mu:
        raise _fail(field, f"{value} updates is not a multiple of num_iterations {mu} (a step here is "
                    f"num_iterations updates on one rollout batch)")
    return int(value) // mu


def _max_steps(value, f) -> dict:
    if value is None or value <= 0:  # TRL's default: num_train_epochs passes, counted once the data is read
        return {"training.max_steps": None}
    return {"training.max_steps": _updates_to_steps("max_steps", value, f)}


def _epochs(value, f) -> dict:
    if f["max_steps"] is not None and f["max_steps"] > 0:
        return {}  # max_steps decides, as in transformers
    if _number(value, 1.0) != int(_number(value, 1.0)) or _number(value, 1.0) < 1:
        raise _fail("num_train_epochs", f"{value}: here a run is whole passes over the data (>= 1); "
                    "give a whole number, or max_steps")
    return {"data.num_epochs": int(_number(value, 1.0))}


def _warmup_steps(value, f) -> dict:
    if isinstance(value, float) and 0 < value < 1:  # transformers 5: a float below 1 is a ratio
        return {"training.warmup_ratio": value}
    return {"training.warmup_steps": int(value)}


def _warmup_ratio(value, f) -> dict:
    if not value or f["warmup_steps"]:  # transformers: warmup_steps > 0 wins
        return {}
    return {"training.warmup_ratio": value}


def _save(value, f) -> dict:
    strategy = f["save_strategy"]
    if strategy == "no":
        return {"checkpoint.save_steps": 0, "checkpoint.save_minutes": 0.0}
    if strategy != "steps":
        raise _fail("save_strategy", f"{strategy!r}: here checkpoints are every N steps (steps) or none (no)")
    # TRL saves by steps only: our time-based save is turned off.
    return {"checkpoint.save_steps": _updates_to_steps("save_steps", value, f), "checkpoint.save_minutes": 0.0}


# TRL's (transformers') optim values -> training.optimizer. Our adamw takes the fused kernel wherever
# transformers' adamw_torch_fused would (CUDA) unless the parameters are sharded.
_OPTIMIZERS = {"adamw_torch": "adamw", "adamw_torch_fused": "adamw", "adamw_8bit": "adamw_8bit",
               "adamw_bnb_8bit": "adamw_8bit"}


def _optim(value, f) -> dict:
    if value not in _OPTIMIZERS:
        raise _fail("optim", f"{value!r} is refused: here training.optimizer is adamw, adamw_fused or adamw_8bit "
                    f"(TRL's {', '.join(_OPTIMIZERS)})")
    return {"training.optimizer": _OPTIMIZERS[value]}


_SCHEDULERS = {"linear": "linear", "cosine": "cosine", "constant": "constant", "constant_with_warmup": "constant"}


def _scheduler(value, f) -> dict:
    if value not in _SCHEDULERS:
        raise _fail("lr_scheduler_type", f"{value!r} is not supported here; supported: {', '.join(_SCHEDULERS)}")
    if value == "constant" and (f["warmup_steps"] or f["warmup_ratio"]):
        raise _fail("lr_scheduler_type", "constant ignores warm-up in transformers; here constant warms up: "
                    "use constant_with_warmup, or no warm-up")
    return {"training.lr_scheduler": _SCHEDULERS[value]}


# TRL's loss_type -> (our method, our loss.loss_type): the four aggregations are ours under grpo;
# cispo and sapo are methods here (their surrogate), aggregated as TRL aggregates them.
_LOSS_TYPES = {"grpo": ("grpo", "grpo"), "bnpo": ("grpo", "bnpo"), "dr_grpo": ("grpo", "dr_grpo"),
               "dapo": ("grpo", "dapo"), "cispo": ("cispo", "dapo"), "sapo": ("sapo", "grpo"),
               "luspo": ("luspo", "luspo"), "vespo": ("vespo", "dapo")}


def _loss_type(value, f) -> dict:
    if value not in _LOSS_TYPES:
        raise _fail("loss_type", f"{value!r} has no counterpart here; "
                    f"supported: {', '.join(_LOSS_TYPES)}")
    method, aggregation = _LOSS_TYPES[value]
    mask = f["off_policy_mask_threshold"]
    if mask is None:
        return {"method": method, "loss.loss_type": aggregation}
    # TRL's off-policy sequence mask on the clipped surrogate is OPSM (methods/opsm.py).
    if method != "grpo":
        raise _fail("off_policy_mask_threshold", f"the off-policy sequence mask goes with the clipped-surrogate "
                    f"loss types here (grpo, bnpo, dr_grpo, dapo), not loss_type {value!r}")
    return {"method": "opsm", "opsm.delta": mask, "loss.loss_type": aggregation}


def _for_loss(loss_type: str, key: str):
    """A field read only with ``loss_type`` (SAPO's temperatures, VESPO's gamma parameters)."""
    return lambda value, f: {key: value} if f["loss_type"] == loss_type else {}


def _backend(value, f) -> dict:
    if not value:
        return {"generation.backend": "hf"}
    mode = f["vllm_mode"]
    if mode not in ("colocate", "server"):
        raise _fail("vllm_mode", f"{mode!r}: colocate or server")
    return {"generation.backend": "vllm" if mode == "colocate" else "vllm_server"}


def _server_url(value, f) -> dict:
    url = f["vllm_server_base_url"] or f"http://{f['vllm_server_host']}:{f['vllm_server_port']}"
    return {"generation.vllm.server_url": url}


def _rollout_correction(value, f) -> dict:
    if not f["use_vllm"]:
        return {}  # TRL corrects only a vLLM sampler; ours decides by its own sampler (auto)
    if not value:
        return {"loss.rollout_correction": "none"}
    cap = f["vllm_importance_sampling_cap"]
    return {"loss.rollout_correction": f["vllm_importance_sampling_mode"],
            "loss.rollout_correction_cap": float(cap if cap is not None else f["vllm_importance_sampling_clip_max"])}


def _scale_rewards(value, f) -> dict:
    if f["multi_objective_aggregation"] == "normalize_then_sum":
        # TRL's GDPO branch ignores scale_rewards: the normalised sum is whitened over the batch.
        return {"loss.scale_rewards": "batch"}
    return {"loss.scale_rewards": {True: "group", False: "none"}.get(value, value)}


def _max_grad_norm(value):
    return value if value and value > 0 else None


def _report_to(value) -> list:
    names = [value] if isinstance(value, str) else list(value or [])
    return [] if names in (["none"], []) else names


def _tool_turns(value, f) -> dict:
    # TRL: tool-calling rounds after the first generation (None: no limit); a turn here is one generation.
    return {} if value is None else {"environment.max_turns": value + 1}


def _dtype(value, f) -> dict:
    if value not in ("float32", "bfloat16"):
        raise _fail("dtype", f"{value!r}: the policy's weights are float32 or bfloat16 here (model.dtype)")
    return {"model.dtype": value}


def _dataset(value, f) -> dict:
    if not value:
        raise _fail("dataset_name", "required: a hub dataset (loaded from the cache offline) or a .jsonl/.json/.parquet file")
    # TRL feeds the prompt column as it is: no instruction, system prompt or example is added.
    return {"data.source": value, "data.size": None, "data.instruction": None, "data.system_prompt": None,
            "data.few_shot": [], "data.task_kwargs": {}}


# TRL's script registry (trl/scripts/grpo.py): the same functions, run unchanged from TRL, except the
# soft overlong punishment, ours (the same formula) at the script's fixed lengths.
_TRL_REWARDS = {
    "accuracy_reward": {"name": "trl.rewards:accuracy_reward"},
    "reasoning_accuracy_reward": {"name": "trl.rewards:reasoning_accuracy_reward"},
    "think_format_reward": {"name": "trl.rewards:think_format_reward"},
    "get_soft_overlong_punishment": {"name": "soft_overlong",
                                     "kwargs": {"max_completion_len": 1280, "soft_punish_cache": 256}},
}


def _rewards(value, f) -> dict:
    entries = []
    if f["reward_model_name_or_path"]:
        entries.append({"model": f["reward_model_name_or_path"]})
    for name in value or []:
        if name in _TRL_REWARDS:
            entries.append(dict(_TRL_REWARDS[name]))
        elif isinstance(name, str) and "." in name:
            module, attr = name.rsplit(".", 1)
            entries.append({"name": f"{module}:{attr}"})
        else:
            raise _fail("reward_funcs", f"{name!r}: one of {', '.join(_TRL_REWARDS)} or a dotted import path")
    if not entries:
        raise _fail("reward_funcs", "no reward: give reward_funcs or reward_model_name_or_path")
    weights = f["reward_weights"]
    if weights is not None:
        if len(weights) != len(entries):
            raise _fail("reward_weights", f"{len(weights)} weights for {len(entries)} rewards (the reward model first)")
        for entry, weight in zip(entries, weights):
            entry["weight"] = float(weight)
    return {"rewards": entries}


# ------------------------------------------------------------------ the table

_DEEPSPEED = "DeepSpeed ZeRO-3 only; no DeepSpeed here (training.strategy: fsdp2 shards instead)"
_SPEED = "a speed or memory switch of the sampler; the samples' distribution is the same"
_LOG = "console and tracker display; every step's metrics and completions are written here (metrics.jsonl, completions/)"
_NO_EVAL = "used only by TRL's evaluation, which is refused (eval_strategy)"

GRPO_FIELDS: dict[str, Mapped | Refused | Ignored] = {
    "model_init_kwargs": Refused("from_pretrained options other than the dtype have no key here (model.dtype, model.lora)"),
    "trust_remote_code": Refused("models load without remote code here", (False,)),
    "router_aux_loss_coef": Refused("a mixture-of-experts router loss is not added here"),
    "disable_dropout": Ignored("dropout is always off here (models.py), as with disable_dropout: true", False),
    "cast_lm_head_to_fp32": _same("model.lm_head_fp32", False),
    "num_generations": _same("generation.num_generations", 8),
    "num_generations_eval": Refused("TRL's in-training eval is refused; here eval.k sets samples per held-out prompt"),
    "max_completion_length": _same("generation.max_new_tokens", 512),
    "ds3_gather_for_generation": Ignored(_DEEPSPEED, True),
    "shuffle_dataset": _same("data.shuffle", True),
    "pad_to_multiple_of": Ignored("padding for Neuron compilation; padding does not change the loss", "auto"),
    "generation_batch_size": Refused("fixes the generation batch across processes in completions; here each process "
                                     "samples its training.prompts_per_step prompts each step"),
    "steps_per_generation": Refused(
        "one generation batch feeding several optimizer steps is not done here (rollout.max_staleness is the "
        "asynchronous alternative)", (None,),
        when=lambda v, f: v == f["gradient_accumulation_steps"], when_text="equal to gradient_accumulation_steps"),
    "temperature": _same("generation.temperature", 1.0),
    "top_p": _same("generation.top_p", 1.0),
    "top_k": Mapped(0, "generation.top_k", _key("generation.top_k", lambda v: v or 0), "null: 0 (off)"),
    "min_p": Refused("the samplers here have no min-p cut (top_p and top_k only)"),
    "generation_kwargs": Refused("sampler options other than temperature, top_p, top_k have no key here", (None, {})),
    "chat_template_kwargs": Refused("the chat template is applied with its defaults here", (None, {})),
    "repetition_penalty": Refused("the samplers here apply no repetition penalty: it would change the sampled policy away from the trained one", (1.0, 1)),
    "cache_implementation": Ignored(_SPEED),
    "use_vllm": Mapped(False, "generation.backend", _backend, "false: hf; with vllm_mode colocate: vllm; server: vllm_server"),
    "vllm_mode": Mapped("colocate", "generation.backend", _nothing, "read with use_vllm"),
    "vllm_model_impl": Refused("vLLM runs its own model implementation here", ("vllm",)),
    "vllm_enable_sleep_mode": _same("generation.vllm.enable_sleep_mode", False),
    "vllm_structured_outputs_regex": Refused("the samplers here draw from the policy unconstrained; regex-guided decoding would make the sampler differ from the trained policy"),
    "vllm_server_base_url": Mapped(None, "generation.vllm.server_url", _server_url, "else http://HOST:PORT"),
    "vllm_server_host": Mapped("0.0.0.0", "generation.vllm.server_url", _nothing, "read with vllm_server_base_url"),
    "vllm_server_port": Mapped(8000, "generation.vllm.server_url", _nothing, "read with vllm_server_base_url"),
    "vllm_server_timeout": Ignored("how long TRL waits for the server to start; here each request waits "
                                   "generation.vllm.request_timeout_s", 240.0),
    "vllm_group_port": Ignored("TRL's NCCL weight-update port; weights reach the server by generation.vllm.weight_sync", 51216),
    "vllm_gpu_memory_utilization": _same("generation.vllm.gpu_memory_utilization", 0.3),
    "vllm_max_model_length": _same("generation.vllm.max_model_len", None),
    "vllm_tensor_parallel_size": Refused(
        "a colocated engine is not split over GPUs here; a server takes -- --tensor-parallel-size", (1,),
        when=lambda v, f: not (f["use_vllm"] and f["vllm_mode"] == "colocate"), when_text="without a colocated engine"),
    "beta": _same("loss.beta", 0.0, "KL estimator k3, as TRL"),
    "num_iterations": _same("training.num_iterations", 1),
    "epsilon": _same("loss.epsilon", 0.2),
    "delta": _same("loss.delta", None),
    "epsilon_high": _same("loss.epsilon_high", None, "null: epsilon, as TRL"),
    "sapo_temperature_neg": Mapped(1.05, "sapo.tau_neg", _for_loss("sapo", "sapo.tau_neg"), "with loss_type sapo"),
    "sapo_temperature_pos": Mapped(1.0, "sapo.tau_pos", _for_loss("sapo", "sapo.tau_pos"), "with loss_type sapo"),
    **{f"vespo_{ours}": Mapped(default, f"vespo.{ours}", _for_loss("vespo", f"vespo.{ours}"), "with loss_type vespo")
       for ours, default in (("k_pos", 2.0), ("lambda_pos", 3.0), ("k_neg", 3.0), ("lambda_neg", 2.0))},
    "importance_sampling_level": _same("loss.importance_sampling_level", "token"),
    "reward_weights": Mapped(None, "rewards[i].weight", _nothing, "read with reward_funcs, in its order"),
    "multi_objective_aggregation": _same("loss.multi_objective_aggregation", "sum_then_normalize"),
    "scale_rewards": Mapped("group", "loss.scale_rewards", _scale_rewards,
                            "true: group, false: none; batch with normalize_then_sum, whatever it says (as TRL)"),
    "loss_type": Mapped("dapo", "method, loss.loss_type", _loss_type,
                        "grpo, bnpo, dr_grpo, dapo: method grpo; cispo: method cispo (dapo); sapo: method sapo (grpo); "
                        "luspo: method luspo (luspo); vespo: method vespo (dapo)"),
    "mask_truncated_completions": _same("loss.mask_truncated_completions", False),
    "sync_ref_model": _same("loss.sync_ref_model", False, "TR-DPO (here it needs beta > 0 and no LoRA)"),
    "ref_model_mixup_alpha": _same("loss.ref_model_mixup_alpha", 0.6),
    "ref_model_sync_steps": _same("loss.ref_model_sync_steps", 512),
    "top_entropy_quantile": _same("loss.top_entropy_quantile", 1.0),
    "entropy_coef": _same("loss.entropy_coef", 0.0),
    "use_adaptive_entropy": _same("loss.adaptive_entropy", False),
    "entropy_coef_min": _same("loss.entropy_coef_min", 0.0),
    "entropy_coef_max": _same("loss.entropy_coef_max", 1.0),
    "entropy_coef_delta": _same("loss.entropy_coef_delta", 0.005),
    "entropy_target": _same("loss.entropy_target", 0.2),
    "max_tool_calling_iterations": Mapped(None, "environment.max_turns", _tool_turns,
                                          "N: N + 1 turns; null (no limit): our bound, environment.max_turns"),
    "vllm_importance_sampling_correction": Mapped(True, "loss.rollout_correction", _rollout_correction,
                                                  "with use_vllm: the mode (false: none); without: auto"),
    "vllm_importance_sampling_mode": Mapped("sequence_mask", "loss.rollout_correction", _nothing,
                                            "read with vllm_importance_sampling_correction"),
    "vllm_importance_sampling_clip_max": Mapped(3.0, "loss.rollout_correction_cap", _nothing,
                                                "read with vllm_importance_sampling_correction"),
    "vllm_importance_sampling_clip_min": Refused("the rollout correction has no lower bound here"),
    "vllm_importance_sampling_cap": Mapped(None, "loss.rollout_correction_cap", _nothing,
                                           "TRL's older name of the clip; wins when set"),
    "off_policy_mask_threshold": Mapped(None, "method: opsm, opsm.delta", _nothing,
                                        "read with loss_type: set, the clipped-surrogate loss types train as OPSM"),
    "use_bias_correction_kl": _same("loss.kl_importance_weighted", True,
                                    "true (TRL's default): beta * rho * k3, rho with gradient (ALGORITHMS.md §19); "
                                    "false: beta * k3"),
    "log_completions": Ignored(_LOG, False),
    "log_multimodal": Ignored(_LOG, True),
    "num_completions_to_print": Ignored(_LOG),
    "log_unique_prompts": Ignored(_LOG, False),
    "log_completions_hub_repo": Refused("completions are not pushed to the Hub here (they are in completions/)"),
    "use_transformers_continuous_batching": Ignored(_SPEED, False),
    "transformers_continuous_batching_config": Ignored(_SPEED),
    "use_transformers_paged": Ignored(_SPEED, False),
}

TRAINING_ARGUMENTS_FIELDS: dict[str, Mapped | Refused | Ignored] = {
    "output_dir": Mapped(None, "logging.output_dir", _key("logging.output_dir", lambda v: v or "trainer_output"),
                         "null: trainer_output, as transformers"),
    "per_device_train_batch_size": Mapped(8, "training.prompts_per_step, training.micro_batch_size", _batch,
                                          "prompts = this x gradient_accumulation_steps / num_generations; "
                                          "micro-batch = this (completions)"),
    "gradient_accumulation_steps": Mapped(1, "training.prompts_per_step", _nothing, "read with per_device_train_batch_size"),
    "auto_find_batch_size": Mapped(False, "training.micro_batch_size", _nothing, "true: auto (sized from free "
                                   "memory, not halved after an out-of-memory error); read with per_device_train_batch_size"),
    "max_steps": Mapped(-1, "training.max_steps", _max_steps,
                        "updates / num_iterations; -1: null (num_train_epochs passes over the data)"),
    "num_train_epochs": Mapped(3.0, "data.num_epochs", _epochs, "with max_steps -1 only; whole passes"),
    "learning_rate": _same("training.learning_rate", 1e-6),
    "lr_scheduler_type": Mapped("linear", "training.lr_scheduler", _scheduler, "linear, cosine, constant_with_warmup"),
    "lr_scheduler_kwargs": Refused("scheduler options have no key here", (None, {})),
    "warmup_steps": Mapped(0, "training.warmup_steps, training.warmup_ratio", _warmup_steps,
                           "updates; a float below 1: training.warmup_ratio"),
    "warmup_ratio": Mapped(0.0, "training.warmup_ratio", _warmup_ratio, "ceil(ratio x the run's updates)"),
    "weight_decay": _same("training.weight_decay", 0.0),
    "adam_beta1": _same("training.adam_beta1", 0.9),
    "adam_beta2": _same("training.adam_beta2", 0.999),
    "adam_epsilon": Refused("AdamW's epsilon is fixed at 1e-8 here", (1e-8,)),
    "max_grad_norm": Mapped(1.0, "training.max_grad_norm", _key("training.max_grad_norm", _max_grad_norm), "0: null (off)"),
    "optim": Mapped("adamw_torch_fused", "training.optimizer", _optim,
                    "adamw_torch(_fused): adamw (fused on CUDA where unsharded); adamw_8bit / adamw_bnb_8bit: adamw_8bit"),
    "seed": _same("training.seed", 42),
    "data_seed": Refused("the data order follows training.seed here"),
    "bf16": Mapped(None, "training.autocast_bf16", _key("training.autocast_bf16", lambda v: "auto" if v is None else v),
                   "null: auto"),
    "fp16": Refused("float16 training is not supported here (bf16)", (False,)),
    "tf32": Ignored("a matmul speed switch of Ampere GPUs"),
    "use_cpu": Ignored("the device is chosen here: CUDA when visible (cuda:LOCAL_RANK), else the CPU", False),
    "gradient_checkpointing": Mapped(True, "training.gradient_checkpointing, training.share_prompts",
                                     lambda v, f: {"training.gradient_checkpointing": v, **({"training.share_prompts": False} if v else {})},
                                     "true also sets share_prompts: false (they exclude each other)"),
    "gradient_checkpointing_kwargs": Ignored("recomputation options; the gradient is the same"),
    "save_strategy": Mapped("steps", "checkpoint.save_steps", _nothing, "read with save_steps; no: none"),
    "save_steps": Mapped(500, "checkpoint.save_steps, checkpoint.save_minutes", _save,
                         "updates / num_iterations; time-based saving off"),
    "save_total_limit": _same("checkpoint.keep_last", None),
    "save_only_model": Ignored("checkpoints here always hold the optimizer state, for exact resume", False),
    "logging_steps": Ignored(_LOG, 10),
    "logging_strategy": Ignored(_LOG, "steps"),
    "logging_first_step": Ignored(_LOG, False),
    "logging_dir": Ignored(_LOG),
    "log_level": Ignored(_LOG, "passive"),
    "run_name": Ignored("the run is named by its folder, logging.output_dir"),
    "report_to": Mapped("none", "logging.report_to", _key("logging.report_to", _report_to), "none: []"),
    "disable_tqdm": Mapped(None, "logging.progress_bar", _key("logging.progress_bar", lambda v: not v), "null: shown"),
    "eval_strategy": Refused("TRL's in-training eval (loss and rewards on a test split) is not done here; our "
                             "eval section measures pass@k on held-out prompts", ("no",)),
    "eval_steps": Ignored(_NO_EVAL),
    "per_device_eval_batch_size": Ignored(_NO_EVAL, 8),
    "push_to_hub": Refused("models are not pushed to the Hub here", (False,)),
    "hub_model_id": Ignored("used only with push_to_hub, which is refused"),
    "hub_strategy": Ignored("used only with push_to_hub, which is refused", "every_save"),
    "hub_private_repo": Ignored("used only with push_to_hub, which is refused"),
    "resume_from_checkpoint": Refused("resume with maxent-grpo train --resume [PATH]"),
    "overwrite_output_dir": Ignored("a run folder in use is refused; pass --overwrite"),
    "deepspeed": Refused("no DeepSpeed here: training.strategy: fsdp2 shards weights, gradients and optimizer"),
    "fsdp": Refused("set training.strategy: fsdp2 in a config of ours (FSDP's own options are not read)", (None, "", [])),
    "fsdp_config": Ignored("used only with fsdp, which is refused"),
    "ddp_timeout": Mapped(1800, "training.dist_timeout_minutes", _key("training.dist_timeout_minutes", lambda v: v / 60), "seconds / 60"),
    "ddp_find_unused_parameters": Ignored("a DDP bookkeeping switch; the gradient is the same"),
    "torch_compile": Ignored("a speed switch; the loss is the same", False),
    "use_liger_kernel": Refused("Liger's fused GRPO loss is not used here", (False,)),
    "dataloader_num_workers": Ignored("prompts are read in process here", 0),
    "dataloader_pin_memory": Ignored("prompts are read in process here", True),
    "remove_unused_columns": Ignored("every dataset column reaches the reward functions here (TRL's GRPO default)", False),
    "do_train": Ignored("the train command trains", False),
    "do_eval": Ignored(_NO_EVAL, False),
}

SCRIPT_FIELDS: dict[str, Mapped | Refused | Ignored] = {
    "model_name_or_path": Mapped(None, "model.name_or_path", lambda v, f: _model(v), "a hub id or a folder"),
    "model_revision": Refused("models load at their main revision here", ("main",)),
    "dtype": Mapped("float32", "model.dtype", _dtype, "float32 or bfloat16"),
    "torch_dtype": Mapped(None, "model.dtype", lambda v, f: {} if v is None else _dtype(v, f), "TRL's older name of dtype"),
    "attn_implementation": Ignored("the attention kernel: speed and memory, not the result"),
    "use_peft": _same("model.lora.enabled", False),
    "lora_r": _same("model.lora.r", 16),
    "lora_alpha": _same("model.lora.alpha", 32),
    "lora_dropout": _same("model.lora.dropout", 0.05, "kept in the adapter; dropout is off in training here"),
    "lora_target_modules": Mapped(None, "model.lora.target_modules",
                                  lambda v, f: {} if v is None else {"model.lora.target_modules": list(v)},
                                  "null: ours (q, k, v, o projections), where peft picks by architecture"),
    "lora_target_parameters": Refused("LoRA on parameters (not modules) is not supported here"),
    "lora_modules_to_save": Refused("modules trained in full beside LoRA are not supported here"),
    "lora_task_type": Refused("the policy is a causal LM", ("CAUSAL_LM",)),
    "use_rslora": _same("model.lora.use_rslora", False),
    "use_dora": Refused("DoRA has no counterpart here: the sampler gets the merged weights, and DoRA's merge "
                        "rescales each column by a weight norm the push does not compute", (False,)),
    "load_in_8bit": Refused("quantised training is not supported here", (False,)),
    "load_in_4bit": Refused("quantised training is not supported here", (False,)),
    "bnb_4bit_quant_type": Ignored("used only with load_in_4bit, which is refused", "nf4"),
    "use_bnb_nested_quant": Ignored("used only with load_in_4bit, which is refused", False),
    "bnb_4bit_quant_storage": Ignored("used only with load_in_4bit, which is refused"),
    "dataset_name": Mapped(None, "data.source", _dataset, "no instruction, system prompt or example added; every row"),
    "dataset_config": Refused("a dataset's named configuration cannot be chosen here (data.source loads its default)"),
    "dataset_train_split": _same("data.split", "train"),
    "dataset_test_split": Ignored(_NO_EVAL, "test"),
    "dataset_streaming": Refused("streamed datasets are not supported here", (False,)),
    "ignore_bias_buffers": Ignored("a DDP buffer-broadcast switch; the model is the same", False),
    "datasets": Refused("dataset mixtures are not supported here: give dataset_name", ([], None)),
    "streaming": Refused("streamed datasets are not supported here", (False,)),
    "test_split_size": Refused("TRL's in-training eval is not done here; data.eval_size holds prompts out"),
    "reward_model_name_or_path": Mapped(None, "rewards", _nothing, "the first reward: {model: PATH_OR_ID} (the reward model)"),
    "reward_funcs": Mapped(None, "rewards", _rewards,
                           "TRL's names: the same functions (trl.rewards); a.b.c: a.b:c (a module or a file beside the YAML)"),
}


def _model(value) -> dict:
    if not value:
        raise _fail("model_name_or_path", "required: a hub id or a model folder")
    return {"model.name_or_path": value}


TRL_FIELDS: dict[str, Mapped | Refused | Ignored] = {**GRPO_FIELDS, **TRAINING_ARGUMENTS_FIELDS, **SCRIPT_FIELDS}
