"""Our side of the benchmarks: the ``maxent-grpo train`` CLI on a benchmark setting.

:func:`ours_config` is the one place that maps a :class:`BenchSetting` onto our
trainer's YAML keys; :func:`read_metrics` is the one place that reads its
``metrics.jsonl``. Everything else in ``benchmarks/`` goes through these two.
"""

from __future__ import annotations

import importlib.util
import json
import shutil
import sys
from pathlib import Path

import yaml

from benchmarks.children import ChildRun, run_child
from benchmarks.common_rewards import setting_rewards
from benchmarks.results import RunResult
from benchmarks.settings import LORA_TARGETS, BenchSetting
from benchmarks.pair_sum import TASK as PAIR_SUM
from benchmarks.tasks import setting_rows

CLI = "maxent-grpo"

# metrics.jsonl keys (one JSON object per optimizer step).
STEP_TIME = "step_time"
REWARD = "reward"
MEAN_LENGTH = "completions/mean_length"  # optional: tokens/s is shown only when logged
GENERATE_TIME = "time/generate"  # optional: the generate share is shown only when logged
CPU_TIME = "step_cpu_time"  # optional
PROMPT_HASH = "prompt_ids_hash"  # the prompt token ids the step trained on (maxent_grpo.run_files)


def cli_path() -> str | None:
    """The ``maxent-grpo`` script beside this interpreter (a venv need not be activated), else on PATH."""
    beside = Path(sys.executable).parent / CLI
    return str(beside) if beside.is_file() else shutil.which(CLI)


def ours_available() -> str | None:
    """None when our CLI can run; otherwise why not (the command or its module is absent)."""
    if cli_path() is None:
        return f"the `{CLI}` command is not installed (pip install -e .)"
    if importlib.util.find_spec("maxent_grpo.cli") is None:
        return f"the `{CLI}` command exists but its module maxent_grpo.cli does not yet"
    return None


def ours_vllm_available() -> str | None:
    """None when our CLI can sample with vLLM here; otherwise why not."""
    why = ours_available()
    if why is None and importlib.util.find_spec("vllm") is None:
        why = "vLLM is not installed in this environment (bash scripts/setup_vllm.sh; run from .venv-vllm)"
    return why


def ours_config(setting: BenchSetting, model_dir: Path, extra: dict | None = None,
                rows_file: Path | None = None) -> dict:
    """Our trainer's config for ``setting`` (same model, prompts, sampling, rewards, optimizer as TRL).

    ``extra`` adds method-specific sections (``{"maxent": {"tau": 0.5}}``). A task that is not
    reasoning-gym's (``pair_sum``) is read from ``rows_file``, the JSONL of its rows.
    """
    if setting.task == PAIR_SUM:
        if rows_file is None:
            raise ValueError(f"task {PAIR_SUM}: rows_file (the JSONL of its rows) is required")
        # The rows carry their prompt as finished messages (example turn and instruction included).
        data = {"source": str(rows_file), "instruction": None, "shuffle": False, "few_shot": []}
    else:
        # The same rows as benchmarks.tasks.setting_rows: data.size problems from the run's seed, in
        # order, with the setting's generator options and examples. Both are always written: our
        # trainer's own defaults (the default task's) must not reach a run that did not ask for them.
        data = {
            "source": f"reasoning_gym:{setting.task}", "size": setting.dataset_size, "shuffle": False,
            "task_kwargs": dict(setting.task_kwargs),
            "few_shot": [{"prompt": p, "completion": c} for p, c in setting.few_shot],
        }
    config = {
        "method": setting.method,
        "model": {"name_or_path": str(model_dir), "dtype": "bfloat16" if setting.bf16 else "float32",
                  **({"lora": {"enabled": True, "r": setting.lora_r, "alpha": 2 * setting.lora_r, "dropout": 0.0,
                               "target_modules": list(LORA_TARGETS)}} if setting.lora_r else {})},
        "data": data,
        "rewards": [{"name": n, "weight": w} for n, w in setting_rewards(setting.digest_reward)],
        "generation": {
            "num_generations": setting.num_generations,
            "max_new_tokens": setting.max_new_tokens,
            "temperature": setting.temperature,
            "top_p": 1.0,
            "top_k": 0,
            # An fp32 setting samples in fp32 on every side: our ``auto`` would pick a bf16 copy on a CPU
            # with native bf16 (training/precision.py), which the other sides do not make. A bf16
            # setting keeps our own bf16 default (``auto``), as TRL keeps its own.
            "dtype": "auto" if setting.bf16 else None,
        },
        "loss": {
            "loss_type": setting.loss_type,
            "beta": setting.beta,
            "epsilon": 0.2,
            "scale_rewards": "group",
        },
        "training": {
            "max_steps": setting.steps,
            "prompts_per_step": setting.prompts_per_step,
            "micro_batch_size": setting.micro_batch_size,
            "learning_rate": setting.learning_rate,
            "optimizer": setting.optimizer,
            "lr_scheduler": "constant",
            "weight_decay": 0.0,
            "adam_beta1": 0.9,
            "adam_beta2": 0.999,
            "max_grad_norm": 1.0,
            "seed": setting.seed,
            # bf16 autocast exactly when the setting is bf16 (as TRL's bf16=), not ``auto``'s machine rule.
            "autocast_bf16": setting.bf16,
            # Checkpointing recomputes each layer, which a shared prompt's KV cache cannot be.
            **({"gradient_checkpointing": True, "share_prompts": False} if setting.gradient_checkpointing else {}),
        },
        "logging": {"report_to": [], "progress_bar": False},
        "checkpoint": {"save_steps": 0},
        "eval": {"every_steps": 0},
    }
    for section, values in (extra or {}).items():
        if isinstance(values, dict) and isinstance(config.get(section), dict):
            config[section] = {**config[section], **values}
        else:
            config[section] = values
    return config


def write_config(setting: BenchSetting, model_dir: Path, path: Path, extra: dict | None = None) -> Path:
    """Our config at ``path``; for ``pair_sum`` also its rows, beside it as ``<name>.rows.jsonl``."""
    path.parent.mkdir(parents=True, exist_ok=True)
    rows_file = None
    if setting.task == PAIR_SUM:
        rows_file = path.with_suffix(".rows.jsonl")
        rows = setting_rows(setting)
        rows_file.write_text("".join(json.dumps(row) + "\n" for row in rows))
    path.write_text(yaml.safe_dump(ours_config(setting, model_dir, extra, rows_file), sort_keys=False))
    return path


def train_cmd(config_path: Path, output_dir: Path, max_steps: int) -> list[str]:
    cli = cli_path()
    if cli is None:
        raise FileNotFoundError(f"the `{CLI}` command is not installed")
    return [cli, "train", "--config", str(config_path), "--output-dir", str(output_dir), "--max-steps", str(max_steps)]


def read_metrics(output_dir: Path) -> list[dict]:
    path = output_dir / "metrics.jsonl"
    if not path.is_file():
        raise FileNotFoundError(f"our trainer wrote no {path}")
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def result_from_metrics(records: list[dict], setting: BenchSetting, child: ChildRun) -> RunResult:
    """A RunResult from our metrics.jsonl; ``step_time``, ``reward`` and ``prompt_ids_hash`` are
    required on every line."""
    steps = [r for r in records if STEP_TIME in r]
    if len(steps) != setting.steps:
        raise ValueError(f"metrics.jsonl: {len(steps)} lines with {STEP_TIME!r}, expected {setting.steps}")
    for key in (REWARD, PROMPT_HASH):
        missing = [i for i, r in enumerate(steps) if key not in r]
        if missing:
            raise ValueError(f"metrics.jsonl: step lines {missing} have no {key!r}")
    n = setting.completions_per_step

    def optional(key: str, scale: float = 1.0) -> list:
        if not all(key in r for r in steps):
            return [None] * len(steps)
        return [float(r[key]) * scale for r in steps]

    tokens = optional(MEAN_LENGTH, n)
    return RunResult(
        side="ours",
        step_times=[float(r[STEP_TIME]) for r in steps],
        rewards=[float(r[REWARD]) for r in steps],
        completion_tokens=[None if t is None else round(t) for t in tokens],
        generate_times=optional(GENERATE_TIME),
        cpu_times=optional(CPU_TIME),
        prompt_hashes=[int(r[PROMPT_HASH]) for r in steps],
        peak_rss_bytes=child.peak_rss_bytes,
        wall_s=child.wall_s,
        extra={"metrics": steps, "process_cpu_s": child.cpu_s},
    )


def run_ours(setting: BenchSetting, model_dir: Path, work_dir: Path, env: dict[str, str],
             extra: dict | None = None, timeout_s: float | None = None) -> RunResult:
    """Write the config, run the CLI in a fresh process, read its metrics and its peak RSS."""
    config_path = write_config(setting, model_dir, work_dir / "config.yaml", extra)
    output_dir = work_dir / "out"
    child = run_child(train_cmd(config_path, output_dir, setting.steps), work_dir / "ours.log", env, timeout_s)
    return result_from_metrics(read_metrics(output_dir), setting, child)


def final_model_dir(work_dir: Path, steps: int) -> Path:
    """Where :func:`run_ours` leaves the final model: the trainer's last checkpoint."""
    path = work_dir / "out" / "checkpoints" / f"step-{steps}"
    if not (path / "config.json").is_file():
        raise FileNotFoundError(f"our trainer left no final model at {path}")
    return path
