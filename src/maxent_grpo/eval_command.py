"""``maxent-grpo eval``: evaluate a saved model or checkpoint the way the run's config says.

Which rows: :func:`select_eval_rows` (the held-out split when there is one), else for a
generated task fresh problems from another seed (:func:`fresh_task_rows`), with a
warning whenever evaluation prompts are training rows. The metrics are
:mod:`maxent_grpo.evaluate`'s.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path

import torch

from maxent_grpo.data.datasets import RG_PREFIX, load_prompt_dataset, split_train_eval
from maxent_grpo.data.prompts import longest_prompt_tokens
from maxent_grpo.errors import ConfigError
from maxent_grpo.envs import ENVIRONMENT_COLUMN
from maxent_grpo.envs.episodes import EpisodePlay
from maxent_grpo.envs.settings import episode_limits, row_environments
from maxent_grpo.evaluate import eval_seed, evaluate_prompts, per_prompt_metrics, per_task_means, write_eval_outputs
from maxent_grpo.models import load_model_and_tokenizer, parse_dtype, resolve_model_path
from maxent_grpo.rewards.registry import build_reward_spec
from maxent_grpo.rollout.backend import SamplingParams
from maxent_grpo.rollout.backends import BACKENDS, BackendInputs
from maxent_grpo.training.config import load_config
from maxent_grpo.training.distributed import Dist
from maxent_grpo.training.precision import bf16_is_fast, resolve_precision

log = logging.getLogger("maxent_grpo")


def select_eval_rows(dataset, eval_size: int, num_prompts: int, seed: int) -> list[dict]:
    """The rows ``maxent-grpo eval`` evaluates.

    With ``eval_size > 0``: the first ``num_prompts`` of the held-out split, the very
    rows in-loop validation evaluates (never trained on). Otherwise the first
    ``num_prompts`` rows of the dataset as configured: point ``data.source`` (or
    ``data.split``) at a test set.
    """
    if isinstance(num_prompts, bool) or not isinstance(num_prompts, int) or num_prompts < 1:
        raise ValueError(f"num_prompts must be a positive int, got {num_prompts!r}")
    if eval_size:
        _, held_out = split_train_eval(dataset, eval_size, seed)
        return list(held_out)[:num_prompts]
    return [dict(dataset[i]) for i in range(min(num_prompts, len(dataset)))]


# Generated tasks are evaluated on problems drawn with this seed offset, never the run's own.
FRESH_SEED_OFFSET = 1_000_003


def fresh_task_rows(cfg, train_dataset, num_prompts: int) -> list[dict]:
    """A reasoning-gym run without a held-out split: ``num_prompts`` problems generated from
    another seed, leaving out any whose prompt the run trained on (small tasks repeat)."""
    seen = set(train_dataset["prompt"])
    fresh = load_prompt_dataset(
        cfg.data.source, size=max(4 * num_prompts, 64), seed=cfg.training.seed + FRESH_SEED_OFFSET,
        instruction=cfg.data.instruction, task_kwargs=cfg.data.task_kwargs,
    )
    rows = [dict(r) for r in fresh if r["prompt"] not in seen][:num_prompts]
    if not rows:
        raise ConfigError(f"eval: every problem {cfg.data.source} generates is one the run trained on; "
                          "set data.eval_size > 0 to hold some out")
    return rows


def warn_training_overlap(rows: list[dict], dataset, eval_size: int, seed: int, source: str) -> None:
    """Warn when evaluation prompts are among the prompts the run trained on."""
    train = split_train_eval(dataset, eval_size, seed)[0] if eval_size else dataset
    seen = set(train["prompt"]) if isinstance(train[0]["prompt"], str) else {json.dumps(p) for p in train["prompt"]}
    key = (lambda p: p) if isinstance(rows[0]["prompt"], str) else json.dumps
    overlap = sum(key(r["prompt"]) in seen for r in rows)
    if overlap:
        log.warning("eval: %d of %d prompts are training rows of %s; set data.eval_size > 0 (a held-out split) "
                    "or point data.source at a test set", overlap, len(rows), source)


def run_eval_cli(args) -> int:
    """``maxent-grpo eval MODEL --output DIR [--config FILE] [--set K=V] [-k K] [--num-prompts N]``.

    Data, rewards and sampling settings come from the config (``--config``/``--set``);
    the prompts from :func:`select_eval_rows`; correctness from the config's first
    reward function (see the module docstring). Writes ``DIR/summary.json`` (the
    metrics, ``num_prompts``, ``model``, the ``deciding_reward`` and, on ModeBench
    rows, ``<task>/<metric>`` pooled per task), ``DIR/completions.jsonl`` (one record
    per completion) and ``DIR/per_prompt.jsonl`` (every metric per prompt).
    """
    for flag, value in (("-k", args.k), ("--num-prompts", args.num_prompts)):
        if value is not None and value < 1:
            raise ConfigError(f"{flag} must be >= 1, got {value}")
    device = Dist().device  # the device a run trains on: the GPU when torch has one
    cfg = resolve_precision(load_config(args.config, args.set), bf16_is_fast(device), cuda=device.type == "cuda")
    k = args.k if args.k is not None else cfg.eval.k
    n = args.num_prompts if args.num_prompts is not None else cfg.eval.num_prompts
    dataset = load_prompt_dataset(
        cfg.data.source, split=cfg.data.split, prompt_column=cfg.data.prompt_column,
        answer_column=cfg.data.answer_column, size=cfg.data.size, seed=cfg.training.seed,
        instruction=cfg.data.instruction, task_kwargs=cfg.data.task_kwargs,
    )
    rows = select_eval_rows(dataset, cfg.data.eval_size, n, cfg.training.seed)
    if not cfg.data.eval_size and cfg.data.source.startswith(RG_PREFIX):
        rows = fresh_task_rows(cfg, dataset, n)
    warn_training_overlap(rows, dataset, cfg.data.eval_size, cfg.training.seed, cfg.data.source)
    spec = build_reward_spec(cfg.rewards)
    g = cfg.generation
    limits = episode_limits(cfg.environment, g.max_new_tokens)
    # A multi-turn run is evaluated on episodes, each row with its environment (checked before the model loads).
    episodes = None if limits is None else EpisodePlay(
        row_environments(cfg.environment, [r[ENVIRONMENT_COLUMN] if ENVIRONMENT_COLUMN in r else None for r in rows]),
        limits)
    model_path = resolve_model_path(args.model)
    BACKENDS[g.backend].check(g.vllm, model_path)  # before the model loads
    model, tokenizer = load_model_and_tokenizer(model_path, dtype=cfg.model.dtype, device=device)
    sampling = SamplingParams(
        max_new_tokens=g.max_new_tokens, temperature=g.temperature, top_p=g.top_p, top_k=g.top_k, stop=tuple(g.stop),
    )
    # The sampler the config names, as in training (generation.backend: hf, vllm or vllm_server).
    backend = BACKENDS[g.backend].build(BackendInputs(
        model=model, tokenizer=tokenizer, model_path=model_path,
        sample_dtype=None if g.dtype is None else parse_dtype(g.dtype), batch_size=g.batch_size,
        share_prompts=cfg.training.share_prompts, vllm=g.vllm, seed=eval_seed(cfg.training.seed),
        default_sync_dir=Path(args.output) / "vllm_weights",
        # An episode's context grows past its prompt: the engine then keeps the model's length.
        max_prompt_tokens=None if episodes is not None else longest_prompt_tokens(
            tokenizer, [r["prompt"] for r in rows], system_prompt=cfg.data.system_prompt, few_shot=cfg.data.few_shot,
        ),
        max_new_tokens=g.max_new_tokens,
    ))
    torch.manual_seed(eval_seed(cfg.training.seed))
    with backend.rollout_phase(model):
        summary, records = evaluate_prompts(
            backend, tokenizer, rows, spec, k=k, sampling=sampling,
            system_prompt=cfg.data.system_prompt, few_shot=cfg.data.few_shot, episodes=episodes,
        )
    summary.update(per_task_means(per_prompt_metrics(records, k)))
    summary["model"] = str(args.model)
    summary["deciding_reward"] = spec.names[0]
    write_eval_outputs(args.output, summary, records)
    print(json.dumps(summary, indent=2))
    return 0
