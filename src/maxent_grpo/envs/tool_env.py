"""``ToolEnvironment``: the model calls tools until it answers without one.

Each assistant turn is parsed for tool calls (``envs/tools.py``); each call runs
with a timeout and its result comes back as a ``tool`` message. A turn with no
well-formed call ends the episode; its text is the answer the reward functions
score. A turn whose calls are all malformed gets an error message back (counted
as ``tool_parse_failures``) so the model may try again.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any

from maxent_grpo.envs.protocol import Message, StepResult
from maxent_grpo.envs.tools import parse_tool_calls, run_tool_call


def prompt_messages(row: Mapping[str, Any]) -> list[Message]:
    """The row's prompt as chat messages; none for a row without one (its environment gives it)."""
    prompt = row.get("prompt")
    if prompt is None or prompt == "":
        return []
    return [{"role": "user", "content": prompt}] if isinstance(prompt, str) else [dict(m) for m in prompt]


class ToolEnvironment:
    def __init__(self, tools: Sequence[Callable[..., Any]], *, call_timeout_s: float | None = 10.0):
        names = [fn.__name__ for fn in tools]
        if len(set(names)) != len(names):
            raise ValueError(f"tools: two functions share a name: {names}")
        self.tools = list(tools)
        self._by_name = dict(zip(names, self.tools))
        self.call_timeout_s = call_timeout_s

    def reset(self, row: Mapping[str, Any]) -> list[Message]:
        messages = prompt_messages(row)
        if not messages:
            raise ValueError("the row has no prompt")
        return messages

    def step(self, messages: Sequence[Message], assistant: Message) -> StepResult:
        calls, failures = parse_tool_calls(assistant["content"])
        if not calls and not failures:
            return StepResult(None, {"tool_calls": 0.0, "tool_parse_failures": 0.0})
        replies = []
        if not calls:
            replies.append({"role": "tool", "name": "error",
                            "content": 'error: could not parse the tool call; write <tool_call>{"name": ..., '
                                       '"arguments": {...}}</tool_call>'})
        ok = 0
        for call in calls:
            content, success = run_tool_call(call, self._by_name, self.call_timeout_s)
            ok += success
            replies.append({"role": "tool", "name": call.name, "content": content})
        return StepResult(replies, {"tool_calls": float(len(calls)), "tool_parse_failures": float(failures),
                                    "tool_errors": float(len(calls) - ok)})

    def get_reward(self) -> None:
        return None  # the configured reward functions score a tool episode
