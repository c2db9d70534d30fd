"""Evaluation: greedy pass@1, sampled pass@k, mean@k, distinct correct answers@k (§10).

Used in the training loop (NeMo-RL's ``validate``, every ``eval.every_steps``)
and by ``maxent-grpo eval`` for any saved model or checkpoint.
"""

from __future__ import annotations

import json
import os
from dataclasses import replace
from pathlib import Path

import torch

from maxent_grpo.core.eval_metrics import summarize_eval
from maxent_grpo.rewards.answers import canonical_answer, extract_final_answer
from maxent_grpo.rewards.registry import RewardSpec, evaluate_rewards
from maxent_grpo.rollout.backend import GenerationBackend, SamplingParams, generate_groups
from maxent_grpo.training.data import format_prompt

# A completion is correct when the deciding reward function (the first one in the
# recipe, normally an accuracy reward) gives at least this much.
CORRECT_THRESHOLD = 1.0


def _score(spec: RewardSpec, rows: list[dict], texts: list[str], per_prompt: int) -> torch.Tensor:
    conversational = isinstance(rows[0]["prompt"], list)
    prompts = [r["prompt"] for r in rows for _ in range(per_prompt)]
    completions = [[{"role": "assistant", "content": t}] for t in texts] if conversational else texts
    columns = {k: [r[k] for r in rows for _ in range(per_prompt)] for k in rows[0] if k != "prompt"}
    return evaluate_rewards(spec, prompts, completions, columns)[:, 0]


def evaluate_prompts(
    backend: GenerationBackend,
    tokenizer,
    rows: list[dict],
    spec: RewardSpec,
    *,
    k: int,
    sampling: SamplingParams,
    system_prompt: str | None = None,
    greedy: bool = True,
) -> tuple[dict[str, float], list[dict]]:
    """Return the summary metrics and one record per completion."""
    prompts = [format_prompt(tokenizer, r["prompt"], system_prompt=system_prompt) for r in rows]
    # k=1 sampled groups are legal here: evaluation needs no group statistics.
    sampled, dropped = generate_groups(backend, prompts, k, sampling, max_retry_rounds=1)
    kept_idx = [i for i in range(len(rows)) if i not in set(dropped)]
    kept = [rows[i] for i in kept_idx]
    prompts = [prompts[i] for i in kept_idx]
    scores = _score(spec, kept, sampled.completion_texts, k)
    records, per_prompt = [], []
    for p, row in enumerate(kept):
        flags, answers = [], []
        for j in range(k):
            i = p * k + j
            text = sampled.completion_texts[i]
            ans = extract_final_answer(text)
            correct = bool(scores[i] >= CORRECT_THRESHOLD)
            flags.append(correct)
            answers.append(canonical_answer(ans) if ans is not None else None)
            records.append({
                "prompt_index": p, "sample": j, "prompt": prompts[p], "completion": text,
                "reward": float(scores[i]), "correct": correct, "answer": answers[-1],
                "finish_reason": sampled.finish_reasons[i], "mode": "sampled",
            })
        per_prompt.append((flags, answers))
    greedy_flags = None
    if greedy:
        gparams = replace(sampling, do_sample=False, temperature=1.0, top_p=1.0, top_k=0)
        gbatch, _ = generate_groups(backend, prompts, 1, gparams, max_retry_rounds=1)
        gscores = _score(spec, kept, gbatch.completion_texts, 1)
        greedy_flags = [bool(s >= CORRECT_THRESHOLD) for s in gscores]
        for p, text in enumerate(gbatch.completion_texts):
            records.append({
                "prompt_index": p, "sample": 0, "prompt": prompts[p], "completion": text,
                "reward": float(gscores[p]), "correct": greedy_flags[p], "mode": "greedy",
                "finish_reason": gbatch.finish_reasons[p],
            })
    summary = summarize_eval(per_prompt, ks=sorted({1, k}), greedy=greedy_flags)
    summary["num_prompts"] = len(kept)
    return summary, records


def write_eval_outputs(out_dir: str | Path, summary: dict, records: list[dict]) -> None:
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    for name, text in (
        ("completions.jsonl", "".join(json.dumps(r) + "\n" for r in records)),
        ("summary.json", json.dumps(summary, indent=2) + "\n"),
    ):
        tmp = out / (name + ".tmp")
        tmp.write_text(text)
        os.replace(tmp, out / name)


def run_eval_cli(args) -> int:
    """``maxent-grpo eval MODEL --output DIR [--config FILE] [-k K] [--num-prompts N]``."""
    from maxent_grpo.models import load_model_and_tokenizer, resolve_model_path
    from maxent_grpo.rewards.registry import build_reward_spec
    from maxent_grpo.rollout.hf import HFGenerationBackend
    from maxent_grpo.training.config import load_config
    from maxent_grpo.training.data import load_prompt_dataset, split_train_eval

    cfg = load_config(args.config, args.set)
    k = args.k or cfg.eval.k
    n = args.num_prompts or cfg.eval.num_prompts
    torch.manual_seed(cfg.training.seed)
    dataset = load_prompt_dataset(
        cfg.data.source, split=cfg.data.split, prompt_column=cfg.data.prompt_column,
        answer_column=cfg.data.answer_column, size=cfg.data.size, seed=cfg.training.seed,
    )
    _, eval_ds = split_train_eval(dataset, max(cfg.data.eval_size, n), cfg.training.seed)
    rows = list(eval_ds)[:n]
    spec = build_reward_spec(cfg.rewards)
    model, tokenizer = load_model_and_tokenizer(resolve_model_path(args.model), dtype=cfg.model.dtype, device="cpu")
    g = cfg.generation
    sampling = SamplingParams(max_new_tokens=g.max_new_tokens, temperature=g.temperature, top_p=g.top_p, top_k=g.top_k, stop=tuple(g.stop))
    backend = HFGenerationBackend(model, tokenizer, batch_size=g.batch_size)
    summary, records = evaluate_prompts(backend, tokenizer, rows, spec, k=k, sampling=sampling, system_prompt=cfg.data.system_prompt)
    summary["model"] = args.model
    write_eval_outputs(args.output, summary, records)
    print(json.dumps(summary, indent=2))
    return 0
