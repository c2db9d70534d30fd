"""Evaluation: greedy pass@1, sampled pass@k, mean@k, distinct correct answers@k (§10).

Used in the training loop (NeMo-RL's ``validate``, every ``eval.every_steps``)
and by ``maxent-grpo eval`` (:mod:`maxent_grpo.eval_command`) for any saved model
or checkpoint. This module knows no config: both callers pass rows, rewards and
sampling settings, so it sits below ``training``.

What counts as correct: the FIRST reward function of the config decides. A
completion is correct when that function gives at least ``CORRECT_THRESHOLD``
(1.0), so the first reward should be a 0/1 accuracy check (``boxed_accuracy``,
``accuracy``, ``reasoning_gym``, or your own ``module:function``); the other
reward functions are evaluated and recorded but never decide. A ``None``
("not applicable") from the deciding function counts as not correct and as 0
in ``mean@k``.

* ``pass@k``: the unbiased estimator ``1 - C(n-c, k) / C(n, k)`` over the ``n = draws * k``
  samples of each prompt (``pass@1`` is then the fraction correct), averaged over prompts;
* ``mean@k``: the mean score of the deciding reward over the samples;
* ``distinct@k``: distinct correct answers per prompt, answers compared after
  ``extract_final_answer`` (last ``\\boxed{}``, else ``<answer>``) and ``canonical_answer``;
  a correct completion without such an answer is not counted;
* ``greedy_pass@1``: the fraction of prompts whose greedy completion is correct;
* ModeBench rows (``data.source: modebench:<task>``): answers are compared by the
  task's canonical mode key instead (``distinct@k`` counts distinct correct modes),
  and ``coverage@k`` = distinct@k / the prompt's number of valid modes is added.
  Every record carries ``mode_key`` and ``num_valid`` (None for other rows), so
  :func:`per_prompt_metrics` recomputes every statistic per prompt from
  ``completions.jsonl``; ``maxent-grpo eval`` writes them to ``per_prompt.jsonl``.
* ModeBench's own metrics (``mb/``, ALGORITHMS.md §18, :func:`modebench_summary`): each prompt
  gets ``draws`` groups of ``k`` (``eval.draws``; 4 on ``modebench_pkg:`` data, as the anchor);
  accuracy, pass@k and distinct@k per group, PCMD pooled over the draws, reportable over at
  least ``eval.min_defined_prompts`` defined prompts.
* The failure policy (§18): a completion the modebench verifier cannot score (timeout,
  worker failure, ...) fails the whole evaluation. Every accuracy, pass, mean, distinct,
  coverage and PCMD value is then None, ``mb/pcmd_reportable`` is false and
  ``mb/eval_status`` is ``verifier_failure`` (``mb/verifier_failures`` counts them);
  records carry ``unscorable``.
"""

from __future__ import annotations

import json
import logging
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from pathlib import Path

import numpy as np
import torch

from maxent_grpo.core.eval_metrics import PromptSamples, summarize_eval
from maxent_grpo.core.mode_metrics import MIN_DEFINED_PROMPTS, modebench_cell
from maxent_grpo.data.prompts import FewShotExample, format_prompt, prompt_messages
from maxent_grpo.envs.episodes import EpisodePlay, run_episodes
from maxent_grpo.rewards.context import RewardContext, TrainerState
from maxent_grpo.rewards.registry import RewardFunctionError, RewardSpec, evaluate_rewards, rollout_reward_inputs
from maxent_grpo.rollout.backend import GenerationBackend, RolloutBatch, SamplingParams, generate_groups
from maxent_grpo.rollout.data_plane import RolloutRecord
from maxent_grpo.run_files import write_text_atomic
from maxent_grpo.tasks.answers import canonical_answer, extract_final_answer
from maxent_grpo.tasks.modebench import mode_info, row_task
from maxent_grpo.tasks.modebench_package import Grades, Unscorable

log = logging.getLogger("maxent_grpo")

__all__ = [
    "CORRECT_THRESHOLD", "EvalSampling", "eval_seed", "evaluate_prompts", "per_prompt_metrics", "per_task_means", "write_eval_outputs",
]

# A completion is correct when the deciding reward function (the first one in the
# config, normally an accuracy reward) gives at least this much.
CORRECT_THRESHOLD = 1.0


# How a scored evaluation batch reaches the summary: as it is, or through a data plane and back.
Carry = Callable[[RolloutRecord], RolloutRecord]


def eval_seed(seed: int) -> int:
    """The torch seed evaluation samples under, from the run's ``training.seed``.

    The same at every validation step (common random numbers: differences between
    steps come from the weights, not the draw) and in ``maxent-grpo eval``, which
    therefore reproduces a run's ``eval/step-N`` exactly from ``checkpoints/step-N``.
    """
    return int(np.random.SeedSequence([seed, 0x7E57]).generate_state(1, np.uint64)[0] >> 1)


def _score(spec: RewardSpec, rows: list[dict], batch: RolloutBatch, grades: Grades,
           trainer_state: TrainerState | None = None) -> torch.Tensor:
    """Every reward function on ``batch``, called exactly as in training: ``[N, K]``, NaN for None.
    When the modebench verifier cannot score a completion, every reward is NaN: the evaluation
    has failed (the module docstring), and the records say which completion it was."""
    try:
        return evaluate_rewards(spec, *rollout_reward_inputs(rows, batch),
                                RewardContext(batch.num_completions, trainer_state, mode_grades=grades))
    except RewardFunctionError as err:
        if not isinstance(err.__cause__, Unscorable):
            raise
        log.warning("evaluation: %s; every metric of this evaluation is void (verifier_failure)", err)
        return torch.full((batch.num_completions, len(spec.funcs)), math.nan, dtype=torch.float64)


def _sample(backend, tokenizer, rows: list[dict], k: int, params: SamplingParams, system_prompt, few_shot,
            episodes: EpisodePlay | None) -> tuple[RolloutBatch, list[int]]:
    """``k`` completions (or episodes) per row, and the rows whose group did not come back."""
    if episodes is None:
        prompts = [format_prompt(tokenizer, r["prompt"], system_prompt=system_prompt, few_shot=few_shot) for r in rows]
        return generate_groups(backend, prompts, k, params, max_retry_rounds=1)
    played = run_episodes(
        backend, tokenizer, rows, [episodes.environments.factory(r) for r in rows], k, params, episodes.limits,
        frame=lambda m: prompt_messages(m, system_prompt=system_prompt, few_shot=few_shot),
    )
    kept = set(played.kept_rows)
    return played.rollout, [i for i in range(len(rows)) if i not in kept]


def _scored(spec: RewardSpec, rows: list[dict], batch: RolloutBatch, carry: Carry,
            grades: Grades, trainer_state: TrainerState | None = None) -> RolloutRecord:
    """The sampled batch and its rewards as one record, after ``carry`` (the run's data plane)."""
    rewards = _score(spec, rows, batch, grades, trainer_state)
    return carry(RolloutRecord(step=0, version=0, rows=rows, rollout=batch, rewards=rewards))


def _mode(row: dict, text: str, grades: Grades) -> tuple[tuple[str | None, int | None] | None, bool]:
    """(``mode_info`` of a completion, whether the modebench verifier could not score it)."""
    try:
        return mode_info(row, text, grades), False
    except Unscorable:
        answer = json.loads(row["mbp_task"])["answer"]
        return (None, answer.get("num_modes", answer.get("num_solutions"))), True


def _records(spec: RewardSpec, scored: RolloutRecord, indices: list[int], mode: str,
             episodes: EpisodePlay | None, k: int, grades: Grades) -> list[dict]:
    """One record per completion; ``prompt_index`` indexes the evaluated rows; ``task`` is the ModeBench
    task or, in a multi-turn run, the row's environment; ``draw``: the completion's group of ``k``."""
    rows, batch, scores = scored.rows, scored.rollout, scored.rewards
    g, out = batch.num_generations, []
    for i, text in enumerate(batch.completion_texts):
        values = [None if math.isnan(float(v)) else float(v) for v in scores[i]]
        score = values[0]
        answer = extract_final_answer(text)
        modes, unscorable = _mode(rows[i // g], text, grades)  # (mode key, valid modes) on ModeBench rows
        out.append({
            "prompt_index": indices[i // g],
            "sample": i % g,
            "draw": (i % g) // k,
            "mode": mode,
            "prompt": batch.prompts[i // g],
            "completion": text,
            "rewards": dict(zip(spec.names, values)),
            "score": score,
            "correct": score is not None and score >= CORRECT_THRESHOLD,
            "answer": canonical_answer(answer) if answer is not None else None,
            "task": episodes.environments.name(rows[i // g]) if episodes is not None else row_task(rows[i // g]),
            "keyed": modes is not None,
            "unscorable": unscorable,
            "mode_key": None if modes is None else modes[0],
            "num_valid": None if modes is None else modes[1],
            "length": len(batch.completion_ids[i]),
            "finish_reason": batch.finish_reasons[i],
        })
    return out


@dataclass(frozen=True)
class EvalSampling:
    """How :func:`evaluate_prompts` samples each prompt: ``draws`` groups of ``k`` completions under
    ``sampling``, and one greedy completion (``greedy``), each prompt framed by ``system_prompt`` and
    ``few_shot`` as training frames it."""

    k: int
    sampling: SamplingParams
    draws: int = 1
    greedy: bool = True
    system_prompt: str | None = None
    few_shot: Sequence[FewShotExample] = ()


def evaluate_prompts(
    backend: GenerationBackend,
    tokenizer,
    rows: list[dict],
    spec: RewardSpec,
    how: EvalSampling,
    *,
    episodes: EpisodePlay | None = None,
    carry: Carry = lambda record: record,
    min_defined_prompts: int = MIN_DEFINED_PROMPTS,
    trainer_state: TrainerState | None = None,
) -> tuple[dict[str, float | bool | str | None], list[dict]]:
    """Sample ``how.draws`` groups of ``how.k`` completions per row (and one greedy one); return the summary
    and one record per completion.

    The summary holds ``pass@j``, ``mean@j``, ``distinct@j`` for ``j`` in ``{1, k}`` (over all
    ``draws * k`` samples), ``greedy_pass@1`` (with ``greedy``), ``num_prompts`` (rows whose
    samples all came back) and, on ModeBench package rows, the ``mb/`` metrics
    (:func:`modebench_summary`; PCMD reportable over ``min_defined_prompts`` defined prompts).
    Records carry ``mode`` ("sampled" or "greedy"), ``prompt_index`` (into ``rows``), ``sample``
    (``0 .. draws*k - 1``), ``draw``, the completion, every reward (``rewards``), the deciding
    ``score``, ``correct``, the canonical ``answer``, ``unscorable``, ``length`` and ``finish_reason``.
    With ``episodes`` each sample is a multi-turn episode (``envs/episodes.py``) and ``task``
    names its environment. ``carry``: the way each scored batch reaches the summary (in-loop
    validation passes it through the run's data plane, ``training/validation.py``). ``trainer_state``:
    what reward functions that read TRL's ``trainer_state`` get (the step the model was trained to).
    """
    k, draws, sampling, system_prompt, few_shot = how.k, how.draws, how.sampling, how.system_prompt, how.few_shot
    for name, value in (("k", k), ("draws", draws)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"{name} must be a positive int, got {value!r}")
    if not rows:
        raise ValueError("rows must not be empty")
    n = draws * k
    # Groups of k = 1 are legal here: evaluation needs no group statistics. The draws of a prompt are
    # sampled together, n = draws * k at once: independent samples, the same distribution.
    sampled, dropped = _sample(backend, tokenizer, rows, n, sampling, system_prompt, few_shot, episodes)
    kept = [i for i in range(len(rows)) if i not in set(dropped)]
    if not kept:
        raise RuntimeError(f"evaluation: no prompt got its {n} samples back from the generator")
    grades = Grades()  # each completion reaches the modebench verifier once
    records = _records(spec, _scored(spec, [rows[i] for i in kept], sampled, carry, grades, trainer_state), kept, "sampled",
                       episodes, k, grades)
    greedy_correct: dict[int, bool] = {}
    if how.greedy:
        params = replace(sampling, do_sample=False, temperature=1.0, top_p=1.0, top_k=0)
        gbatch, gdropped = _sample(backend, tokenizer, [rows[i] for i in kept], 1, params, system_prompt, few_shot,
                                   episodes)
        gkept = [kept[j] for j in range(len(kept)) if j not in set(gdropped)]
        if gkept:
            greedy_records = _records(spec, _scored(spec, [rows[i] for i in gkept], gbatch, carry, grades, trainer_state), gkept,
                                      "greedy", episodes, 1, grades)
            records += greedy_records
            greedy_correct = {r["prompt_index"]: r["correct"] for r in greedy_records}
    per_prompt = [
        _prompt_samples(records[p * n : (p + 1) * n], greedy_correct.get(i)) for p, i in enumerate(kept)
    ]
    summary: dict = summarize_eval(per_prompt, ks=sorted({1, k}), correct_threshold=CORRECT_THRESHOLD)
    summary["num_prompts"] = len(kept)
    if verifier_failed(records):
        summary = {name: None if "@" in name else value for name, value in summary.items()}
    summary.update(modebench_summary(records, min_defined_prompts))
    return summary, records


def verifier_failed(records: list[dict]) -> bool:
    """Whether the modebench verifier could not score some completion (sampled or greedy): then the
    evaluation failed and none of its metrics stands (ALGORITHMS.md §18's failure policy)."""
    return any(r["unscorable"] for r in records)


def modebench_summary(records: list[dict],
                      min_defined_prompts: int = MIN_DEFINED_PROMPTS) -> dict[str, float | bool | str | None]:
    """ModeBench's ``mb/`` metrics (``core/mode_metrics.py``) of the sampled records of mode-keyed rows,
    one cell per task: ``mb/accuracy``, ``mb/pass@k``, ``mb/distinct@k`` (per group of k, a record's
    ``draw``, averaged over the groups, then the prompts), ``mb/pcmd`` (pooled over a prompt's draws)
    with ``mb/pcmd_defined``, ``mb/pcmd_prompts``, ``mb/pcmd_se`` and ``mb/pcmd_reportable`` (at least
    ``min_defined_prompts`` defined prompts, and no unscorable completion); ``mb/<task>/...`` when the
    rows hold several tasks; ``mb/eval_status`` (``complete`` or ``verifier_failure``) and
    ``mb/verifier_failures``. Any unscorable completion, in any task, greedy or sampled, nulls every
    value. Empty without such rows."""
    groups: dict[str, dict[int, dict[int, list]]] = {}
    for r in records:
        if r["mode"] == "sampled" and r["keyed"]:
            verified = r["correct"] and r["mode_key"] is not None
            draws = groups.setdefault(r["task"], {}).setdefault(r["prompt_index"], {})
            draws.setdefault(r["draw"], []).append((verified, r["mode_key"], r["unscorable"]))
    if not groups:
        return {}
    failures = sum(r["unscorable"] for r in records)
    out: dict[str, float | bool | str | None] = {}
    for task, prompts in sorted(groups.items()):
        table = [[group for _, group in sorted(draws.items())] for _, draws in sorted(prompts.items())]
        cell = modebench_cell(table, min_defined_prompts=min_defined_prompts, failed_elsewhere=bool(failures))
        prefix = "mb/" if len(groups) == 1 else f"mb/{task}/"
        out |= {f"{prefix}accuracy": cell["accuracy"], f"{prefix}pass@k": cell["pass@k"],
                f"{prefix}distinct@k": cell["distinct@k"], f"{prefix}pcmd": cell["pcmd"],
                f"{prefix}pcmd_defined": cell["defined_prompts"], f"{prefix}pcmd_prompts": cell["prompts"],
                f"{prefix}pcmd_se": cell["standard_error"], f"{prefix}pcmd_reportable": cell["reportable"]}
    return out | {"mb/eval_status": "verifier_failure" if failures else "complete",
                  "mb/verifier_failures": failures}


def _prompt_samples(mine: list[dict], greedy_correct: bool | None) -> PromptSamples:
    """One prompt's sampled records as :class:`PromptSamples`: mode keys where the task defines them."""
    keyed = mine[0]["keyed"]
    return PromptSamples(
        # The deciding reward's score; None (not applicable) counts as 0, so it is never correct.
        scores=[0.0 if r["score"] is None else r["score"] for r in mine],
        answers=[r["mode_key"] if keyed else r["answer"] for r in mine],
        greedy_correct=greedy_correct,
        num_valid=mine[0]["num_valid"] if keyed else None,
    )


def per_prompt_metrics(records: list[dict], k: int) -> list[dict]:
    """Every metric of :func:`evaluate_prompts` for each prompt, recomputed from its records.

    One dict per prompt with sampled records (``prompt_index`` order): ``prompt_index``,
    ``task``, ``num_valid``, ``pass@1``, ``pass@k``, ``mean@k``, ``distinct@k``,
    ``coverage@k`` (ModeBench rows), ``greedy_pass@1`` (when a greedy record exists) and
    ``unscorable`` (its completions the modebench verifier could not score).
    """
    sampled: dict[int, list[dict]] = {}
    greedy: dict[int, bool] = {}
    unscorable_greedy: dict[int, bool] = {}
    for r in records:
        if r["mode"] == "greedy":
            greedy[r["prompt_index"]] = r["correct"]
            unscorable_greedy[r["prompt_index"]] = r["unscorable"]
        else:
            sampled.setdefault(r["prompt_index"], []).append(r)
    out = []
    for index in sorted(sampled):
        mine = sorted(sampled[index], key=lambda r: r["sample"])
        metrics = summarize_eval([_prompt_samples(mine, greedy.get(index))], ks=sorted({1, k}),
                                 correct_threshold=CORRECT_THRESHOLD)
        metrics.pop("num_prompts")
        out.append({"prompt_index": index, "task": mine[0]["task"], "num_valid": mine[0]["num_valid"], **metrics,
                    "unscorable": sum(r["unscorable"] for r in mine) + int(unscorable_greedy.get(index, False))})
    return out


def write_eval_outputs(out_dir: str | Path, summary: dict, records: list[dict]) -> None:
    """``summary.json``, ``completions.jsonl`` and ``per_prompt.jsonl`` in ``out_dir``, each written atomically."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    k = 1 + max(r["sample"] for r in records if r["mode"] == "sampled" and r["draw"] == 0)
    for name, text in (
        ("completions.jsonl", "".join(json.dumps(r) + "\n" for r in records)),
        ("per_prompt.jsonl", "".join(json.dumps(r) + "\n" for r in per_prompt_metrics(records, k))),
        ("summary.json", json.dumps(summary, indent=2) + "\n"),
    ):
        write_text_atomic(out / name, text)


def per_task_means(per_prompt: list[dict]) -> dict[str, float]:
    """``<task>/<metric>``: each metric pooled over the prompts of each task (a ModeBench task, or a
    multi-turn run's environment; empty without tasks); None when any prompt had an unscorable
    completion (the failure policy)."""
    out: dict[str, float | None] = {}
    failed = any(p["unscorable"] for p in per_prompt)
    for task in sorted({p["task"] for p in per_prompt if p["task"] is not None}):
        mine = [p for p in per_prompt if p["task"] == task]
        for name in [n for n in mine[0] if "@" in n and all(n in p for p in mine)]:
            out[f"{task}/{name}"] = None if failed else sum(p[name] for p in mine) / len(mine)
    return out
