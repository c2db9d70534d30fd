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
from maxent_grpo.errors import ConfigError
from maxent_grpo.envs import ENVIRONMENT_COLUMN
from maxent_grpo.evaluate import EvalSampling, eval_seed, evaluate_prompts, per_prompt_metrics, per_task_means, write_eval_outputs
from maxent_grpo.models import load_model_and_tokenizer, resolve_model_path
from maxent_grpo.rewards.registry import build_reward_spec
from maxent_grpo.rollout.backends import BACKENDS
from maxent_grpo.training.checkpoint import TRAINER_STATE_NAME, read_trainer_state
from maxent_grpo.training.data import DataPlan, load_table, row_episodes
from maxent_grpo.training.distributed import Dist
from maxent_grpo.training.run_plan import RunPlan
from maxent_grpo.training.sampler import build_sampler, describe_sampling

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


def _checkpoint_state(source: dict, model: str) -> dict | None:
    """MODEL's trainer state when MODEL is a checkpoint of a run with this config's (``source``) data and seed."""
    path = Path(model)
    if not (path / TRAINER_STATE_NAME).is_file():
        return None
    state = read_trainer_state(path)
    if "config" not in state:  # a checkpoint from before checkpoints held their config
        return None
    ours = json.loads(json.dumps(source))
    saved = state["config"]
    if saved["data"] != ours["data"] or saved["training"]["seed"] != ours["training"]["seed"]:
        return None
    return state


def trained_prompts(plan: RunPlan, dataset, model: str) -> set[str]:
    """The prompts (as :func:`_key`) the run trained on.

    When MODEL is a checkpoint of a run of this config: the rows its sampler drew up to that
    step (the default run draws 60 of its 1000 rows). Otherwise every training row of the
    config's data (the held-out split excepted).
    """
    d = plan.data
    train = split_train_eval(dataset, d.eval_size, d.seed)[0] if d.eval_size else dataset
    prompts = train["prompt"]
    state = _checkpoint_state(plan.source, model)
    if state is None:
        return {_key(p) for p in prompts}
    sampler = PromptSampler(train, state["sampler"]["batch_size"], seed=d.seed, shuffle=d.shuffle)
    sampler.load_state_dict(state["sampler"])
    return {_key(prompts[i]) for i in sampler.drawn_indices()}


def fresh_task_rows(d: DataPlan, trained: set[str], num_prompts: int) -> list[dict]:
    """A reasoning-gym run without a held-out split: up to ``num_prompts`` distinct problems generated
    from another seed that the run did not train on (``trained``: :func:`trained_prompts`).

    A small task can run out of them (one-digit chain_sum has 200 problems): then as many as are
    left, and when none are, problems the run trained on (``warn_training_overlap`` says so).
    """
    pool = load_prompt_dataset(
        d.source, size=max(4 * num_prompts, 64), seed=d.seed + FRESH_SEED_OFFSET,
        instruction=d.instruction, task_kwargs=d.task_kwargs,
    )
    distinct: dict[str, dict] = {}
    for row in pool:
        distinct.setdefault(_key(row["prompt"]), dict(row))
    fresh = [row for key, row in distinct.items() if key not in trained]
    if 0 < len(fresh) < num_prompts:
        log.warning("eval: %s has %d problem(s) the run did not train on, fewer than the %d asked for; evaluating "
                    "those (set data.eval_size > 0 to hold more out)", d.source, len(fresh), num_prompts)
    return (fresh or list(distinct.values()))[:num_prompts]


def warn_training_overlap(rows: list[dict], trained: set[str], source: str) -> None:
    """Warn when evaluation prompts are among the prompts the run trained on."""
    overlap = sum(_key(r["prompt"]) in trained for r in rows)
    if overlap:
        log.warning("eval: %d of %d prompts are training rows of %s; set data.eval_size > 0 (a held-out split) "
                    "or point data.source at a test set", overlap, len(rows), source)


def eval_rows(plan: RunPlan, dataset, model: str, num_prompts: int) -> list[dict]:
    """The rows ``maxent-grpo eval MODEL`` evaluates (the module docstring), with a warning for
    any the run trained on."""
    d = plan.data
    trained = trained_prompts(plan, dataset, model)
    if not d.eval_size and d.source.startswith(RG_PREFIX):
        rows = fresh_task_rows(d, trained, num_prompts)
    else:
        rows = select_eval_rows(dataset, d.eval_size, num_prompts, d.seed)
    warn_training_overlap(rows, trained, d.source)
    return rows


def run_eval(plan: RunPlan, args) -> int:
    """``maxent-grpo eval MODEL --output DIR [--config FILE] [--set K=V] [-k K] [--num-prompts N]``,
    with ``plan`` compiled from the config (``--config``/``--set``).

    Data, rewards and sampling come from the plan, built as training builds them
    (``training/data.py``, ``training/sampler.py``); the prompts from :func:`eval_rows`;
    correctness from the config's first reward function (see the module docstring). Writes
    ``DIR/summary.json`` (the metrics, ``num_prompts``, ``model``, the ``deciding_reward`` and, on
    ModeBench rows, ``<task>/<metric>`` pooled per task), ``DIR/completions.jsonl`` (one record
    per completion) and ``DIR/per_prompt.jsonl`` (every metric per prompt).
    """
    for flag, value in (("-k", args.k), ("--num-prompts", args.num_prompts)):
        if value is not None and value < 1:
            raise ConfigError(f"{flag} must be >= 1, got {value}")
    k = args.k if args.k is not None else plan.eval.k
    n = args.num_prompts if args.num_prompts is not None else plan.eval.num_prompts
    rows = eval_rows(plan, load_table(plan.data), args.model, n)
    spec = build_reward_spec(list(plan.rewards))
    # A multi-turn run is evaluated on episodes, each row with its environment (checked before the model loads).
    episodes = row_episodes(plan.data, None if plan.data.episodes is None else [r.get(ENVIRONMENT_COLUMN) for r in rows])
    model_path = resolve_model_path(args.model)
    BACKENDS[plan.sampler.backend].check(plan.sampler.vllm, model_path)  # before the model loads
    for note in plan.notes:
        log.info("%s", note)
    log.info("%s", describe_sampling(plan.sampler))
    model, tokenizer = load_model_and_tokenizer(model_path, dtype=plan.model.dtype, device=Dist().device)
    # The sampler the config names, built as training builds it.
    backend = build_sampler(plan.sampler, model, tokenizer, model_path, seed=eval_seed(plan.seed),
                            sync_dir=Path(args.output) / "vllm_weights", prompts=lambda: [r["prompt"] for r in rows])
    torch.manual_seed(eval_seed(plan.seed))
    with backend.rollout_phase(model):
        summary, records = evaluate_prompts(
            backend, tokenizer, rows, spec,
            EvalSampling(k=k, sampling=plan.batch.sampling, draws=plan.eval.draws,
                         system_prompt=plan.batch.system_prompt, few_shot=plan.batch.few_shot),
            episodes=episodes, min_defined_prompts=plan.eval.min_defined_prompts,
        )
    summary.update(per_task_means(per_prompt_metrics(records, k)))
    summary["model"] = str(args.model)
    summary["deciding_reward"] = spec.names[0]
    write_eval_outputs(args.output, summary, records)
    print(json.dumps(summary, indent=2))
    return 0
