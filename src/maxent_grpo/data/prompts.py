"""How a prompt reaches the model: the tokenizer's chat template over the prompt's
messages, with an optional system prompt and few-shot turns. Training, in-loop
validation and ``maxent-grpo eval`` all format through :func:`format_prompt`."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass


@dataclass
class FewShotExample:
    """One demonstration: a user turn and the assistant's reply, placed before every prompt."""

    prompt: str
    completion: str


def format_prompt(
    tokenizer,
    prompt: str | Sequence[Mapping[str, str]],
    *,
    system_prompt: str | None = None,
    few_shot: Sequence[FewShotExample] = (),
) -> str:
    """The prompt as the model sees it: the tokenizer's chat template applied with
    the generation prompt opened. A str becomes one user message; a message list
    is used as is. `system_prompt` is prepended (an error if the prompt has its own);
    each `few_shot` example becomes a user turn and an assistant turn, after any
    system message and before the prompt's own messages."""
    if not tokenizer.chat_template:
        raise ValueError(f"tokenizer of {tokenizer.name_or_path!r} has no chat template; prompts cannot be formatted")
    messages = prompt_messages(prompt, system_prompt=system_prompt, few_shot=few_shot)
    text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    if not isinstance(text, str):
        raise ValueError(f"chat template of {tokenizer.name_or_path!r} returned {type(text).__name__}, not a str")
    return text


def prompt_messages(
    prompt: str | Sequence[Mapping[str, str]],
    *,
    system_prompt: str | None = None,
    few_shot: Sequence[FewShotExample] = (),
) -> list[dict]:
    """The messages :func:`format_prompt` renders (an episode's opening gets the same frame)."""
    if isinstance(prompt, str):
        messages = [{"role": "user", "content": prompt}]
    elif isinstance(prompt, Sequence) and all(isinstance(m, Mapping) for m in prompt):
        messages = [dict(m) for m in prompt]
    else:
        raise ValueError(f"prompt must be a str or a list of messages, got {type(prompt).__name__}")
    if system_prompt is not None:
        if any(m.get("role") == "system" for m in messages):
            raise ValueError("system_prompt is set but the prompt has its own system message")
        messages = [{"role": "system", "content": system_prompt}, *messages]
    if few_shot:
        head = 1 if messages[0].get("role") == "system" else 0
        turns = [
            turn for ex in few_shot
            for turn in ({"role": "user", "content": ex.prompt}, {"role": "assistant", "content": ex.completion})
        ]
        messages = [*messages[:head], *turns, *messages[head:]]
    return messages


def longest_prompt_tokens(
    tokenizer, prompts: Sequence[str | Sequence[Mapping[str, str]]], *, system_prompt: str | None = None,
    few_shot: Sequence[FewShotExample] = (),
) -> int:
    """The longest of ``prompts`` in tokens, formatted as the sampler sees them (``format_prompt``, no special
    tokens added): what a vLLM engine must fit besides the completion."""
    if not prompts:
        raise ValueError("prompts must not be empty")
    texts = [format_prompt(tokenizer, p, system_prompt=system_prompt, few_shot=few_shot) for p in prompts]
    return max(len(ids) for ids in tokenizer(texts, add_special_tokens=False)["input_ids"])
