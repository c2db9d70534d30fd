"""Multi-turn environments: the protocol, tools, the built-in environments and the episode rollout.

Importing the package registers every environment defined in it.
"""

from maxent_grpo.envs import calculator, python_tool
from maxent_grpo.envs.protocol import (
    ENVIRONMENT_COLUMN,
    ENVIRONMENTS,
    Environment,
    StepResult,
    register_environment,
)

# Imported for their registrations: the "calculator" and "python" environments.
REGISTERING_MODULES = (calculator, python_tool)

__all__ = ["ENVIRONMENT_COLUMN", "ENVIRONMENTS", "Environment", "StepResult", "register_environment"]
