"""``python``: a tool that runs model-written Python in the code sandbox and returns what it printed.

The program runs through ``rewards/sandbox.py`` (its own process, rlimits, no
network, read-only host files where the machine has namespaces: the same
isolation as the code rewards, docs/CODE_REWARDS.md). Registered as the
``python`` environment; ``environment.tools: [maxent_grpo.envs.python_tool:python]``
adds it to a run's own tools.
"""

from __future__ import annotations

from maxent_grpo.envs.protocol import register_environment
from maxent_grpo.envs.tool_env import ToolEnvironment
from maxent_grpo.rewards.sandbox import run_sandboxed

TIMEOUT_S = 5.0
MAX_CHARS = 2000  # of a result told to the model


def python(code: str) -> str:
    """Run a Python program in a sandbox and return what it prints.

    Args:
        code: The program. Print the values you need; nothing else is returned.
    """
    result = run_sandboxed(code, timeout_s=TIMEOUT_S, memory_mb=512)
    if result.timed_out:
        return f"error: the program ran past {TIMEOUT_S:g} s"
    if result.output_overflow:
        return "error: the program printed too much"
    if result.exit_code != 0:
        return f"error (exit {result.exit_code}): {result.stderr[-MAX_CHARS:].strip()}"
    return result.stdout[-MAX_CHARS:]


@register_environment("python")
def python_environment() -> ToolEnvironment:
    # The sandbox bounds the program itself; the call timeout only has to outlast it.
    return ToolEnvironment([python], call_timeout_s=TIMEOUT_S + 10.0)
