"""Multi-turn environments: the protocol, tools, the built-in environments and the episode rollout.

Importing the package registers every environment defined in it.
"""

from maxent_grpo.envs import calculator, python_tool  # noqa: F401 - register "calculator" and "python"
from maxent_grpo.envs.protocol import (
    ENVIRONMENT_COLUMN,
    ENVIRONMENTS,
    Environment,
    StepResult,
    register_environment,
)

__all__ = ["ENVIRONMENT_COLUMN", "ENVIRONMENTS", "Environment", "StepResult", "register_environment"]
