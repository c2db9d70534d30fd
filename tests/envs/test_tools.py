"""Tools and the tool environment: parsing calls, running them bounded, and the calculator task."""

from __future__ import annotations

import json
import os
import threading

import pytest

from maxent_grpo.envs import ENVIRONMENTS
from maxent_grpo.envs.tool_env import ToolEnvironment
from maxent_grpo.envs.tools import CallTimeout, ToolCall, call_with_timeout, parse_tool_calls, run_tool_call
from maxent_grpo.tasks.calculator import calculator


def _call(name, **arguments):
    return "<tool_call>\n" + json.dumps({"name": name, "arguments": arguments}) + "\n</tool_call>"


def test_parse_reads_well_formed_calls_and_counts_malformed_ones():
    text = "Let me compute. " + _call("calculator", expression="2 * 3") + " and " + _call("other")
    assert parse_tool_calls(text) == ([ToolCall("calculator", {"expression": "2 * 3"}), ToolCall("other", {})], 0)
    assert parse_tool_calls("<tool_call>{not json}</tool_call>") == ([], 1)
    assert parse_tool_calls('<tool_call>{"arguments": {}}</tool_call>') == ([], 1)  # no name
    assert parse_tool_calls('<tool_call>{"name": "f", "arguments": [1]}</tool_call>') == ([], 1)
    assert parse_tool_calls('<tool_call>{"name": "f"') == ([], 1)  # never closed
    assert parse_tool_calls("no call at all") == ([], 0)


def test_calculator_evaluates_arithmetic_and_nothing_else():
    assert calculator("4821 * 37") == "178377"
    assert calculator("(10 - 4) / 4") == "1.5"
    assert calculator("-3 + 5") == "2"
    for bad in ("__import__('os')", "2 ** 3", "x + 1", "'a' * 3"):
        with pytest.raises(ValueError):
            calculator(bad)


def test_a_tool_failure_is_the_model_s_observation():
    tools = {"calculator": calculator}
    assert run_tool_call(ToolCall("calculator", {"expression": "6 * 7"}), tools, 5.0) == ("42", True)
    content, ok = run_tool_call(ToolCall("nope", {}), tools, 5.0)
    assert not ok and content.startswith("error: no tool named 'nope'")
    content, ok = run_tool_call(ToolCall("calculator", {"expr": "1"}), tools, 5.0)
    assert not ok and content.startswith("error: TypeError")

    def slow(x: int) -> str:
        """Never answers in time.

        Args:
            x: ignored
        """
        threading.Event().wait(60)
        return "late"

    content, ok = run_tool_call(ToolCall("slow", {"x": 1}), {"slow": slow}, 0.1)
    assert not ok and "timed out" in content


def test_call_with_timeout_returns_raises_and_times_out():
    assert call_with_timeout(lambda: 3, 10.0) == 3
    with pytest.raises(KeyError):
        call_with_timeout(lambda: {}["k"], 10.0)
    with pytest.raises(CallTimeout):
        call_with_timeout(lambda: threading.Event().wait(60), 0.05)


def test_the_tool_environment_answers_calls_and_ends_on_an_answer():
    env = ToolEnvironment([calculator])
    opening = env.reset({"prompt": "What is 6 * 7?"})
    assert opening == [{"role": "user", "content": "What is 6 * 7?"}]
    step = env.step(opening, {"role": "assistant", "content": _call("calculator", expression="6 * 7")})
    assert not step.done and step.observation == [{"role": "tool", "name": "calculator", "content": "42"}]
    assert step.info == {"tool_calls": 1.0, "tool_parse_failures": 0.0, "tool_errors": 0.0}
    bad = env.step(opening, {"role": "assistant", "content": "<tool_call>oops</tool_call>"})
    assert not bad.done and bad.info["tool_parse_failures"] == 1.0 and "could not parse" in bad.observation[0]["content"]
    end = env.step(opening, {"role": "assistant", "content": "6 * 7 = \\boxed{42}"})
    assert end.done and end.info["tool_calls"] == 0.0


def test_the_python_tool_runs_in_the_sandbox():
    from maxent_grpo.envs.python_tool import python

    assert python("print(6 * 7)") == "42\n"
    assert python("raise SystemExit('no')").startswith("error (exit 1): no")
    assert python(f"import os; print(os.getpid() == {os.getpid()})") == "False\n"  # its own process
    env = ENVIRONMENTS["python"]()
    step = env.step([], {"role": "assistant", "content": _call("python", code="print(sum(range(10)))")})
    assert step.observation == [{"role": "tool", "name": "python", "content": "45\n"}]
