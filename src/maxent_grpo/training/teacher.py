"""On-policy distillation's teacher (ALGORITHMS.md §19): the ``teacher:`` section,
its plan, and the frozen teacher scored on the student's own rows.

The teacher is a second frozen model loaded like the reference (``strategy.load_reference``: whole on
each process under DDP, sharded under FSDP2) and scored on the packed rows after generation, so it
works with every generation backend. Its tokenizer must have the student's vocabulary (the completion
tokens are the student's); a teacher with another is refused. ``teacher.chat_template: student``
scores the student's token ids as they are; ``teacher`` renders each prompt again with the teacher
tokenizer's own chat template and scores the same completion tokens after it (one-shot prompts only).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Literal

import torch

from maxent_grpo.core.logprobs import Scoring
from maxent_grpo.data.prompts import FewShotExample, format_prompt
from maxent_grpo.core.losses import KL_ESTIMATORS
from maxent_grpo.errors import UserError
from maxent_grpo.models import load_tokenizer, resolve_model_path
from maxent_grpo.training.strategy import Strategy


@dataclass
class TeacherConfig:
    """The ``teacher:`` section (off while ``name_or_path`` is null)."""

    name_or_path: str | None = field(default=None, metadata={"help": (
        "on-policy distillation's teacher: a local folder or hub name with the student's tokenizer (null: no "
        "teacher). Its per-token reverse KL on the student's completions trains the student")})
    dtype: Literal["float32", "bfloat16", "float64"] = field(default="float32", metadata={
        "help": "the teacher's dtype (frozen, scored without gradients)"})
    coef: float = field(default=1.0, metadata={
        "help": "c: each sampled token's advantage gets -c * KL estimate (the term c * sg(k) * ratio in the loss)"})
    kl_estimator: Literal[tuple(KL_ESTIMATORS)] = field(default="k1", metadata={"help": (
        "per-token estimate k of KL(student || teacher) at the sampled token, d = logp_teacher - logp_student: "
        "k1 = -d (the peers'; its expected gradient is the reverse KL's), k2, k3")})
    chat_template: Literal["student", "teacher"] = field(default="student", metadata={"help": (
        "the template of the prompt the teacher scores: student (the student's token ids as sampled) or teacher "
        "(each prompt rendered again with the teacher tokenizer's own chat template, the completion tokens "
        "unchanged; one-shot prompts only)")})
    rewards: bool = field(default=True, metadata={"help": (
        "also train on the rewards' advantages (false: distillation alone, the advantages set to 0; the "
        "rewards are still computed and logged)")})


@dataclass(frozen=True)
class TeacherPlan:
    name_or_path: str
    dtype: str
    own_template: bool  # teacher.chat_template: teacher
    system_prompt: str | None  # the prompt's framing, rendered again with the teacher's template
    few_shot: tuple[FewShotExample, ...]


class TeacherError(UserError):
    """The teacher cannot score the student's rows (another vocabulary)."""


def check_teacher(t: TeacherPlan, student: str | Any) -> str:
    """The teacher's resolved path; one line when its vocabulary is not the student's (``student``: its
    folder, or its tokenizer object), since it would score other tokens. Run before any model loads."""
    teacher_path = resolve_model_path(t.name_or_path)
    theirs = load_tokenizer(teacher_path).get_vocab()
    ours = (load_tokenizer(student) if isinstance(student, str) else student).get_vocab()
    if theirs != ours:
        raise TeacherError(
            f"teacher.name_or_path: {teacher_path} has another tokenizer ({len(theirs)} tokens, the student's "
            f"{len(ours)}, {len(set(theirs.items()) ^ set(ours.items()))} differ); the teacher must share the "
            "student's vocabulary (cross-tokenizer distillation is not supported)")
    return teacher_path


def teacher_prompt_rows(input_ids: torch.Tensor, attention_mask: torch.Tensor, prompt_length: int,
                        prompt_ids: list[list[int]], num_generations: int, pad_token_id: int):
    """The packed rows ``[N, Lp + T]`` (prompt-major, ``G`` per prompt) with each prompt replaced by
    ``prompt_ids[i // G]``, left-padded to the longest; the completion columns are kept as they are.
    Returns (input_ids, attention_mask, the new prompt length)."""
    n = input_ids.shape[0]
    if len(prompt_ids) * num_generations != n:
        raise ValueError(f"{len(prompt_ids)} prompts x {num_generations} completions != {n} rows")
    lp = max(len(p) for p in prompt_ids)
    prompts = torch.full((n, lp), pad_token_id, dtype=input_ids.dtype, device=input_ids.device)
    mask = torch.zeros((n, lp), dtype=attention_mask.dtype, device=attention_mask.device)
    for i in range(n):
        ids = prompt_ids[i // num_generations]
        prompts[i, lp - len(ids):] = torch.tensor(ids, dtype=input_ids.dtype)
        mask[i, lp - len(ids):] = 1
    return (torch.cat([prompts, input_ids[:, prompt_length:]], 1),
            torch.cat([mask, attention_mask[:, prompt_length:]], 1), lp)


def teacher_scorer(t: TeacherPlan, teacher_path: str, scoring: Scoring, strategy: Strategy):
    """(rows, input_ids, attention_mask, prompt_length) -> the teacher's completion log-probs ``[N, T]``
    (``teacher_path``: :func:`check_teacher`'s; ``rows``: the batch's prompt rows, for its own template)."""
    teacher = strategy.load_reference(teacher_path, dtype=t.dtype)
    tokenizer = load_tokenizer(teacher_path) if t.own_template else None

    def score(rows, ids, mask, plen):
        if tokenizer is not None:
            texts = [format_prompt(tokenizer, r["prompt"], system_prompt=t.system_prompt, few_shot=list(t.few_shot))
                     for r in rows]
            prompt_ids = tokenizer(texts, add_special_tokens=False)["input_ids"]
            ids, mask, plen = teacher_prompt_rows(ids, mask, plen, prompt_ids, ids.shape[0] // len(rows),
                                                  tokenizer.pad_token_id)
        return scoring.score_rows(teacher, ids, mask, plen)[0]
    return score
