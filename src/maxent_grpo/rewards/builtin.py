"""Built-in reward functions, in TRL's GRPOTrainer calling convention.

Every reward function is called as `f(prompts=..., completions=..., **columns)`
and returns one `float | None` per completion (None: not applicable to that row).
`completions` holds strings or TRL's conversational form (a list of message
dicts, scored on the last assistant message); `columns` carries the dataset
columns (`answer`, `rg_entry`, `task`, ...) as lists aligned with completions.

Each built-in comes from a factory `make_<name>(**options) -> reward function`
that validates its options once; `<name>_reward` is the factory's default.
Lengths are measured in characters unless `unit="tokens"`, which reads the
`completion_ids` column (token id lists, as TRL passes them).
"""

from __future__ import annotations

import json
import math
import re
import threading
from collections.abc import Callable, Mapping, Sequence
from typing import Any, Literal

from maxent_grpo.rewards.catalog import RewardFunction, register_reward
from maxent_grpo.tasks.answers import canonical_answer, completion_text, extract_boxed, extract_final_answer

LengthUnit = Literal["chars", "tokens"]


def _named(fn: RewardFunction, name: str) -> RewardFunction:
    # TRL and our logs label each reward column by the function's __name__.
    fn.__name__ = name
    fn.__qualname__ = name
    return fn


def _column(columns: Mapping[str, Any], key: str, n: int, reward: str) -> list[Any]:
    if key not in columns:
        raise ValueError(f"reward '{reward}' needs the dataset column '{key}'; columns available: {sorted(columns)}")
    values = columns[key]
    if len(values) != n:
        raise ValueError(f"reward '{reward}': column '{key}' has {len(values)} values for {n} completions")
    return list(values)


def _texts(completions: Sequence[Any]) -> list[str]:
    return [completion_text(c) for c in completions]


def _lengths(texts: list[str], columns: Mapping[str, Any], unit: LengthUnit, reward: str) -> list[int]:
    if unit == "chars":
        return [len(t) for t in texts]
    return [len(ids) for ids in _column(columns, "completion_ids", len(texts), reward)]


def _check_unit(unit: str) -> None:
    if unit not in ("chars", "tokens"):
        raise ValueError(f"unit must be 'chars' or 'tokens', got {unit!r}")


def _gold(value: Any) -> str | None:
    """A usable gold answer as a string, or None when the row has none."""
    if value is None:
        return None
    text = str(value).strip()
    return text or None


# ---------------------------------------------------------------- math-verify


def _check_main_thread(timeout_seconds: int | None, reward: str) -> None:
    # math-verify bounds its time with signal.alarm, which only the main thread may set.
    if timeout_seconds and threading.current_thread() is not threading.main_thread():
        raise RuntimeError(
            f"reward '{reward}' uses math-verify with timeout_seconds={timeout_seconds}, which needs the "
            "main thread (signal.alarm); call rewards from the main thread or a worker process, "
            "or set timeout_seconds=None"
        )


def _parse_gold(gold: str, timeout_seconds: int | None) -> list[Any]:
    from math_verify import parse

    parsed = parse(gold, parsing_timeout=timeout_seconds)
    if not parsed:
        # Bare LaTeX golds (`x+1`, `\sqrt{2}`) need math delimiters to be found.
        parsed = parse(f"${gold}$", parsing_timeout=timeout_seconds)
    return parsed


def _verify(gold_parsed: list[Any], prediction: str, timeout_seconds: int | None) -> bool:
    from math_verify import parse, verify

    predicted = parse(prediction, parsing_timeout=timeout_seconds)
    return bool(verify(gold_parsed, predicted, timeout_seconds=timeout_seconds))


def _math_verdicts(golds: list[Any], texts: list[str], timeout_seconds: int | None) -> list[bool | None]:
    """math-verify's verdict on each text against its gold; None where there is no gold or
    it does not parse. Each distinct gold is parsed once (a group shares its prompt's gold)."""
    parsed: dict[str, list[Any]] = {}
    out: list[bool | None] = []
    for gold, text in zip(golds, texts):
        gold_text = _gold(gold)
        if gold_text is None:
            out.append(None)
            continue
        if gold_text not in parsed:
            parsed[gold_text] = _parse_gold(gold_text, timeout_seconds)
        out.append(_verify(parsed[gold_text], text, timeout_seconds) if parsed[gold_text] else None)
    return out


def _check_timeout(timeout_seconds: int | None) -> None:
    if timeout_seconds is not None and (not isinstance(timeout_seconds, int) or timeout_seconds < 1):
        raise ValueError(f"timeout_seconds must be a positive int or None, got {timeout_seconds!r}")


@register_reward("accuracy")
def make_accuracy(*, timeout_seconds: int | None = 5) -> RewardFunction:
    """1.0 when math-verify finds the completion equal to the `answer` column
    (`verify(parse(gold), parse(completion))`, gold first), else 0.0. None when the
    row has no gold answer or the gold does not parse as math."""
    _check_timeout(timeout_seconds)

    def accuracy(prompts, completions, **columns) -> list[float | None]:
        _check_main_thread(timeout_seconds, "accuracy")
        golds = _column(columns, "answer", len(completions), "accuracy")
        verdicts = _math_verdicts(golds, _texts(completions), timeout_seconds)
        return [None if v is None else float(v) for v in verdicts]

    return _named(accuracy, "accuracy")


@register_reward("boxed_accuracy")
def make_boxed_accuracy(*, timeout_seconds: int | None = 5) -> RewardFunction:
    """1.0 when the completion's final answer (last `\\boxed{}`, else `<answer>`)
    equals the gold canonically (`canonical_answer`) or, failing that, by
    math-verify; 0.0 when it differs or there is no final answer; None without gold."""
    _check_timeout(timeout_seconds)

    def boxed_accuracy(prompts, completions, **columns) -> list[float | None]:
        _check_main_thread(timeout_seconds, "boxed_accuracy")
        golds = _column(columns, "answer", len(completions), "boxed_accuracy")
        out: list[float | None] = []
        for gold, text in zip(golds, _texts(completions)):
            gold_text = _gold(gold)
            if gold_text is None:
                out.append(None)
                continue
            predicted = extract_final_answer(text)
            if predicted is None:
                out.append(0.0)
                continue
            gold_answer = extract_final_answer(gold_text) or gold_text
            if canonical_answer(predicted) == canonical_answer(gold_answer):
                out.append(1.0)
                continue
            gold_parsed = _parse_gold(gold_answer, timeout_seconds)
            correct = bool(gold_parsed) and _verify(gold_parsed, f"\\boxed{{{predicted}}}", timeout_seconds)
            out.append(float(correct))
        return out

    return _named(boxed_accuracy, "boxed_accuracy")


# ------------------------------------------------------------------ format


@register_reward("format")
def make_format(*, style: Literal["boxed", "answer_tag"] = "boxed", pattern: str | None = None) -> RewardFunction:
    """1.0 when the completion has the expected answer format, else 0.0.

    `style="boxed"`: a complete non-empty `\\boxed{...}`; `"answer_tag"`: a
    non-empty `<answer>...</answer>`; `pattern`: a regex searched (DOTALL) in the
    completion instead of either style.
    """
    if style not in ("boxed", "answer_tag"):
        raise ValueError(f"style must be 'boxed' or 'answer_tag', got {style!r}")
    regex = None
    if pattern is not None:
        try:
            regex = re.compile(pattern, re.DOTALL)
        except re.error as exc:
            raise ValueError(f"pattern is not a valid regular expression: {exc}") from exc

    def has_format(text: str) -> bool:
        if regex is not None:
            return regex.search(text) is not None
        if style == "boxed":
            return extract_boxed(text) is not None
        return re.search(r"<answer>\s*\S.*?</answer>", text, re.DOTALL) is not None

    def format_reward(prompts, completions, **columns) -> list[float | None]:
        return [float(has_format(t)) for t in _texts(completions)]

    return _named(format_reward, "format")


_TAGS = ("<think>", "</think>", "<answer>", "</answer>")
_TAG_FORMAT = re.compile(r"\s*<think>.*?</think>\s*<answer>\s*\S.*?</answer>\s*", re.DOTALL)


@register_reward("tag_format")
def make_tag_format() -> RewardFunction:
    """1.0 for `<think>...</think><answer>...</answer>` and nothing else around it
    (whitespace aside), each tag exactly once and a non-empty answer; else 0.0."""

    def tag_format(prompts, completions, **columns) -> list[float | None]:
        return [
            float(_TAG_FORMAT.fullmatch(t) is not None and all(t.count(tag) == 1 for tag in _TAGS))
            for t in _texts(completions)
        ]

    return _named(tag_format, "tag_format")


@register_reward("tag_count")
def make_tag_count() -> RewardFunction:
    """0.25 for each of `<think>`, `</think>`, `<answer>`, `</answer>` that occurs
    exactly once: partial credit on the way to `tag_format`."""

    def tag_count(prompts, completions, **columns) -> list[float | None]:
        return [0.25 * sum(t.count(tag) == 1 for tag in _TAGS) for t in _texts(completions)]

    return _named(tag_count, "tag_count")


_STEP_MARKERS = re.compile(
    r"^\s*Step\s*\d+\s*[:.]|^\s*\d+[.)]\s|^\s*[-*]\s|\b(?:First|Second|Third|Next|Then|Finally),",
    re.MULTILINE,
)


@register_reward("reasoning_steps")
def make_reasoning_steps(*, min_steps: int = 3) -> RewardFunction:
    """`min(1, count / min_steps)` where `count` is the number of step markers
    (`Step 1:`, `1.` list items, `-`/`*` bullets, `First,` ... `Finally,`)."""
    if not isinstance(min_steps, int) or min_steps < 1:
        raise ValueError(f"min_steps must be a positive int, got {min_steps!r}")

    def reasoning_steps(prompts, completions, **columns) -> list[float | None]:
        return [min(1.0, len(_STEP_MARKERS.findall(t)) / min_steps) for t in _texts(completions)]

    return _named(reasoning_steps, "reasoning_steps")


# ------------------------------------------------------------------ length


@register_reward("cosine_length")
def make_cosine_length(
    *,
    min_value_wrong: float = -1.0,
    max_value_wrong: float = -0.5,
    min_value_correct: float = 0.5,
    max_value_correct: float = 1.0,
    max_len: int = 1000,
    unit: LengthUnit = "chars",
    timeout_seconds: int | None = 5,
) -> RewardFunction:
    """Correctness scaled by length along a half cosine (open-r1's cosine scaled reward).

    With `p = min(length / max_len, 1)` and `c = cos(pi * p)` (1 at length 0,
    -1 at `max_len` and beyond), the reward is `lo + (hi - lo) * (1 + c) / 2`:
    a correct answer goes from `max_value_correct` (empty) down to
    `min_value_correct` (at `max_len`), so shorter right answers earn more; a wrong
    one goes from `min_value_wrong` up to `max_value_wrong`, so a long wrong attempt
    is punished less than a short one. Correctness is math-verify's, as in
    `accuracy`; None when the row has no (parseable) gold.
    """
    if not min_value_wrong <= max_value_wrong:
        raise ValueError(f"min_value_wrong={min_value_wrong} must be <= max_value_wrong={max_value_wrong}")
    if not min_value_correct <= max_value_correct:
        raise ValueError(f"min_value_correct={min_value_correct} must be <= max_value_correct={max_value_correct}")
    if not isinstance(max_len, int) or max_len < 1:
        raise ValueError(f"max_len must be a positive int, got {max_len!r}")
    _check_unit(unit)
    _check_timeout(timeout_seconds)

    def cosine_length(prompts, completions, **columns) -> list[float | None]:
        _check_main_thread(timeout_seconds, "cosine_length")
        texts = _texts(completions)
        golds = _column(columns, "answer", len(texts), "cosine_length")
        lengths = _lengths(texts, columns, unit, "cosine_length")
        out: list[float | None] = []
        for correct, length in zip(_math_verdicts(golds, texts, timeout_seconds), lengths):
            if correct is None:
                out.append(None)
                continue
            cosine = math.cos(math.pi * min(length / max_len, 1.0))
            start, end = (max_value_correct, min_value_correct) if correct else (min_value_wrong, max_value_wrong)
            # (1 + c) / 2 runs from 1 at length 0 to 0 at max_len: interpolate start -> end.
            out.append(end + (start - end) * (1.0 + cosine) / 2.0)
        return out

    return _named(cosine_length, "cosine_length")


@register_reward("length")
def make_length(
    *, max_length: int = 1000, direction: Literal["penalise", "favour"] = "penalise", unit: LengthUnit = "chars"
) -> RewardFunction:
    """`-min(length, max_length) / max_length` (`direction="penalise"`, in [-1, 0])
    or the same without the sign (`"favour"`, in [0, 1]): a linear length shaping,
    independent of correctness; weight it small beside an accuracy reward."""
    if not isinstance(max_length, int) or max_length < 1:
        raise ValueError(f"max_length must be a positive int, got {max_length!r}")
    if direction not in ("penalise", "favour"):
        raise ValueError(f"direction must be 'penalise' or 'favour', got {direction!r}")
    _check_unit(unit)
    sign = -1.0 if direction == "penalise" else 1.0

    def length(prompts, completions, **columns) -> list[float | None]:
        lengths = _lengths(_texts(completions), columns, unit, "length")
        return [sign * min(n, max_length) / max_length for n in lengths]

    return _named(length, "length")


@register_reward("soft_overlong")
def make_soft_overlong(*, max_completion_len: int, soft_punish_cache: int) -> RewardFunction:
    """DAPO's soft overlong punishment (arXiv 2503.14476 Eq. 13; TRL ``get_soft_overlong_punishment``,
    verl ``overlong_buffer``): with ``L`` the completion's tokens, ``0`` for ``L <= L_max - L_cache``,
    ``(L_max - L_cache - L) / L_cache`` up to ``L_max`` (a linear fall to -1), ``-1`` beyond.
    Add it beside the task reward (weight 1, as DAPO does); set ``max_completion_len`` to
    ``generation.max_new_tokens``. Reads ``completion_ids``."""
    if isinstance(max_completion_len, bool) or not isinstance(max_completion_len, int) or max_completion_len < 1:
        raise ValueError(f"max_completion_len must be a positive int, got {max_completion_len!r}")
    if (isinstance(soft_punish_cache, bool) or not isinstance(soft_punish_cache, int)
            or not 0 <= soft_punish_cache < max_completion_len):
        raise ValueError(f"soft_punish_cache must be an int in [0, max_completion_len), got {soft_punish_cache!r}")
    free = max_completion_len - soft_punish_cache

    def soft_overlong(prompts, completions, **columns) -> list[float | None]:
        out: list[float | None] = []
        for length in (len(ids) for ids in _column(columns, "completion_ids", len(completions), "soft_overlong")):
            if length <= free:
                out.append(0.0)
            elif length <= max_completion_len:
                out.append((free - length) / soft_punish_cache)
            else:
                out.append(-1.0)
        return out

    return _named(soft_overlong, "soft_overlong")


@register_reward("repetition_penalty")
def make_repetition_penalty(*, ngram_size: int = 3, max_penalty: float = -1.0) -> RewardFunction:
    """`max_penalty * (1 - distinct / total)` over the completion's word n-grams
    (lower-cased, whitespace-split): 0 for no repeated n-gram, approaching
    `max_penalty` as the text repeats itself. 0 when there are fewer words than
    `ngram_size`."""
    if not isinstance(ngram_size, int) or ngram_size < 1:
        raise ValueError(f"ngram_size must be a positive int, got {ngram_size!r}")
    if not max_penalty <= 0:
        raise ValueError(f"max_penalty must be <= 0, got {max_penalty}")

    def penalty(text: str) -> float:
        words = text.lower().split()
        if len(words) < ngram_size:
            return 0.0
        ngrams = [tuple(words[i : i + ngram_size]) for i in range(len(words) - ngram_size + 1)]
        repeated = 1.0 - len(set(ngrams)) / len(ngrams)
        return max_penalty * repeated if repeated > 0 else 0.0

    def repetition_penalty(prompts, completions, **columns) -> list[float | None]:
        return [penalty(t) for t in _texts(completions)]

    return _named(repetition_penalty, "repetition_penalty")


# ---------------------------------------------------------------- reasoning-gym


@register_reward("reasoning_gym")
def make_reasoning_gym(*, entry_column: str = "rg_entry", task_column: str = "task") -> RewardFunction:
    """The task's own scorer: `score_answer(final_answer, entry)` from reasoning-gym.

    `entry_column` holds the reasoning-gym entry (a JSON string, as
    `load_prompt_dataset("reasoning_gym:<task>")` writes it, or a dict);
    `task_column` names the task (when absent, the entry's
    `metadata.source_dataset` does). The final answer is the completion's last
    `\\boxed{}` / `<answer>` (None when missing, which the scorers give 0).
    """

    scorers: dict[str, Callable[[str | None, dict[str, Any]], float]] = {}

    def scorer(task: str) -> Callable[[str | None, dict[str, Any]], float]:
        if task not in scorers:
            import reasoning_gym

            scorers[task] = reasoning_gym.get_score_answer_fn(task)
        return scorers[task]

    def reasoning_gym_reward(prompts, completions, **columns) -> list[float | None]:
        texts = _texts(completions)
        entries = _column(columns, entry_column, len(texts), "reasoning_gym")
        tasks = _column(columns, task_column, len(texts), "reasoning_gym") if task_column in columns else None
        out: list[float | None] = []
        for row, (entry, text) in enumerate(zip(entries, texts)):
            if entry is None:
                out.append(None)
                continue
            record = json.loads(entry) if isinstance(entry, str) else dict(entry)
            task = tasks[row] if tasks is not None else record["metadata"]["source_dataset"]
            out.append(float(scorer(task)(extract_final_answer(text), record)))
        return out

    return _named(reasoning_gym_reward, "reasoning_gym")


ENV_REWARD_COLUMN = "environment_reward"  # each episode's score from its environment (envs/)


@register_reward("environment")
def make_environment() -> RewardFunction:
    """The environment's own score of each multi-turn episode (TRL's ``get_reward``), None where it gave none.

    Reads the ``environment_reward`` column the training pipeline adds when the run plays episodes.
    """

    def environment_reward(prompts, completions, **columns) -> list[float | None]:
        return [None if r is None else float(r)
                for r in _column(columns, ENV_REWARD_COLUMN, len(completions), "environment")]

    return _named(environment_reward, "environment")


accuracy_reward = make_accuracy()
boxed_accuracy_reward = make_boxed_accuracy()
format_reward = make_format()
tag_format_reward = make_tag_format()
tag_count_reward = make_tag_count()
reasoning_steps_reward = make_reasoning_steps()
cosine_length_reward = make_cosine_length()
length_reward = make_length()
repetition_penalty_reward = make_repetition_penalty()
reasoning_gym_reward = make_reasoning_gym()
