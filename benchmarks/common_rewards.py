"""The two reward functions both trainers use in every benchmark, in TRL's signature.

``f(prompts, completions, **columns) -> list[float]``: TRL passes every dataset
column as a keyword list, and so does our trainer for ``module:function``
rewards (``benchmarks.common_rewards:boxed_accuracy``). Completions may be
plain strings or TRL's conversational form (a list with one assistant message).

* ``boxed_accuracy``: the completion's last ``\\boxed{...}`` (or
  ``<answer>...</answer>``), scored by the reasoning-gym task's own scorer
  against the row's ``rg_entry`` (the task entry as JSON); 0 without an answer.
  The benchmark's own ``pair_sum`` task is scored by :func:`benchmarks.pair_sum.score_pair_sum`.
* ``boxed_format``: 1 when the completion states a final answer that way, else 0.
"""

from __future__ import annotations

import json
from collections.abc import Sequence

from benchmarks.pair_sum import TASK as PAIR_SUM, score_pair_sum
from maxent_grpo.tasks.answers import completion_text, extract_final_answer

# Weights of (boxed_accuracy, boxed_format), the same on both sides.
REWARD_NAMES = ("benchmarks.common_rewards:boxed_accuracy", "benchmarks.common_rewards:boxed_format")
REWARD_WEIGHTS = (1.0, 0.5)
DIGEST_REWARD = ("benchmarks.common_rewards:text_digest", 1.0)


def setting_rewards(digest_reward: bool) -> list[tuple[str, float]]:
    """``(module:function, weight)`` of a benchmark setting's rewards, the same on every side."""
    return list(zip(REWARD_NAMES, REWARD_WEIGHTS)) + ([DIGEST_REWARD] if digest_reward else [])


def boxed_accuracy(prompts: Sequence, completions: Sequence, rg_entry: Sequence[str], **columns) -> list[float]:
    """Task score in [0, 1] of each completion's final answer (reasoning-gym's scorer, imported only for
    its tasks: the GPU machine has no reasoning-gym and scores ``pair_sum``)."""
    if len(completions) != len(rg_entry):
        raise ValueError(f"rg_entry must have one entry per completion, got {len(rg_entry)} for {len(completions)}")
    scores = []
    for completion, entry_json in zip(completions, rg_entry):
        entry = json.loads(entry_json)
        predicted = extract_final_answer(completion_text(completion))
        if predicted is None:
            scores.append(0.0)
            continue
        source = entry["metadata"]["source_dataset"]
        if source == PAIR_SUM:
            score_fn = score_pair_sum
        else:
            import reasoning_gym

            score_fn = reasoning_gym.get_score_answer_fn(source)
        scores.append(float(score_fn(predicted, entry)))
    return scores


def text_digest(prompts: Sequence, completions: Sequence, **columns) -> list[float]:
    """The completion text's CRC-32 over 2**32, in [0, 1): a reward that differs within a group of a
    random model's completions, the same on every side for the same text (benchmarks/gpu.py)."""
    import zlib

    return [zlib.crc32(completion_text(c).encode()) / 2**32 for c in completions]


def boxed_format(prompts: Sequence, completions: Sequence, **columns) -> list[float]:
    """1.0 when the completion ends its reasoning with a boxed (or tagged) final answer."""
    return [0.0 if extract_final_answer(completion_text(c)) is None else 1.0 for c in completions]
