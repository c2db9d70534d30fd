"""``maxent-grpo eval``: evaluate a saved model or checkpoint the way the run's config says.

Which rows (:func:`eval_rows`): the held-out split when there is one
(:func:`select_eval_rows`); else, for a generated task, problems from another seed that
the run did not train on (:func:`fresh_task_rows`; for a checkpoint of the run, those its
sampler did not draw up to that step), or, when the run trained on every problem the task
has, those; else the first rows of the data. A warning says whenever evaluation prompts
are ones the run trained on. The metrics are :mod:`maxent_grpo.evaluate`'s.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path

import torch

from maxent_grpo.data.datasets import RG_PREFIX, PromptSampler, load_prompt_dataset, split_train_eval
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
from maxent_grpo.training.checkpoint import TRAINER_STATE_NAME, read_trainer_state
from maxent_grpo.training.config import load_config, to_dict
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


def _key(prompt) -> str:
    """A prompt as a set member: its text, or a chat's JSON."""
    return prompt if isinstance(prompt, str) else json.dumps(prompt)


def _checkpoint_state(cfg, model: str) -> dict | None:
    """MODEL's trainer state when MODEL is a checkpoint of a run with this config's data and seed."""
    path = Path(model)
    if not (path / TRAINER_STATE_NAME).is_file():
        return None
    state = read_trainer_state(path)
    if "config" not in state:  # a checkpoint from before checkpoints held their config
        return None
    ours = json.loads(json.dumps(to_dict(cfg)))
    saved = state["config"]
    if saved["data"] != ours["data"] or saved["training"]["seed"] != ours["training"]["seed"]:
        return None
    return state


def trained_prompts(cfg, dataset, model: str) -> set[str]:
    """The prompts (as :func:`_key`) the run trained on.

    When MODEL is a checkpoint of a run of this config: the rows its sampler drew up to that
    step (the default run draws 60 of its 1000 rows). Otherwise every training row of the
    config's data (the held-out split excepted).
    """
    d = cfg.data
    train = split_train_eval(dataset, d.eval_size, cfg.training.seed)[0] if d.eval_size else dataset
    prompts = train["prompt"]
    state = _checkpoint_state(cfg, model)
    if state is None:
        return {_key(p) for p in prompts}
    sampler = PromptSampler(train, state["sampler"]["batch_size"], seed=cfg.training.seed, shuffle=d.shuffle)
    sampler.load_state_dict(state["sampler"])
    return {_key(prompts[i]) for i in sampler.drawn_indices()}


def fresh_task_rows(cfg, trained: set[str], num_prompts: int) -> list[dict]:
    """A reasoning-gym run without a held-out split: up to ``num_prompts`` distinct problems generated
    from another seed that the run did not train on (``trained``: :func:`trained_prompts`).

    A small task can run out of them (one-digit chain_sum has 200 problems): then as many as are
    left, and when none are, problems the run trained on (``warn_training_overlap`` says so).
    """
    pool = load_prompt_dataset(
        cfg.data.source, size=max(4 * num_prompts, 64), seed=cfg.training.seed + FRESH_SEED_OFFSET,
        instruction=cfg.data.instruction, task_kwargs=cfg.data.task_kwargs,
    )
    distinct: dict[str, dict] = {}
    for row in pool:
        distinct.setdefault(_key(row["prompt"]), dict(row))
    fresh = [row for key, row in distinct.items() if key not in trained]
    if 0 < len(fresh) < num_prompts:
        log.warning("eval: %s has %d problem(s) the run did not train on, fewer than the %d asked for; evaluating "
                    "those (set data.eval_size > 0 to hold more out)", cfg.data.source, len(fresh), num_prompts)
    return (fresh or list(distinct.values()))[:num_prompts]


def warn_training_overlap(rows: list[dict], trained: set[str], source: str) -> None:
    """Warn when evaluation prompts are among the prompts the run trained on."""
    overlap = sum(_key(r["prompt"]) in trained for r in rows)
    if overlap:
        log.warning("eval: %d of %d prompts are training rows of %s; set data.eval_size > 0 (a held-out split) "
                    "or point data.source at a test set", overlap, len(rows), source)


def eval_rows(cfg, dataset, model: str, num_prompts: int) -> list[dict]:
    """The rows ``maxent-grpo eval MODEL`` evaluates (the module docstring), with a warning for
    any the run trained on."""
    trained = trained_prompts(cfg, dataset, model)
    if not cfg.data.eval_size and cfg.data.source.startswith(RG_PREFIX):
        rows = fresh_task_rows(cfg, trained, num_prompts)
    else:
        rows = select_eval_rows(dataset, cfg.data.eval_size, num_prompts, cfg.training.seed)
    warn_training_overlap(rows, trained, cfg.data.source)
    return rows


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
    rows = eval_rows(cfg, dataset, args.model, n)
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
