"""Final-answer extraction and canonicalisation, shared by tasks, rewards, evaluation and SEED clustering.

Pure string functions: no model, no math-verify. `extract_final_answer` finds what
a completion claims as its answer; `canonical_answer` maps equal answers written
differently (`4`, `4.0`, `$4$`, ` 4.`) to one string so that they compare equal.
"""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence
from decimal import Decimal, InvalidOperation

_BOXED = re.compile(r"\\(?:boxed|fbox)\s*\{")
_ANSWER_TAG = re.compile(r"<answer>(.*?)</answer>", re.DOTALL)


def _matching_braces(text: str) -> dict[int, int]:
    """Index of each `{` -> index of its matching `}` (unclosed ones are absent), in one pass."""
    pairs: dict[int, int] = {}
    stack: list[int] = []
    for i, char in enumerate(text):
        if char == "{":
            stack.append(i)
        elif char == "}" and stack:
            pairs[stack.pop()] = i
    return pairs


def extract_boxed(text: str) -> str | None:
    """The content of the last non-empty `\\boxed{...}` (nested braces allowed),
    stripped; None when there is none. A `\\boxed{` left unclosed (a truncated
    completion) does not count, and an earlier complete box is used instead."""
    if not isinstance(text, str):
        raise ValueError(f"text must be a str, got {type(text).__name__}")
    matches = list(_BOXED.finditer(text))
    if not matches:
        return None
    pairs = _matching_braces(text)
    for match in reversed(matches):
        open_index = match.end() - 1
        if open_index in pairs:
            content = text[open_index + 1 : pairs[open_index]].strip()
            if content:
                return content
    return None


def extract_final_answer(text: str) -> str | None:
    """The last complete non-empty `\\boxed{...}`, else the last non-empty
    `<answer>...</answer>`, stripped; None when there is neither."""
    boxed = extract_boxed(text)
    if boxed is not None:
        return boxed
    for content in reversed(_ANSWER_TAG.findall(text)):
        if content.strip():
            return content.strip()
    return None


_TEXT_WRAPPER = re.compile(r"\\(?:text|textbf|mathrm|mbox)\s*\{([^{}]*)\}")
_LATEX_SPACES = re.compile(r"\\[,;:! ]|\\quad|\\qquad|~")
_THOUSANDS = re.compile(r"^[+-]?\d{1,3}(,\d{3})+(\.\d+)?$")


def _canonical_number(text: str) -> str | None:
    """`4.0` -> `4`, `+0.50` -> `0.5`, `-0` -> `0`; None if not a plain decimal number."""
    if len(text) > 64:  # int() of a huge digit string is slow and str() of it raises
        return None
    if _THOUSANDS.match(text):
        text = text.replace(",", "")
    if not re.fullmatch(r"[+-]?(\d+\.?\d*|\.\d+)", text):
        return None
    try:
        value = Decimal(text)
    except InvalidOperation:
        return None
    if value == 0:
        return "0"
    if value == value.to_integral_value():
        return str(int(value))
    return format(value.normalize(), "f")


def canonical_answer(text: str) -> str:
    """A normal form for comparing answers as strings.

    Removes all whitespace and LaTeX spacing commands, `$` delimiters, `\\left` /
    `\\right`, `\\text{...}`-style wrappers and trailing full stops, rewrites
    `\\dfrac` / `\\tfrac` as `\\frac`, and writes plain numbers in one way
    (`4.0` -> `4`, `1,000` -> `1000`, `0.50` -> `0.5`). Case is kept: `A` and `a`
    may be different answers.
    """
    if not isinstance(text, str):
        raise ValueError(f"text must be a str, got {type(text).__name__}")
    out = _LATEX_SPACES.sub("", text)
    out = _TEXT_WRAPPER.sub(r"\1", out)
    out = out.replace("$", "").replace("\\left", "").replace("\\right", "")
    out = out.replace("\\dfrac", "\\frac").replace("\\tfrac", "\\frac")
    out = re.sub(r"\s+", "", out)
    out = out.rstrip(".")
    number = _canonical_number(out)
    return out if number is None else number


def _content_text(content: object) -> str:
    if isinstance(content, str):
        return content
    # Multimodal messages carry a list of parts; only the text parts make the answer.
    if isinstance(content, Sequence) and all(isinstance(part, Mapping) for part in content):
        return "".join(str(part["text"]) for part in content if part.get("type") == "text")
    raise ValueError(f"message content must be a str or a list of parts, got {type(content).__name__}")


def completion_text(completion: str | Sequence[Mapping[str, object]]) -> str:
    """The text of a completion: a str as is, or the content of the last assistant
    message of a conversational completion (TRL's list of `{"role", "content"}` dicts)."""
    if isinstance(completion, str):
        return completion
    if isinstance(completion, Sequence) and all(isinstance(m, Mapping) for m in completion):
        for message in reversed(completion):
            if message.get("role") == "assistant":
                return _content_text(message.get("content", ""))
        roles = [m.get("role") for m in completion]
        raise ValueError(f"completion has no assistant message (roles: {roles})")
    raise ValueError(
        f"completion must be a str or a list of message dicts, got {type(completion).__name__}"
    )
