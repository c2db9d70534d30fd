"""Held-out sampled evaluation of a saved model, the same for every trainer's output.

For each held-out prompt, sample ``n`` completions (HF ``generate``), score
them with the benchmark rewards and report: mean task score, format rate,
pass@k by the unbiased estimator ``1 - C(n-c, k) / C(n, k)``, and the number
of distinct correct answers per prompt (answers compared after
``canonical_answer``). A completion is correct when its task score is 1.

Run as ``python -m benchmarks.sample_eval --model-dir D --task countdown --out E.json``.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
from dataclasses import dataclass
from pathlib import Path

from benchmarks.common_rewards import boxed_accuracy, boxed_format
from maxent_grpo.core.eval_metrics import pass_at_k
from benchmarks.tasks import task_rows

EVAL_SEED_OFFSET = 10_000  # held-out prompts: a reasoning-gym seed no training run uses


@dataclass(frozen=True)
class EvalResult:
    model_dir: str
    task: str
    prompts: int
    samples_per_prompt: int
    mean_score: float
    format_rate: float
    pass_at: dict[int, float]
    distinct_correct_per_prompt: float

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)


def summarize_samples(scores: list[list[float]], answers: list[list[str | None]], ks: list[int]) -> tuple:
    """(mean score, {k: pass@k}, mean distinct correct answers) from per-prompt score and answer lists."""
    from maxent_grpo.tasks.answers import canonical_answer

    n = len(scores[0])
    flat = [s for row in scores for s in row]
    pass_at = {k: sum(pass_at_k(n, sum(s >= 1.0 for s in row), k) for row in scores) / len(scores) for k in ks}
    distinct = [
        len({canonical_answer(a) for s, a in zip(row, ans) if s >= 1.0 and a is not None})
        for row, ans in zip(scores, answers)
    ]
    return sum(flat) / len(flat), pass_at, sum(distinct) / len(distinct)


def evaluate_model(model_dir: Path, task: str, prompts: int, samples: int, max_new_tokens: int,
                   seed: int, temperature: float = 1.0, bf16: bool = False, batch_prompts: int = 4,
                   task_kwargs: dict | None = None, few_shot: tuple[tuple[str, str], ...] = ()) -> EvalResult:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from maxent_grpo.tasks.answers import extract_final_answer

    if samples < 1 or prompts < 1:
        raise ValueError(f"prompts and samples must be >= 1, got {prompts}, {samples}")
    torch.manual_seed(seed)
    tok = AutoTokenizer.from_pretrained(model_dir)
    tok.padding_side = "left"
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.bfloat16 if bf16 else torch.float32).eval()
    rows = task_rows(task, prompts, seed + EVAL_SEED_OFFSET, task_kwargs=task_kwargs, few_shot=few_shot)
    scores, answers, formats = [], [], []
    for lo in range(0, len(rows), batch_prompts):
        batch = rows[lo : lo + batch_prompts]
        texts = [tok.apply_chat_template(r["prompt"], add_generation_prompt=True, tokenize=False) for r in batch]
        enc = tok(texts, padding=True, return_tensors="pt", add_special_tokens=False)
        with torch.no_grad():
            out = model.generate(
                **enc, do_sample=True, temperature=temperature, top_p=1.0, top_k=0, max_new_tokens=max_new_tokens,
                num_return_sequences=samples, pad_token_id=tok.pad_token_id, eos_token_id=tok.eos_token_id,
            )
        completions = tok.batch_decode(out[:, enc["input_ids"].size(1):], skip_special_tokens=True)
        expanded = [r for r in batch for _ in range(samples)]
        got = boxed_accuracy(
            [r["prompt"] for r in expanded], completions,
            rg_entry=[r["rg_entry"] for r in expanded],
        )
        fmt = boxed_format([r["prompt"] for r in expanded], completions)
        for i in range(len(batch)):
            scores.append(got[i * samples : (i + 1) * samples])
            answers.append([extract_final_answer(c) for c in completions[i * samples : (i + 1) * samples]])
            formats += fmt[i * samples : (i + 1) * samples]
    ks = sorted({1, samples})
    mean, pass_at, distinct = summarize_samples(scores, answers, ks)
    return EvalResult(str(model_dir), task, len(rows), samples, mean, sum(formats) / len(formats), pass_at, distinct)


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model-dir", type=Path, required=True)
    p.add_argument("--task", default="chain_sum")
    p.add_argument("--prompts", type=int, default=32)
    p.add_argument("--samples", type=int, default=8)
    p.add_argument("--max-new-tokens", type=int, default=64)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--bf16", action="store_true")
    p.add_argument("--task-kwargs", type=json.loads, default={}, help="the task generator's options, as JSON")
    p.add_argument("--few-shot", type=json.loads, default=[], help="solved examples [[prompt, completion], ...], as JSON")
    p.add_argument("--out", type=Path, required=True)
    a = p.parse_args(argv)
    result = evaluate_model(a.model_dir, a.task, a.prompts, a.samples, a.max_new_tokens, a.seed, bf16=a.bf16,
                            task_kwargs=a.task_kwargs, few_shot=tuple(tuple(pair) for pair in a.few_shot))
    a.out.write_text(json.dumps(result.to_dict(), indent=1))
    print(json.dumps(result.to_dict()))


if __name__ == "__main__":
    main()
