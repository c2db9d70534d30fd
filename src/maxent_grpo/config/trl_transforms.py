"""The pieces of ``--from-trl``'s table (config/trl_fields.py): the three kinds of field, :class:`Mapped`
(our keys, TRL's meaning and default), :class:`Refused` (one line why) and :class:`Ignored` (no effect
here), and the value transforms the mapped fields need, alone or jointly with other fields.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from maxent_grpo.errors import ConfigError



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
