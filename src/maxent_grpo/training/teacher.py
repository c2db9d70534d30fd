"""On-policy distillation's teacher (ALGORITHMS.md §19): the ``teacher:`` section,
its plan, and the frozen teacher scored on the student's own rows.

The teacher is a second frozen model loaded like the reference (``strategy.load_reference``: whole on
each process under DDP, sharded under FSDP2) and scored on the packed rows after generation, so it
works with every generation backend. It scores the student's token ids as they are: its tokenizer
must be the student's (same vocabulary); a teacher with another tokenizer or chat template is refused.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

from maxent_grpo.core.logprobs import Scoring
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
    rewards: bool = field(default=True, metadata={"help": (
        "also train on the rewards' advantages (false: distillation alone, the advantages set to 0; the "
        "rewards are still computed and logged)")})


@dataclass(frozen=True)
class TeacherPlan:
    name_or_path: str
    dtype: str


class TeacherError(UserError):
    """The teacher cannot score the student's rows (another vocabulary)."""


def check_teacher(t: TeacherPlan, student_path: str) -> str:
    """The teacher's resolved path; one line when its vocabulary is not the student's (it would score
    other tokens). Run before any model loads."""
    teacher_path = resolve_model_path(t.name_or_path)
    theirs = load_tokenizer(teacher_path).get_vocab()
    ours = load_tokenizer(student_path).get_vocab()
    if theirs != ours:
        raise TeacherError(
            f"teacher.name_or_path: {teacher_path} has another tokenizer ({len(theirs)} tokens, the student's "
            f"{len(ours)}, {len(set(theirs.items()) ^ set(ours.items()))} differ); the teacher must share the "
            "student's vocabulary (cross-tokenizer distillation is not supported)")
    return teacher_path


def teacher_scorer(t: TeacherPlan, teacher_path: str, scoring: Scoring, strategy: Strategy):
    """(input_ids, attention_mask, prompt_length) -> the teacher's completion log-probs ``[N, T]``
    (``teacher_path``: :func:`check_teacher`'s)."""
    teacher = strategy.load_reference(teacher_path, dtype=t.dtype)

    def score(ids, mask, plen):
        return scoring.score_rows(teacher, ids, mask, plen)[0]
    return score
