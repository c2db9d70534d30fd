"""The ``calculator`` environment: ``tasks/calculator.py``'s tool, behind :class:`ToolEnvironment`."""

from __future__ import annotations

from maxent_grpo.envs.protocol import register_environment
from maxent_grpo.envs.tool_env import ToolEnvironment
from maxent_grpo.tasks.calculator import calculator


@register_environment("calculator")
def calculator_environment() -> ToolEnvironment:
    return ToolEnvironment([calculator], call_timeout_s=5.0)
