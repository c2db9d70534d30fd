"""Tools: plain Python functions the model calls by writing a tool call in its turn.

The model learns of the tools through the chat template's ``tools=`` argument
(transformers renders each function's JSON schema, read from its signature and
docstring by ``get_json_schema``). A template that ignores ``tools`` (SmolLM2's)
gets the Hermes convention instead, as a system message: the schemas inside
``<tools></tools>`` and calls written as ``<tool_call>{"name": ..., "arguments":
{...}}</tool_call>``. That is also the format Qwen2.5's template asks for, so one
parser reads both.

Every call runs with a timeout (:func:`call_with_timeout`): in a daemon thread,
because a Python function cannot be killed. A call that times out keeps its
thread until it returns; the episode goes on with an error message. Code that
must be isolated belongs in the sandbox (``rewards/sandbox.py``).
"""

from __future__ import annotations

import json
import queue
import re
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from transformers.utils import get_json_schema

_CALL = re.compile(r"<tool_call>(.*?)</tool_call>", re.DOTALL)


class CallTimeout(Exception):
    """A call ran past its timeout."""


@dataclass(frozen=True)
class ToolCall:
    name: str
    arguments: dict[str, Any]


def tool_schemas(tools: Sequence[Callable[..., Any]]) -> list[dict]:
    """Each function's JSON schema (``{"type": "function", "function": {...}}``), as templates take them."""
    return [get_json_schema(fn) for fn in tools]


def hermes_system_prompt(tools: Sequence[Callable[..., Any]]) -> str:
    """The tool description for a chat template that does not render ``tools`` itself."""
    lines = "\n".join(json.dumps(s) for s in tool_schemas(tools))
    return (
        "You may call one or more functions to help with the user query. The functions are:\n"
        f"<tools>\n{lines}\n</tools>\n"
        "To call a function, write a JSON object with the function name and its arguments inside "
        'tags:\n<tool_call>\n{"name": <function-name>, "arguments": <args-json-object>}\n</tool_call>'
    )


def template_renders_tools(tokenizer, tools: Sequence[Callable[..., Any]]) -> bool:
    """True when the chat template puts ``tools`` into the prompt (else it silently drops them)."""
    probe = [{"role": "user", "content": "x"}]
    plain = tokenizer.apply_chat_template(probe, tokenize=False, add_generation_prompt=True)
    with_tools = tokenizer.apply_chat_template(probe, tools=tool_schemas(tools), tokenize=False,
                                               add_generation_prompt=True)
    return plain != with_tools


def parse_tool_calls(text: str) -> tuple[list[ToolCall], int]:
    """The well-formed tool calls in ``text`` and the number of malformed ones.

    Well-formed: ``<tool_call>`` JSON object with a str ``name`` and a dict ``arguments``
    (an absent ``arguments`` is ``{}``).
    """
    calls, failures = [], 0
    for body in _CALL.findall(text):
        try:
            obj = json.loads(body.strip())
        except json.JSONDecodeError:
            failures += 1
            continue
        if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
            failures += 1
            continue
        args = obj.get("arguments", {})
        if not isinstance(args, dict):
            failures += 1
            continue
        calls.append(ToolCall(obj["name"], args))
    # An opened tag that never closes is a malformed call too.
    failures += max(text.count("<tool_call>") - text.count("</tool_call>"), 0)
    return calls, failures


def call_with_timeout(fn: Callable[[], Any], timeout_s: float | None) -> Any:
    """``fn()``, or :class:`CallTimeout` after ``timeout_s`` seconds (None: wait). Its exception is re-raised."""
    if timeout_s is None:
        return fn()
    box: queue.Queue = queue.Queue(maxsize=1)

    def run() -> None:
        try:
            box.put((True, fn()))
        except BaseException as exc:  # noqa: BLE001 - handed to the caller, which re-raises it
            box.put((False, exc))

    threading.Thread(target=run, daemon=True, name="maxent-grpo-call").start()
    try:
        ok, value = box.get(timeout=timeout_s)
    except queue.Empty:
        raise CallTimeout(f"no answer within {timeout_s:g} s") from None
    if not ok:
        raise value
    return value


def run_tool_call(call: ToolCall, tools: dict[str, Callable[..., Any]], timeout_s: float | None) -> tuple[str, bool]:
    """The tool message's content for ``call`` and whether the call succeeded.

    A failure (unknown tool, wrong arguments, the tool raised or timed out) is told
    to the model as the message, as TRL and verl do: it is the episode's content, not
    an environment failure.
    """
    fn = tools.get(call.name)
    if fn is None:
        return f"error: no tool named {call.name!r}; tools: {', '.join(sorted(tools))}", False
    try:
        result = call_with_timeout(lambda: fn(**call.arguments), timeout_s)
    except CallTimeout as exc:
        return f"error: {call.name} timed out ({exc})", False
    except Exception as exc:  # noqa: BLE001 - a user tool's error is the model's observation
        return f"error: {type(exc).__name__}: {exc}", False
    return result if isinstance(result, str) else json.dumps(result), True
